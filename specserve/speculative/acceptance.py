"""Acceptance estimates per request and drafter, and their calibration.

For one request and one drafter, a_j is the probability that draft j is accepted given drafts
1..j-1 were; the survival of k drafts is s_k = a_1 ... a_k. Each verified window updates a_j for
the positions it tested: accepted up to m, rejected at m + 1 (later positions untested). The
estimate blends the request's own recent history (exponential averages, so it follows the text
as it changes) with a hint: the drafter's engine-wide rates (speculative/adaptive.py).
`Calibration` compares the accept length predicted for each window with the one realised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass
class SurvivalEstimate:
    """One request's (or one drafter's engine-wide) conditional acceptance per draft position.

    Per position: exponentially decayed counts of windows that tested it and of those that
    accepted it, so the rate follows the text as it changes, with `prior` counted as
    `prior_weight` windows (the engine-wide rates: one unlucky exploring window put a drafter's
    rate at 0 and kept the policy off it; a request's own rates blend with those instead).
    Blended with a hint, the own rate weighs evidence / (evidence + credibility): a request with
    no history of its own follows the hint entirely."""

    gamma: int
    prior: float = 0.5  # a_j before any evidence
    decay: float = 0.8  # weight of the past in each update
    credibility: float = 3.0  # windows of own evidence that weigh as much as the hint
    prior_weight: float = 0.0  # windows of evidence the prior counts as

    def __post_init__(self) -> None:
        self.tested = [0.0] * self.gamma
        self.accepted = [0.0] * self.gamma

    @property
    def rates(self) -> list[float]:
        w = self.prior_weight
        return [(a + w * self.prior) / (t + w) if t + w > 0 else self.prior for a, t in zip(self.accepted, self.tested)]

    def observe(self, drafted: int, accepted: int) -> None:
        """A verified window of `drafted` drafts of which the first `accepted` were accepted."""
        for j in range(min(drafted, accepted + 1, self.gamma)):
            self.tested[j] = self.decay * self.tested[j] + 1.0
            self.accepted[j] = self.decay * self.accepted[j] + (1.0 if j < accepted else 0.0)

    @property
    def first_rate(self) -> float:
        """rates[0] alone (the policy's large-batch shortcut reads it for every request, every step)."""
        w, t = self.prior_weight, self.tested[0]
        return (self.accepted[0] + w * self.prior) / (t + w) if t + w > 0 else self.prior

    def first(self, hint: float) -> float:
        """survival(hint)[0] without the rest: what the policy's large-batch shortcut reads."""
        tested = self.tested[0]
        if tested <= 0:
            return min(max(hint, 0.0), 1.0)
        own = tested / (tested + self.credibility)
        return min(max(own * self.first_rate + (1 - own) * hint, 0.0), 1.0)

    def survival(self, hint: Optional[Sequence[float]] = None) -> tuple[float, ...]:
        """s_1..s_gamma, blending each a_j with hint[j] (a conditional rate) when given."""
        out, s = [], 1.0
        for j, rate in enumerate(self.rates):
            if hint is not None and j < len(hint):
                own = self.tested[j] / (self.tested[j] + self.credibility)
                rate = own * rate + (1 - own) * float(hint[j])
            s *= min(max(rate, 0.0), 1.0)
            out.append(s)
        return tuple(out)


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
