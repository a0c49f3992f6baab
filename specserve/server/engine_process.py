"""The engine's own process: it owns the model, the scheduler and the KV cache and steps them.

The HTTP process talks to it over two multiprocessing queues, so model work never blocks the
event loop. Commands in: ("add", rid, input_ids, sampling_params), ("abort", rid), ("shutdown",).
Events out, one list per loop iteration: ("ready", info), ("tokens", rid, ids), ("done", rid,
output dict), ("error", rid, message), ("load", dict) and ("fatal", message) when the engine
cannot go on (the HTTP side then fails every open request loudly instead of hanging).
"""

from __future__ import annotations

import os
import queue
import signal
import traceback
from typing import Any

IDLE_POLL_S = 0.5  # how often an idle engine checks that its parent is still alive


def engine_main(engine_kwargs: dict[str, Any], commands, events) -> None:
    """Process entry point (spawned): build the Engine, then serve commands until shutdown."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the HTTP process decides when to stop
    try:
        from specserve.engine import Engine

        engine = Engine(**engine_kwargs)
    except Exception as exc:  # a bad flag or model: report it, the server exits with the message
        events.put([("fatal", f"engine failed to start: {type(exc).__name__}: {exc}")])
        return
    events.put([("ready", _ready_info(engine))])
    try:
        with engine.sanitized():
            EngineServer(engine, commands, events).run()
    except Exception as exc:
        events.put([("fatal", f"engine step failed: {type(exc).__name__}: {exc}\n" + traceback.format_exc())])
        raise
    finally:
        engine.shutdown()


def _ready_info(engine) -> dict[str, Any]:
    args = engine.args
    return {"context_length": engine.context_length, "vocab_size": engine.model_config.vocab_size,
            "speculative_algorithm": args.speculative_algorithm, "num_draft_tokens": engine.scheduler.window - 1,
            "kv_total_tokens": engine.allocator.size, "pid": os.getpid()}


class EngineServer:
    """The serving loop: apply commands between steps, step while there is work, report events."""

    def __init__(self, engine, commands, events):
        self.engine, self.commands, self.events = engine, commands, events
        self.live: set[str] = set()
        self.parent = os.getppid()
        self._last_load: dict[str, int] = {}

    def run(self) -> None:
        while True:
            out: list[tuple] = []
            stop = self._apply(self._drain(block=not self.engine.has_work()), out)
            if stop:
                for rid in self.live:
                    self.engine.abort(rid)
            self._step(out)
            while stop and self.engine.has_work():  # the aborts, and the overlap loop's step in flight
                self._step(out)
            load = self.engine.load()
            if load != self._last_load:
                out.append(("load", load))
                self._last_load = load
            if out:
                self.events.put(out)
            if stop or os.getppid() != self.parent:  # shut down, or orphaned
                return

    def _drain(self, block: bool) -> list[tuple]:
        cmds = []
        try:
            cmds.append(self.commands.get(timeout=IDLE_POLL_S) if block else self.commands.get_nowait())
            while True:
                cmds.append(self.commands.get_nowait())
        except queue.Empty:
            pass
        return cmds

    def _apply(self, cmds: list[tuple], out: list[tuple]) -> bool:
        for cmd in cmds:
            if cmd[0] == "shutdown":
                return True
            if cmd[0] == "add":
                self._add(*cmd[1:], out=out)
            elif cmd[0] == "abort" and cmd[1] in self.live:
                self.engine.abort(cmd[1])  # its "done" comes with the next step's finished requests
        return False

    def _add(self, rid: str, input_ids: list[int], params: dict, out: list[tuple]) -> None:
        try:
            self.engine.submit(input_ids, params, rid=rid)
        except ValueError as exc:
            out.append(("error", rid, str(exc)))
            return
        self.live.add(rid)

    def _step(self, out: list[tuple]) -> None:
        result = self.engine.step()
        new: dict[str, list[int]] = {}
        for req, token in result.tokens:
            new.setdefault(req.rid, []).append(token)
        out += [("tokens", rid, ids) for rid, ids in new.items()]
        for req in result.finished:
            self.live.discard(req.rid)
            out.append(("done", req.rid, self.engine.output(req)))
