"""Starting the engine process, with nothing heavier than `multiprocessing` imported.

`specserve serve` starts its engine first, so the engine imports torch and loads the model while
the HTTP process imports its own modules and reads the tokenizer: on two cores the two imports
run side by side instead of one after the other. The engine's entry point (server/engine_process.py)
is imported in the child only."""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass
from typing import Any

from specserve.server.heartbeat import DEFAULT_STEP_TIMEOUT_S, HEARTBEAT_S


@dataclass
class SpawnedEngine:
    """A started engine process and its two queues (server/engine_client.py talks over them)."""

    proc: Any  # multiprocessing.Process (spawn context)
    commands: Any
    events: Any

    def kill(self) -> None:
        """Stop a process the server will not use (its start-up failed on the server's side)."""
        self.proc.kill()
        self.proc.join(5)


def spawn_engine(engine_kwargs: dict[str, Any], step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S) -> SpawnedEngine:
    """Start the engine process building `Engine(**engine_kwargs)`; it reports on `events`."""
    ctx = mp.get_context("spawn")  # fork would copy torch's thread pools and locks
    commands, events = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(
        target=_run_engine,
        args=(engine_kwargs, commands, events, HEARTBEAT_S, step_timeout_s),
        name="specserve-engine",
        daemon=False,
    )  # it may spawn TP ranks
    proc.start()
    return SpawnedEngine(proc, commands, events)


def _run_engine(*args: Any) -> None:
    import gc

    from specserve.server.engine_process import engine_main

    # What exists now is the imported modules' (torch's ~180k objects), alive as long as this
    # process: out of the cycle collector's sight, each collection the start-up makes (the builder
    # returns freed memory three times) costs what the engine allocated, not 70 ms of torch.
    gc.freeze()
    engine_main(*args)
