"""SchedulerStats: engine-wide counters behind the periodic log line (and, later, the metrics)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from specserve.executor.step_io import VerifyStats
from specserve.scheduler.req import Req


@dataclass
class SchedulerStats:
    """Counts since start. `gamma` is the drafts per verify step (0 without speculation)."""

    gamma: int
    generated_tokens: int = 0
    verify_steps: int = 0
    correct_drafts: int = 0
    correct_hist: dict[int, int] = field(default_factory=dict)  # accepted drafts per request-step -> count
    cap_trim_hist: dict[int, int] = field(default_factory=dict)  # matches cut by the verify length -> count
    draft_len_hist: dict[int, int] = field(default_factory=dict)  # drafts planned per request-step (k) -> count
    drafter_steps: dict[str, int] = field(default_factory=dict)  # request-steps with drafts, per drafter
    predicted_windows: int = 0  # windows the policy predicted an accept length for
    predicted_sum: float = 0.0
    predicted_abs_error_sum: float = 0.0  # |predicted - realised accept length|
    _last_time: float = field(default_factory=time.monotonic)
    _last_tokens: int = 0

    def record_verify(self, correct: int, cap_trimmed: int) -> None:
        self.verify_steps += 1
        self.correct_drafts += correct
        self.correct_hist[correct] = self.correct_hist.get(correct, 0) + 1
        self.cap_trim_hist[cap_trimmed] = self.cap_trim_hist.get(cap_trimmed, 0) + 1

    def record_window(self, req: Req, window: VerifyStats, appended: int, committed: int) -> None:
        """A verify step's window: what was planned for it and, if it had drafts, how they fared."""
        req.record_plan(window.drafter, window.drafts)
        self.record_plan(window.drafter, window.drafts)
        if window.drafts == 0:
            return  # one verified row, no drafts: a plain decode step for this request
        correct = req.record_verify(appended, committed, window.cap_trimmed)
        self.record_verify(correct, window.cap_trimmed)
        if window.predicted > 0:
            req.spec_predicted_sum += window.predicted
            self.record_prediction(window.predicted, committed)

    def record_plan(self, drafter: Optional[str], drafts: int) -> None:
        self.draft_len_hist[drafts] = self.draft_len_hist.get(drafts, 0) + 1
        if drafter is not None and drafts > 0:
            self.drafter_steps[drafter] = self.drafter_steps.get(drafter, 0) + 1

    def record_prediction(self, predicted: float, realised: int) -> None:
        self.predicted_windows += 1
        self.predicted_sum += predicted
        self.predicted_abs_error_sum += abs(predicted - realised)

    @property
    def accept_length(self) -> float:
        """Tokens committed per request-step: accepted drafts plus the bonus."""
        return 1.0 + self.correct_drafts / self.verify_steps if self.verify_steps else 0.0

    def log_line(self, running: int, waiting: int, cost_residual: float | None = None) -> str:
        """One line for the periodic engine log: throughput since the last line, spec totals and
        the policy's decisions (`cost_residual`: the step-cost model's mean relative error)."""
        now = time.monotonic()
        rate = (self.generated_tokens - self._last_tokens) / max(now - self._last_time, 1e-9)
        self._last_time, self._last_tokens = now, self.generated_tokens
        line = f"running {running}, waiting {waiting}, gen {rate:.1f} tok/s, total {self.generated_tokens} tokens"
        if self.verify_steps:
            accepted = self.correct_drafts / (self.verify_steps * self.gamma) if self.gamma else 0.0
            line += (
                f", accept length {self.accept_length:.2f}, accept rate {accepted:.3f}, "
                f"correct drafts hist {dict(sorted(self.correct_hist.items()))}, "
                f"cap-trim hist {dict(sorted(self.cap_trim_hist.items()))}"
            )
        if self.draft_len_hist:
            line += (
                f", drafts hist {dict(sorted(self.draft_len_hist.items()))}, "
                f"drafter steps {dict(sorted(self.drafter_steps.items()))}"
            )
        if self.predicted_windows:
            n = self.predicted_windows
            line += (
                f", predicted accept length {self.predicted_sum / n:.2f} "
                f"(mean abs error {self.predicted_abs_error_sum / n:.2f})"
            )
        if cost_residual is not None:
            line += f", step-cost residual {100 * cost_residual:.1f}%"
        return line
