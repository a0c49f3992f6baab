"""The engine's own process: it owns the model, the scheduler and the KV cache and steps them.

The HTTP process talks to it over two multiprocessing queues (the messages of
specserve.engine.messages), so model work never blocks the event loop. Commands are applied
between steps; the events of one loop iteration go out as one list. `EngineFatal` is sent when the
engine cannot start or a step raises: the HTTP side then fails every open request loudly instead of
letting it hang.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Mapping, Optional

from specserve.engine.messages import (
    AbortRequest,
    AddRequest,
    CacheFlushed,
    Command,
    EngineFatal,
    EngineReady,
    Event,
    FlushCache,
    Heartbeat,
    LoadReport,
    RequestDone,
    RequestError,
    RequestFailed,
    Shutdown,
    TokensOut,
)
from specserve.errors import ConfigError, InvalidRequestError
from specserve.models.heap import release_free_heap
from specserve.sampling_params import GRAMMAR_FIELDS
from specserve.server.heartbeat import DEFAULT_STEP_TIMEOUT_S, HEARTBEAT_S

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # how often an idle engine checks that its parent is still alive
GRAMMAR_TIMEOUT_S = 10.0  # a grammar that takes longer to compile is the request's error (a 400)


def engine_main(
    engine_kwargs: dict[str, Any],
    commands,
    events,
    heartbeat_s: float = HEARTBEAT_S,
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
) -> None:
    """Process entry point (spawned): build the Engine, then serve commands until shutdown."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the HTTP process decides when to stop
    logging.basicConfig(
        level=str(engine_kwargs.get("log_level", "info")).upper(),
        format="%(asctime)s engine %(levelname)s %(name)s: %(message)s",
    )
    try:
        from specserve.engine import Engine

        engine = Engine(**engine_kwargs)
    except ConfigError as exc:  # a bad flag or model: its one line, the server exits with it
        events.put([EngineFatal(f"engine failed to start: {exc}", config=True)])
        return
    except Exception as exc:  # a bug while starting: the traceback to the log, the message to the server
        logger.critical("engine failed to start", exc_info=True)
        events.put([EngineFatal(f"engine failed to start: {type(exc).__name__}: {exc}")])
        return
    events.put([EngineReady(_ready_info(engine))])
    server = EngineServer(engine, commands, events)
    beating = threading.Event()
    heartbeat = threading.Thread(
        target=_beat,
        args=(events, heartbeat_s, beating, lambda: server.stalled(step_timeout_s)),
        name="engine-heartbeat",
        daemon=True,
    )
    heartbeat.start()
    try:
        with engine.sanitized():
            server.run()
    except Exception as exc:  # the traceback goes to the log; the HTTP side keeps one line of this
        logger.critical("engine step failed; the engine stops", exc_info=True)
        events.put([EngineFatal(f"engine step failed: {type(exc).__name__}: {exc}")])
        raise
    finally:
        beating.set()
        # Joined, not left to die: a daemon thread still alive when the interpreter exits is
        # ended by a forced unwind, which here aborted the process ("terminate called without an
        # active exception", exit -6) after a clean shutdown.
        heartbeat.join(timeout=heartbeat_s + 5)
        engine.shutdown()


def _beat(events, interval_s: float, stop: threading.Event, stalled: Callable[[], bool]) -> None:
    """Off the step thread: a slow step does not stop it; a stopped process, or a serving loop stuck in
    one iteration past the step timeout (a deadlock, a wait that never returns), does."""
    warned = False
    while not stop.wait(interval_s):
        if not stalled():
            events.put([Heartbeat()])
        elif not warned:
            logger.critical("engine serving loop stuck in one step; no more heartbeats")
            warned = True


