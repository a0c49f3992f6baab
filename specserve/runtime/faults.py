"""Fault injection: make latent races fire on purpose (all off by default).

- SPECSERVE_FAULT_COPY_DELAY_MS=N: before each copy-stream operation, sleep a random 0..N ms.
- SPECSERVE_FAULT_FORWARD_DELAY_MS=N: the same for the forward stream.
- SPECSERVE_FAULT_COPY_LAG_MS=N: the host copy of each step waits until the next step's forward has
  finished (at most N ms): the stale-accept race's late copy, made to happen whatever the machine's speed. A
  random delay lands after the next step only when it outlasts that step, which on a slow machine
  it did not (CI on 2 AVX2 cores). Only the overlap loop launches a step before waiting for the
  previous copy; a copy that the host waits on with no later step queued (the synchronous loop,
  or the overlap loop going idle) goes at once.
- SPECSERVE_FAULT_COPY_LAG_RANKS=R[,R...]: only these tensor-parallel ranks lag (unset: all). With
  one rank late and the others on time, the ranks' views of an aliased buffer differ by
  construction, on any machine: the stale-accept race's divergence, deterministically.
- SPECSERVE_FAULT_SEED=S: seed of those delays; unset, each rank gets its own (1000 + rank), so
  tensor-parallel ranks see different timings, as real ones do.
- SPECSERVE_FAULT_ALIAS_ACCEPT_BUFFERS=1: `read_accept` returns views of the persistent accept
  buffers instead of clones: a late reader then sees the next step's values. Every detector (the
  stream sanitizer, the loop-equivalence tests, the rank consensus checker) is shown to catch it.

The copy lag and the aliased buffers are planted by executor/faulty_runner.py's FaultyRunner,
which these flags select when the engine is built: the plain ModelRunner carries no fault branch.
The delays are the streams' own (runtime/stream.py).

Delays need a real worker thread per stream: with any delay set, CPU streams run threaded.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from specserve import envs

if TYPE_CHECKING:
    from specserve.runtime.stream import Stream


@dataclass(frozen=True)
class FaultConfig:
    copy_delay_ms: int = 0
    forward_delay_ms: int = 0
    seed: int = 1000
    alias_accept_buffers: bool = False
    copy_lag_ms: int = 0

    @classmethod
    def from_env(cls, rank: int = 0) -> "FaultConfig":
        seed = envs.env_optional_int(envs.FAULT_SEED)
        lag_ranks = envs.env_int_set(envs.FAULT_COPY_LAG_RANKS)
        lags = lag_ranks is None or rank in lag_ranks
        return cls(
            copy_delay_ms=envs.env_int(envs.FAULT_COPY_DELAY_MS),
            forward_delay_ms=envs.env_int(envs.FAULT_FORWARD_DELAY_MS),
            seed=seed if seed is not None else 1000 + rank,
            alias_accept_buffers=envs.env_flag(envs.FAULT_ALIAS_ACCEPT_BUFFERS),
            copy_lag_ms=envs.env_int(envs.FAULT_COPY_LAG_MS) if lags else 0,
        )

    @property
    def needs_threads(self) -> bool:
        return self.copy_delay_ms > 0 or self.forward_delay_ms > 0 or self.copy_lag_ms > 0

    def copy_lag(self) -> Optional["CopyLag"]:
        return CopyLag(self.copy_lag_ms) if self.copy_lag_ms > 0 else None

    def delay_for(self, stream_name: str) -> Optional["Delay"]:
        ms = {"copy": self.copy_delay_ms, "forward": self.forward_delay_ms}.get(stream_name, 0)
        return Delay(ms, f"{self.seed}:{stream_name}") if ms > 0 else None


class Delay:
    """Sleeps a seeded random 0..max_ms before each operation of one stream."""

    def __init__(self, max_ms: int, seed: str):
        self.max_ms = max_ms
        self._rng = random.Random(seed)

    def __call__(self) -> None:
        time.sleep(self._rng.uniform(0, self.max_ms) / 1000.0)


class CopyLag:
    """Holds each step's host copy until the next step's forward has finished (or max_ms passed).

    `FaultyRunner` (executor/faulty_runner.py) calls `hold_copy` between queueing a step and
    queueing its copy, and `host_waits` before waiting on a copy: a copy the host waits on
    while no later step is queued has nothing to lag behind (the loop went idle, or the loop is
    synchronous), so it goes at once instead of stalling the run for the whole bound."""

    def __init__(self, max_ms: int):
        self.max_s = max_ms / 1000.0
        self._launched = 0
        self._finished = 0
        self._released = -1  # copies up to this step number go without waiting
        self._cond = threading.Condition()
        self.late = 0  # copies that ran after the next step's forward, as the fault intends
        self.released = 0  # copies let go because the host waited with no later step queued
        self.timeouts = 0  # copies that waited the whole bound (no next step came in time)

    def hold_copy(self, forward: "Stream", copy: "Stream") -> int:
        """Queue the marks for the step just queued on `forward`; returns that step's number."""
        number = self._launched
        forward.submit(self.step_finished)
        copy.submit(self.wait_for_next_step, number)
        self._launched += 1
        return number

    def step_finished(self) -> None:
        with self._cond:
            self._finished += 1
            self._cond.notify_all()

    def host_waits(self, number: int) -> None:
        """The host is about to wait on step `number`'s copy (host thread)."""
        with self._cond:
            if self._launched == number + 1:  # no later step queued: nothing to be late behind
                self._released = max(self._released, number)
                self._cond.notify_all()

    def wait_for_next_step(self, number: int) -> None:
        """Step `number` (0-based) is followed once `number + 2` steps have finished."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._finished >= number + 2 or self._released >= number, timeout=self.max_s):
                self.timeouts += 1
            elif self._finished >= number + 2:
                self.late += 1
            else:
                self.released += 1

    def figures(self) -> dict[str, int]:
        """How the copies went: late (the fault as meant), released, timed out."""
        with self._cond:
            return {"late": self.late, "released": self.released, "timeouts": self.timeouts}
