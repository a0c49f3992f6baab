"""StepPlan: one verify step's decisions per request (drafter, draft count), as the policy made
them or as the drafters' fixed windows give them (speculative/adaptive.py, speculation.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from specserve.speculative.cost_model import StepShape


@dataclass
class StepPlan:
    """One verify step's decisions, per request, and the step's shape for the cost model."""

    drafters: list[Optional[str]]  # None: no drafts (one verified row)
    drafts: list[int]  # k, 0..gamma
    predicted: list[float]  # expected accept length 1 + s_1 + .. + s_k
    shape: StepShape
    # per request the rate bucket of its drafter it was priced by (its hint's); what its acceptance
    # teaches, also when it is observed after later plans (Speculation.lagged)
    buckets: Optional[list[int]] = None

    @property
    def speculates(self) -> bool:
        return any(self.drafts)

    @classmethod
    def fixed(cls, drafters: Sequence[Optional[str]], gamma: int) -> "StepPlan":
        """Every request with a drafter verifies all gamma drafts (the policy turned off)."""
        drafts = [gamma if d is not None else 0 for d in drafters]
        return cls(list(drafters), drafts, [0.0] * len(drafts), StepShape.of(drafters, drafts))
