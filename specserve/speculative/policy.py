"""The per-step speculation policy: for every running request, which drafter (or none) and how
many drafts k, chosen before any drafter runs, to maximise the batch's expected committed tokens
per second under the engine's own step-cost model.

A request's candidates give, per drafter, the survival s_j = P(drafts 1..j all accepted). With k
drafts a request commits 1 + s_1 + ... + s_k tokens in expectation. The step's cost depends on the
whole batch (rows verified, whether the DSpark drafter runs at all, its rows, NGRAM lookups), so
the optimum is a batch decision: a fixed drafting cost that no single request repays alone can pay
for many. The search starts from plain decoding (k = 0 everywhere, always available), tries one
budget-greedy plan per drafter assignment (slots by falling survival, like the compact planner),
then improves the best plan one request at a time until no single change helps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from specserve.speculative.cost_model import StepCostModel, StepShape

DSPARK, NGRAM = "dspark", "ngram"


@dataclass(frozen=True)
class Candidate:
    """One drafter a request may use this step; survival[j - 1] = P(drafts 1..j all accepted)."""

    drafter: str
    survival: tuple[float, ...]

    def __post_init__(self) -> None:
        s = self.survival
        if any(not 0.0 <= v <= 1.0 for v in s) or any(b > a for a, b in zip(s, s[1:])):
            raise ValueError(f"policy: survival must be non-increasing probabilities, got {s}")


@dataclass(frozen=True)
class Decision:
    """A request's choice: its drafter (None: plain decode) and how many drafts to verify."""

    drafter: Optional[str] = None
    drafts: int = 0

    def expected_tokens(self, candidates: Sequence[Candidate]) -> float:
        if self.drafter is None or self.drafts == 0:
            return 1.0
        survival = next(c.survival for c in candidates if c.drafter == self.drafter)
        return 1.0 + sum(survival[:self.drafts])


class _Plan:
    """Decisions for the batch and the running totals the objective needs."""

    def __init__(self, requests: Sequence[Sequence[Candidate]], cost: StepCostModel, dspark_block: int):
        self.requests, self.cost, self.block = requests, cost, dspark_block
        self.decisions = [Decision() for _ in requests]

    def shape(self, decisions: Sequence[Decision]) -> StepShape:
        drafting = [d for d in decisions if d.drafter is not None and d.drafts > 0]
        dspark = sum(d.drafter == DSPARK for d in drafting)
        return StepShape(requests=len(decisions), verify_rows=sum(d.drafts for d in drafting), dspark_requests=dspark,
                         dspark_rows=dspark * self.block, ngram_requests=sum(d.drafter == NGRAM for d in drafting))

    def rate(self, decisions: Sequence[Decision]) -> float:
        """Expected committed tokens per second of the whole step."""
        tokens = sum(d.expected_tokens(c) for d, c in zip(decisions, self.requests))
        return tokens / self.cost.predict(self.shape(decisions))


def choose_drafts(requests: Sequence[Sequence[Candidate]], cost: StepCostModel, dspark_block: int,
                  max_passes: int = 3) -> list[Decision]:
    """The batch's decisions (plain decoding when nothing pays)."""
    plan = _Plan(requests, cost, dspark_block)
    best = [Decision() for _ in requests]
    best_rate = plan.rate(best)
    for assignment in _assignments(requests):
        decisions, rate = _budget_greedy(plan, assignment)
        if rate > best_rate:
            best, best_rate = decisions, rate
    for _ in range(max_passes):
        improved = False
        for r, candidates in enumerate(requests):
            for option in _options(candidates):
                trial = best[:r] + [option] + best[r + 1:]
                rate = plan.rate(trial)
                if rate > best_rate * (1 + 1e-12):
                    best, best_rate, improved = trial, rate, True
        if not improved:
            break
    return best


def _options(candidates: Sequence[Candidate]) -> list[Decision]:
    return [Decision()] + [Decision(c.drafter, k) for c in candidates for k in range(1, len(c.survival) + 1)]


def _assignments(requests: Sequence[Sequence[Candidate]]) -> list[list[Optional[Candidate]]]:
    """Drafter per request for the budget-greedy plans: each drafter for everyone who offers it,
    and each request's own best (most expected tokens with every draft)."""
    names = sorted({c.drafter for cands in requests for c in cands})
    plans = [[next((c for c in cands if c.drafter == name), None) for cands in requests] for name in names]
    plans.append([max(cands, key=lambda c: sum(c.survival), default=None) for cands in requests])
    return plans


def _budget_greedy(plan: _Plan, assignment: Sequence[Optional[Candidate]]) -> tuple[list[Decision], float]:
    """Add draft slots in order of falling survival (a prefix of every window, as survival falls
    along it) and keep the best-rated prefix."""
    slots = sorted(((-c.survival[j], r, j) for r, c in enumerate(assignment) if c is not None
                    for j in range(len(c.survival))))
    decisions = [Decision() for _ in assignment]
    best, best_rate = list(decisions), plan.rate(decisions)
    for _, r, j in slots:
        decisions[r] = Decision(assignment[r].drafter, j + 1)
        rate = plan.rate(decisions)
        if rate > best_rate:
            best, best_rate = list(decisions), rate
    return best, best_rate