def one_line(message: str, limit: int = 300) -> str:
    """The first line of a message, cut to `limit` characters: what /health and error bodies show."""
    line = message.strip().splitlines()[0] if message.strip() else message
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _ready_info(engine) -> dict[str, Any]:
    """What the HTTP side logs at start-up (server/startup.py) and serves in /server_info."""
    import torch

    from specserve.engine.start_cache import weight_cache_report
    from specserve.models.loader import resolve_model_path
    from specserve.models.summary import cpu_kernel_path, quantized_linears

    args = engine.args
    return {
        "context_length": engine.model.context_length,
        "vocab_size": engine.model.config.vocab_size,
        "speculative_algorithm": args.speculative_algorithm,
        "num_draft_tokens": engine.scheduler.window - 1,
        "kv_total_tokens": engine.scheduler.ledger.allocator.size,
        "pid": os.getpid(),
        "model": engine.model.summary,
        "model_path": resolve_model_path(args.model_path),
        "dtype": str(engine.model.dtype).replace("torch.", ""),
        "device": args.device,
        "kernel_path": cpu_kernel_path(args.device, engine.model.dtype),
        "cpu_activations": args.cpu_activations,
        "cpu_activations_reason": engine.cpu_activations_reason,
        "quantized_linears": args.quantization == "auto" and quantized_linears(engine.model.summary),
        "threads": torch.get_num_threads(),
        "tp_size": args.tp_size,
        "max_running_requests": args.max_running_requests,
        "speculative_policy": args.speculative_policy if args.speculating else None,
        "speculative_drafters": list(args.policy_drafters()) if args.speculating else [],
        "speculative_draft_model_path": args.speculative_draft_model_path,
        "weight_cache": weight_cache_report(args, getattr(engine.runner.model, "weight_cache", None)),  # rank 0's
    }


def shutdown_line(before: Mapping[str, float], after: Mapping[str, float], aborted: int) -> str:
    """What a shutdown drained: the requests the engine held when the stop came (`Engine.load`
    before the aborts), how many the server aborted, and the KV slots they held that are now free
    (or cached)."""
    freed = int(before.get("kv_request_tokens", 0) - after.get("kv_request_tokens", 0))
    running, waiting = int(before.get("running", 0)), int(before.get("waiting", 0))
    return f"shutdown: drained {running} running and {waiting} waiting requests (aborted {aborted}), freed {freed} KV slots"


def rejection(rid: str, exc: InvalidRequestError) -> RequestError:
    """The `RequestError` event (a 400) for a request the engine refused: the field and code it carries."""
    return RequestError(rid, str(exc), exc.param, exc.code)


