"""Acceptance estimates per request and drafter, and their calibration.

For one request and one drafter, a_j is the probability that draft j is accepted given drafts
1..j-1 were; the survival of k drafts is s_k = a_1 ... a_k. Each verified window updates a_j for
the positions it tested: accepted up to m, rejected at m + 1 (later positions untested). The
estimate blends the request's own recent history (exponential averages, so it follows the text
as it changes) with the drafter's per-step hint: DSpark's confidence head, or NGRAM's match
length turned into a rate. `Calibration` compares the accept length predicted for each window
with the one realised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence


@dataclass
class SurvivalEstimate:
    """One request's conditional acceptance per draft position, for one drafter."""

    gamma: int
    prior: float = 0.5  # a_j before any evidence
    decay: float = 0.8  # weight of the past in each update
    hint_weight: float = 0.5  # weight of the drafter's own per-step prediction when it gives one
    rates: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.rates:
            self.rates = [self.prior] * self.gamma

    def observe(self, drafted: int, accepted: int) -> None:
        """A verified window of `drafted` drafts of which the first `accepted` were accepted."""
        for j in range(min(drafted, accepted + 1, self.gamma)):
            hit = 1.0 if j < accepted else 0.0
            self.rates[j] = self.decay * self.rates[j] + (1 - self.decay) * hit

    def survival(self, hint: Optional[Sequence[float]] = None) -> tuple[float, ...]:
        """s_1..s_gamma, blending each a_j with hint[j] (a conditional rate) when given."""
        out, s = [], 1.0
        for j, rate in enumerate(self.rates):
            if hint is not None and j < len(hint):
                rate = self.hint_weight * float(hint[j]) + (1 - self.hint_weight) * rate
            s *= min(max(rate, 0.0), 1.0)
            out.append(s)
        return tuple(out)


def ngram_hint(match_len: int, gamma: int, per_token: float = 0.15) -> list[float]:
    """A conditional acceptance rate per position from an NGRAM match of `match_len` tokens: longer
    matches predict longer accepted runs (0 when nothing matched)."""
    if match_len <= 0:
        return [0.0] * gamma
    base = 1.0 - 1.0 / (1.0 + per_token * match_len * 4)
    return [base] * gamma


@dataclass
class Calibration:
    """Predicted against realised accept length (1 + accepted drafts) per verified window."""

    windows: int = 0
    abs_error_sum: float = 0.0
    predicted_sum: float = 0.0
    realised_sum: float = 0.0

    def record(self, predicted: float, realised: float) -> None:
        self.windows += 1
        self.abs_error_sum += abs(predicted - realised)
        self.predicted_sum += predicted
        self.realised_sum += realised

    @property
    def mean_abs_error(self) -> float:
        return self.abs_error_sum / self.windows if self.windows else 0.0

    @property
    def bias(self) -> float:
        """Mean predicted minus mean realised (positive: over-optimistic)."""
        return (self.predicted_sum - self.realised_sum) / self.windows if self.windows else 0.0
