"""SchedulerStats: engine-wide counters behind the activity log line (and, later, the metrics)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Mapping, Optional

from specserve.executor.step_io import VerifyStats
from specserve.scheduler.req import Req

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 5.0  # at most one activity line this often (at INFO)


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
    _last_queues: tuple[int, int] = (0, 0)  # (running, waiting) at the last line

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

    def maybe_log(self, running: int, waiting: int, cost_residual: float | None = None, now: float | None = None) -> bool:
        """Log `log_line` (at INFO) when one is due: LOG_INTERVAL_S since the last and activity since
        (tokens generated, or requests came or went). An idle engine logs nothing, as SGLang logs its
        decode batches rather than the clock; once the last request leaves, one more line gives the
        final rate. Called after every engine step; True when it logged."""
        now = time.monotonic() if now is None else now
        if now - self._last_time < LOG_INTERVAL_S or not logger.isEnabledFor(logging.INFO):
            return False
        if self.generated_tokens == self._last_tokens and (running, waiting) == self._last_queues:
            self._last_time = now  # idle: the next line's rate covers its own interval, not the idle time
            return False
        logger.info("%s", self.log_line(running, waiting, cost_residual, now))
        return True

    def log_line(self, running: int, waiting: int, cost_residual: float | None = None, now: float | None = None) -> str:
        """One line for the engine log: throughput since the last line, spec totals and the
        policy's decisions (`cost_residual`: the step-cost model's mean relative error)."""
        now = time.monotonic() if now is None else now
        rate = (self.generated_tokens - self._last_tokens) / max(now - self._last_time, 1e-9)
        self._last_time, self._last_tokens, self._last_queues = now, self.generated_tokens, (running, waiting)
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
                f"drafter steps {named_counts(self.drafter_steps)}"
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


def named_counts(counts: Mapping[str, int]) -> str:
    """`DSPARK 6, NGRAM 2`: each key by its name (str(), never an enum's repr), in name order."""
    return ", ".join(f"{name} {n}" for name, n in sorted((str(k), v) for k, v in counts.items()))