class EngineServer:
    """The serving loop: apply commands between steps, step while there is work, report events."""

    def __init__(self, engine, commands, events):
        self.engine, self.commands, self.events = engine, commands, events
        self.live: set[str] = set()
        self.parent = os.getppid()
        self._last_load: dict[str, int] = {}
        self._iteration_started = time.monotonic()
        # Requests with a grammar wait here while it compiles on a thread of its own (not this loop's):
        # a slow schema delays only its own request. This is the one compile of a served request's
        # grammar (cached by spec): the runner's grammar states are copies of it.
        self._compiling: dict[str, tuple[AddRequest, Future, float]] = {}
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._worked = False  # a step ran since the engine was last idle

    def stalled(self, timeout_s: float) -> bool:
        """Whether the current loop iteration (a step, or the idle wait) has run past timeout_s."""
        return time.monotonic() - self._iteration_started > timeout_s

    def run(self) -> None:
        while True:
            self._iteration_started = time.monotonic()
            out: list[Event] = []
            idle = not self.engine.has_work() and not self._compiling
            if idle and self._worked:  # once per busy spell: the steps' freed temporaries go back (heap.py)
                release_free_heap()
                self._worked = False
            stop = self._apply(self._drain(block=idle), out)
            self._admit_compiled(out)
            if stop:
                before, aborted = self.engine.load(), len(self.live)
                for rid in self.live:
                    self.engine.abort(rid)
            self._worked |= self.engine.has_work()
            self._step(out)
            while stop and self.engine.has_work():  # the aborts, and the overlap loop's step in flight
                self._step(out)
            if stop:  # the one line a person reads at shutdown: what the stop cut short
                logger.info("%s", shutdown_line(before, self.engine.load(), aborted))
            load = self.engine.load()
            if load != self._last_load:
                out.append(LoadReport(load))
                self._last_load = load
            if out:
                self.events.put(out)
            if stop or os.getppid() != self.parent:  # shut down, or orphaned
                self._compiler.shutdown(wait=False, cancel_futures=True)
                return

    def _drain(self, block: bool) -> list[Command]:
        cmds = []
        try:
            cmds.append(self.commands.get(timeout=IDLE_POLL_S) if block else self.commands.get_nowait())
            while True:
                cmds.append(self.commands.get_nowait())
        except queue.Empty:
            pass
        return cmds

    def _apply(self, cmds: list[Command], out: list[Event]) -> bool:
        """Apply commands in order; True when one of them is Shutdown (the rest are dropped)."""
        for cmd in cmds:
            match cmd:
                case Shutdown():
                    return True
                case AddRequest() if cmd.params.constrained:
                    compiling = self._compiler.submit(self.engine.check_grammar, cmd.params)
                    self._compiling[cmd.rid] = (cmd, compiling, time.monotonic())
                case AddRequest():
                    self._add(cmd, out)
                case AbortRequest(rid=rid) if rid in self._compiling:
                    self._compiling.pop(rid)
                    out.append(RequestError(rid, "request aborted while its grammar compiled"))
                case AbortRequest(rid=rid) if rid in self.live:
                    self.engine.abort(rid)  # its RequestDone comes with the next step's finished requests
                case FlushCache(token=token):
                    self.engine.flush_cache(token)  # answered with the next step's result
        return False

    def _admit_compiled(self, out: list[Event]) -> None:
        """Queue the requests whose grammar compiled (in arrival order); reject those whose did not,
        or did not within GRAMMAR_TIMEOUT_S."""
        for rid, (cmd, future, since) in list(self._compiling.items()):
            if not future.done() and time.monotonic() - since < GRAMMAR_TIMEOUT_S:
                continue
            del self._compiling[rid]
            error = future.exception() if future.done() else _too_slow(cmd)
            if isinstance(error, InvalidRequestError):
                out.append(rejection(rid, error))
            elif error is not None:
                out.append(RequestFailed(rid, f"grammar failed: {type(error).__name__}: {error}"))
            else:
                self._add(cmd, out)

    def _add(self, cmd: AddRequest, out: list[Event]) -> None:
        try:
            self.engine.add(cmd)
        except InvalidRequestError as exc:  # bad input: a 400 naming its field
            out.append(rejection(cmd.rid, exc))
            return
        except Exception as exc:  # a bug (never a 400) in one request's checks fails that request, not the engine
            logger.error("request %s failed before it was queued", cmd.rid, exc_info=True)
            out.append(RequestFailed(cmd.rid, f"request failed: {type(exc).__name__}: {exc}"))
            return
        self.live.add(cmd.rid)

    def _step(self, out: list[Event]) -> None:
        result = self.engine.step()
        new: dict[str, list[int]] = {}
        reqs = {}
        for req, token in result.tokens:
            new.setdefault(req.rid, []).append(token)
            reqs[req.rid] = req
        out += [
            TokensOut(rid, ids, _last_logprobs(reqs[rid], len(ids)), _prompt_logprobs(reqs[rid], len(ids)))
            for rid, ids in new.items()
        ]
        for req in result.finished:
            self.live.discard(req.rid)
            out.append(self._final_event(req))
        out += [CacheFlushed(token, freed) for token, freed in result.flushed]

    def _final_event(self, req) -> Event:
        """RequestDone with the output dict; RequestFailed when the request's own host work failed."""
        if req.error is not None:
            return RequestFailed(req.rid, req.error)
        try:
            return RequestDone(req.rid, self.engine.output(req))
        except Exception as exc:  # e.g. detokenizing this request's output: it fails alone
            logger.error("request %s failed building its output", req.rid, exc_info=True)
            return RequestFailed(req.rid, f"output failed: {type(exc).__name__}: {exc}")


def _too_slow(cmd: AddRequest) -> InvalidRequestError:
    field = next(f"sampling_params.{name}" for name in GRAMMAR_FIELDS if getattr(cmd.params, name) is not None)
    return InvalidRequestError(f"{field}: the grammar did not compile within {GRAMMAR_TIMEOUT_S:g} s", param=field)


def _prompt_logprobs(req, n: int) -> Optional[list]:
    """A request's prompt logprobs, sent once: with its first output tokens."""
    return list(req.prompt_logprobs) if req.params.prompt_logprobs and len(req.output_ids) == n else None


def _last_logprobs(req, n: int) -> Optional[list]:
    """The logprobs of a request's last n output tokens (None if it did not ask for logprobs)."""
    return list(req.output_logprobs[-n:]) if req.params.logprobs else None
