"""SchedulerStats: engine-wide counters behind the periodic log line (and, later, the metrics)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class SchedulerStats:
    """Counts since start. `gamma` is the drafts per verify step (0 without speculation)."""

    gamma: int
    generated_tokens: int = 0
    verify_steps: int = 0
    correct_drafts: int = 0
    correct_hist: dict[int, int] = field(default_factory=dict)  # accepted drafts per request-step -> count
    cap_trim_hist: dict[int, int] = field(default_factory=dict)  # matches cut by the verify length -> count
    _last_time: float = field(default_factory=time.monotonic)
    _last_tokens: int = 0

    def record_verify(self, correct: int, cap_trimmed: int) -> None:
        self.verify_steps += 1
        self.correct_drafts += correct
        self.correct_hist[correct] = self.correct_hist.get(correct, 0) + 1
        self.cap_trim_hist[cap_trimmed] = self.cap_trim_hist.get(cap_trimmed, 0) + 1

    @property
    def accept_length(self) -> float:
        """Tokens committed per request-step: accepted drafts plus the bonus."""
        return 1.0 + self.correct_drafts / self.verify_steps if self.verify_steps else 0.0

    def log_line(self, running: int, waiting: int) -> str:
        """One line for the periodic engine log: throughput since the last line, spec totals."""
        now = time.monotonic()
        rate = (self.generated_tokens - self._last_tokens) / max(now - self._last_time, 1e-9)
        self._last_time, self._last_tokens = now, self.generated_tokens
        line = f"running {running}, waiting {waiting}, gen {rate:.1f} tok/s, total {self.generated_tokens} tokens"
        if self.verify_steps:
            accepted = self.correct_drafts / (self.verify_steps * self.gamma) if self.gamma else 0.0
            line += (f", accept length {self.accept_length:.2f}, accept rate {accepted:.3f}, "
                     f"correct drafts hist {dict(sorted(self.correct_hist.items()))}, "
                     f"cap-trim hist {dict(sorted(self.cap_trim_hist.items()))}")
        return line
