"""The engine's two step loops: a Scheduler deciding batches, an executor running them.

- NormalLoop (event_loop_normal, `--disable-overlap-schedule`): schedule batch N, run it, wait
  for its results, process them.
- OverlapLoop (event_loop_overlap, the default): schedule and launch batch N, then process batch
  N-1's results while N runs; the only host wait is on N-1's copy-done event. Step N reads
  N-1's anchors and lengths from the executor's FutureMap on the device. A request that finishes
  in N-1 has already been scheduled into N: N's results for it are dropped (the scheduler skips
  finished requests) and its KV, including N's window, is released exactly once.

The overlap loop falls back to a normal step when overlapping would be unsafe or pointless: after
a prefill (the next prefill chunk or admission depends on it), while requests wait for admission,
and when the next windows could only be allocated by retracting a request whose step is running.

The launched batches are the scheduler's `in_flight` list; each carries its executor handle.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from specserve.executor.step_io import StepInput, StepOutcome
from specserve.scheduler.req import ScheduleBatch
from specserve.scheduler.scheduler import Scheduler, StepResult


class StepExecutor(Protocol):
    """What a loop needs of an executor: launch a step, later resolve it into per-request outcomes."""

    def launch(self, step: StepInput) -> Any: ...

    def resolve(self, handle: Any) -> list[StepOutcome]: ...


class NormalLoop:
    """event_loop_normal: one step at a time."""

    def __init__(self, sched: Scheduler, executor: StepExecutor):
        self.sched, self.executor = sched, executor

    def step(self) -> StepResult:
        batch = self.sched.schedule()
        if batch is None:
            return StepResult()
        return self.sched.process_result(batch, self.executor.resolve(self.executor.launch(batch.step_input())))

    def has_work(self) -> bool:
        return self.sched.has_work()

    def drain(self) -> StepResult:
        return StepResult()


class OverlapLoop:
    """event_loop_overlap: launch step N before processing step N-1."""

    def __init__(self, sched: Scheduler, executor: StepExecutor):
        self.sched, self.executor = sched, executor
        self.overlapped_steps = 0

    def step(self) -> StepResult:
        result = StepResult()
        previous = self._launched()
        if previous is not None and not self.sched.overlap_ready():
            _merge(result, self._finish(previous))
            previous = None
        batch = self.sched.schedule()
        if batch is not None:
            batch.handle = self.executor.launch(batch.step_input())
        if previous is not None:  # step N-1's results, while step N runs
            self.overlapped_steps += batch is not None
            _merge(result, self._finish(previous))
        return result

    def has_work(self) -> bool:
        return bool(self.sched.queues.in_flight) or self.sched.has_work()

    def drain(self) -> StepResult:
        """Process the step still in flight (at shutdown or before leaving the loop)."""
        result = StepResult()
        while (batch := self._launched()) is not None:
            _merge(result, self._finish(batch))
        return result

    def _launched(self) -> Optional[ScheduleBatch]:
        return self.sched.queues.in_flight[0] if self.sched.queues.in_flight else None

    def _finish(self, batch: ScheduleBatch) -> StepResult:
        handle, batch.handle = batch.handle, None
        return self.sched.process_result(batch, self.executor.resolve(handle))


def _merge(into: StepResult, more: StepResult) -> None:
    into.tokens.extend(more.tokens)
    into.finished.extend(more.finished)
