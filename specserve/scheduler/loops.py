"""The engine's two step loops over a Scheduler and a ModelRunner.

- NormalLoop (event_loop_normal, `--disable-overlap-schedule`): schedule batch N, run it, wait
  for its results, process them.
- OverlapLoop (event_loop_overlap, the default): schedule and launch batch N, then process batch
  N-1's results while N runs; the only host wait is on N-1's copy-done event. Step N reads
  N-1's anchors and lengths from the runner's FutureMap on the device. A request that finishes in
  N-1 has already been scheduled into N: N's results for it are dropped (the scheduler skips
  finished requests) and its KV, including N's window, is released exactly once.

The overlap loop falls back to a normal step when overlapping would be unsafe or pointless: after
a prefill (the next prefill chunk or admission depends on it), while requests wait for admission,
and when the next windows could only be allocated by retracting a request whose step is running.
"""

from __future__ import annotations

from typing import Optional

from specserve.scheduler.batch import ScheduleBatch
from specserve.scheduler.scheduler import Scheduler, StepResult


class NormalLoop:
    """event_loop_normal: one step at a time."""

    def __init__(self, sched: Scheduler, runner):
        self.sched, self.runner = sched, runner

    def step(self) -> StepResult:
        batch = self.sched.schedule()
        if batch is None:
            return StepResult()
        return self.sched.process_result(batch, self.runner.run_batch(batch))

    def has_work(self) -> bool:
        return self.sched.has_work()

    def drain(self) -> StepResult:
        return StepResult()


class OverlapLoop:
    """event_loop_overlap: launch step N before processing step N-1."""

    def __init__(self, sched: Scheduler, runner):
        self.sched, self.runner = sched, runner
        self.in_flight: Optional[tuple[ScheduleBatch, object]] = None
        self.overlapped_steps = 0

    def step(self) -> StepResult:
        result = StepResult()
        if self.in_flight is not None and not self.sched.overlap_ready():
            _merge(result, self._finish_in_flight())
        batch = self.sched.schedule()
        handle = self.runner.launch(batch) if batch is not None else None
        if self.in_flight is not None:  # step N-1's results, while step N runs
            self.overlapped_steps += handle is not None
            _merge(result, self._finish_in_flight())
        self.in_flight = (batch, handle) if batch is not None else None
        return result

    def has_work(self) -> bool:
        return self.in_flight is not None or self.sched.has_work()

    def drain(self) -> StepResult:
        """Process the step still in flight (at shutdown or before leaving the loop)."""
        return self._finish_in_flight() if self.in_flight is not None else StepResult()

    def _finish_in_flight(self) -> StepResult:
        batch, handle = self.in_flight
        self.in_flight = None
        return self.sched.process_result(batch, self.runner.resolve(handle))


def _merge(into: StepResult, more: StepResult) -> None:
    into.tokens.extend(more.tokens)
    into.finished.extend(more.finished)
