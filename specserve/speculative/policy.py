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

from specserve.speculative.cost_model import StepCostModel

DSPARK, NGRAM = "DSPARK", "NGRAM"  # the draft workers' names


@dataclass(frozen=True)
class Candidate:
    """One drafter a request may use this step; survival[j - 1] = P(drafts 1..j all accepted)."""

    drafter: str
    survival: tuple[float, ...]

    def __post_init__(self) -> None:
        s = self.survival
        if any(not 0.0 <= v <= 1.0 for v in s) or any(b > a for a, b in zip(s, s[1:])):
            raise ValueError(f"policy: survival must be non-increasing probabilities, got {s}")
        sums, acc = [1.0], 1.0
        for v in s:
            acc += v
            sums.append(acc)
        object.__setattr__(self, "_expected", tuple(sums))

    def expected_tokens(self, drafts: int) -> float:
        """1 + s_1 + ... + s_drafts: the tokens a window of `drafts` drafts commits in expectation."""
        return self._expected[drafts]


@dataclass(frozen=True)
class Decision:
    """A request's choice: its drafter (None: plain decode) and how many drafts to verify."""

    drafter: Optional[str] = None
    drafts: int = 0

    def expected_tokens(self, candidates: Sequence[Candidate]) -> float:
        if self.drafter is None or self.drafts == 0:
            return 1.0
        return next(c for c in candidates if c.drafter == self.drafter).expected_tokens(self.drafts)


class _Plan:
    """Decisions for the batch and the running totals the objective needs: a change of one
    request's decision is rated in O(1), so a search over a large batch stays cheap."""

    def __init__(self, requests: Sequence[Sequence[Candidate]], cost: StepCostModel, dspark_block: int):
        self.requests, self.cost, self.block = requests, cost, dspark_block

    def totals(self, decisions: Sequence[Decision]) -> list[float]:
        """[expected tokens, verify rows, DSpark requests, NGRAM requests] of a whole plan."""
        out = [0.0, 0, 0, 0]
        for d, c in zip(decisions, self.requests):
            _add(out, d, c, 1)
        return out

    def rate_of(self, totals: Sequence[float]) -> float:
        """Expected committed tokens per second of a step with these totals."""
        return totals[0] / self.cost.predict_totals(len(self.requests), totals[1], totals[2], totals[2] * self.block,
                                                    totals[3])

    def rate(self, decisions: Sequence[Decision]) -> float:
        return self.rate_of(self.totals(decisions))

    def rate_if(self, totals: list[float], r: int, old: Decision, new: Decision) -> float:
        """The rate after request r changes from `old` to `new` (totals are left as they were)."""
        _add(totals, old, self.requests[r], -1)
        _add(totals, new, self.requests[r], 1)
        rate = self.rate_of(totals)
        _add(totals, new, self.requests[r], -1)
        _add(totals, old, self.requests[r], 1)
        return rate


def _add(totals: list[float], d: Decision, candidates: Sequence[Candidate], sign: int) -> None:
    totals[0] += sign * d.expected_tokens(candidates)
    if d.drafter is not None and d.drafts > 0:
        totals[1] += sign * d.drafts
        totals[2] += sign * (d.drafter == DSPARK)
        totals[3] += sign * (d.drafter == NGRAM)


def choose_drafts(requests: Sequence[Sequence[Candidate]], cost: StepCostModel, dspark_block: int,
                  max_passes: int = 3) -> list[Decision]:
    """The batch's decisions (plain decoding when nothing pays)."""
    plan = _Plan(requests, cost, dspark_block)
    best = [Decision() for _ in requests]
    best_rate = plan.rate(best)
    if _nothing_can_pay(requests, cost, best_rate):
        return best
    for assignment in _assignments(requests):
        decisions, rate = _budget_greedy(plan, assignment)
        if rate > best_rate:
            best, best_rate = decisions, rate
    totals = plan.totals(best)
    for _ in range(max_passes):
        improved = False
        for r, candidates in enumerate(requests):
            for option in _options(candidates):
                rate = plan.rate_if(totals, r, best[r], option)
                if rate > best_rate * (1 + 1e-12):
                    _add(totals, best[r], candidates, -1)
                    _add(totals, option, candidates, 1)
                    best[r], best_rate, improved = option, rate, True
        if not improved:
            break
    return best


def _nothing_can_pay(requests: Sequence[Sequence[Candidate]], cost: StepCostModel, plain_rate: float) -> bool:
    """An exact shortcut for large batches: with every drafting coefficient non-negative, a plan
    with D draft rows gains at most D * max s_1 tokens for at least D * (cost of a verified row)
    seconds, so if max s_1 / row cost <= plain decoding's tokens per second, no plan beats it."""
    coef = cost.coefficients()
    row = coef["verify_rows"]
    if row <= 0 or any(coef[name] < 0 for name in ("dspark_step", "dspark_rows", "ngram_requests")):
        return False
    best_first = max((c.survival[0] for cands in requests for c in cands if c.survival), default=0.0)
    return best_first / row <= plain_rate


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
    totals = plan.totals(decisions)
    best_rate, best_len = plan.rate_of(totals), 0
    for n, (_, r, j) in enumerate(slots, start=1):
        new = Decision(assignment[r].drafter, j + 1)
        _add(totals, decisions[r], plan.requests[r], -1)
        _add(totals, new, plan.requests[r], 1)
        decisions[r] = new
        rate = plan.rate_of(totals)
        if rate > best_rate:
            best_rate, best_len = rate, n
    best = [Decision() for _ in assignment]
    for _, r, j in slots[:best_len]:
        best[r] = Decision(assignment[r].drafter, j + 1)
    return best, best_rate
