"""Compact verify: the confidence-driven budget planner and the SPS table it reads.

Every request's window can verify fewer rows than W. The planner spends a global budget of B draft
rows where the drafter expects them to survive: with prefix survivals s_{r,k} = prod_{j<=k} c_{r,j},
the expected tokens of a step are tau(B) = num_reqs + (sum of the B largest survivals), and a step
over num_reqs + B rows runs at SPS(num_reqs + B) steps per second, so B maximises
tau(B) * SPS(num_reqs + B). Survivals fall along each window, so the global top-B (ties broken by
request, then slot) is a prefix of every window: verify_len_r = 1 + picks_r.
"""

from __future__ import annotations

import bisect
import json
import logging
from dataclasses import dataclass
from typing import Optional

import torch

from specserve.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpsTable:
    """Verify steps per second against the number of rows in the batch (linear in between)."""

    tokens: tuple[int, ...]
    steps_per_second: tuple[float, ...]
    meta: Optional[dict] = None

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.steps_per_second):
            raise ConfigError("sps table: needs matching, non-empty 'tokens' and 'steps_per_second'")
        if list(self.tokens) != sorted(set(self.tokens)) or self.tokens[0] < 1:
            raise ConfigError("sps table: 'tokens' must be increasing positive integers")
        if any(not s > 0 for s in self.steps_per_second):
            raise ConfigError("sps table: 'steps_per_second' must be positive")

    def __call__(self, tokens: int) -> float:
        xs, ys = self.tokens, self.steps_per_second
        if tokens <= xs[0]:
            return ys[0]
        if tokens >= xs[-1]:
            return ys[-1] * xs[-1] / tokens  # past the table: assume time grows with the rows
        i = bisect.bisect_right(xs, tokens)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    @classmethod
    def load(cls, path: str) -> "SpsTable":
        try:
            with open(path) as f:
                raw = json.load(f)
            return cls(
                tuple(int(t) for t in raw["tokens"]), tuple(float(s) for s in raw["steps_per_second"]), raw.get("meta")
            )
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"speculative_sps_table_path: cannot read an SPS table from {path!r}: {exc}") from exc

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(
                {"tokens": list(self.tokens), "steps_per_second": list(self.steps_per_second), "meta": self.meta or {}},
                f,
                indent=2,
            )


def plan_verify_lens(confidence: torch.Tensor, sps: SpsTable) -> list[int]:
    """confidence [bs, g] (c_k per slot) -> verify_len per request, each in 1..g+1."""
    bs, g = confidence.shape
    survival = confidence.double().clamp(0, 1).cumprod(1).tolist()
    order = sorted(((-survival[r][k], r, k) for r in range(bs) for k in range(g)))
    best_b, best_score, expected = 0, bs * sps(bs), float(bs)
    for b, (neg, _, _) in enumerate(order, start=1):
        expected -= neg
        score = expected * sps(bs + b)
        if score > best_score:
            best_b, best_score = b, score
    picks = [0] * bs
    for _, r, _ in order[:best_b]:
        picks[r] += 1
    return [min(1 + p, g + 1) for p in picks]


class VerifyPlanner:
    """Chooses verify lengths for compact mode; without a table it verifies everything (warning once)."""

    def __init__(self, sps: Optional[SpsTable]):
        self.sps = sps
        self._warned = False

    def verify_lens(self, confidence: torch.Tensor) -> Optional[list[int]]:
        if self.sps is None:
            if not self._warned:
                logger.warning(
                    "compact verify without an SPS table (--speculative-sps-table-path): "
                    "verifying every window row; record one with `specserve profile-sps`"
                )
                self._warned = True
            return None
        return plan_verify_lens(confidence.float().cpu(), self.sps)
