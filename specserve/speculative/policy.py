"""The per-step speculation policy: for every running request, which drafter (or none) and how
many drafts k, chosen before any drafter runs, to maximise the batch's expected committed tokens
per second under the engine's own step-cost model.

A request's candidates give, per drafter, the survival s_j = P(drafts 1..j all accepted). With k
drafts a request commits 1 + s_1 + ... + s_k tokens in expectation. The step's cost depends on the
whole batch (rows verified, whether the DSpark drafter runs at all, its rows, NGRAM and SUFFIX lookups), so
the optimum is a batch decision: a fixed drafting cost that no single request repays alone can pay
for many.

The objective is a ratio, tokens(plan) / seconds(plan), and with the DSpark drafter's fixed cost
settled (it runs, or it does not) both are sums over requests. Dinkelbach's method then finds the
exact optimum: for the best rate r so far, each request alone picks the option maximising
tokens - r * seconds; the plan's own rate becomes the next r, which rises until it stops. Both
settings of the DSpark drafter are solved and the better kept. Plain decoding (k = 0 everywhere)
is always a candidate plan, so nothing that predicts a loss is ever chosen.

`StepPlan`: one verify step's decisions per request (drafter, draft count), as the policy made
them or as the drafters' fixed windows give them (speculative/adaptive.py, speculation.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from specserve import drafters as registry
from specserve.errors import InternalError
from specserve.speculative.cost_model import StepCostModel, StepShape


@dataclass(frozen=True)
class Candidate:
    """One drafter a request may use this step; survival[j - 1] = P(drafts 1..j all accepted)."""

    drafter: str
    survival: tuple[float, ...]
    _expected: tuple[float, ...] = field(init=False, repr=False, compare=False)  # 1 + s_1 + .. + s_k by k

    def __post_init__(self) -> None:
        s = self.survival
        if any(not 0.0 <= v <= 1.0 for v in s) or any(b > a for a, b in zip(s, s[1:])):
            raise InternalError(f"policy: survival must be non-increasing probabilities, got {s}")
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
    """Rates a batch's decisions: expected tokens over the cost model's seconds."""

    def __init__(self, requests: Sequence[Sequence[Candidate]], cost: StepCostModel):
        self.requests, self.cost = requests, cost

    def rate(self, decisions: Sequence[Decision]) -> float:
        """Expected committed tokens per second of a step with these decisions."""
        tokens, rows, dspark, dspark_rows, ngram = 0.0, 0, 0, 0, 0
        models, lookups = registry.MODELS, registry.LOOKUPS
        for d, c in zip(decisions, self.requests):
            tokens += d.expected_tokens(c)
            if d.drafter is not None and d.drafts > 0:
                rows += d.drafts
                dspark += d.drafter in models
                dspark_rows += d.drafts if d.drafter in models else 0
                ngram += d.drafter in lookups
        return tokens / self.cost.predict_totals(len(self.requests), rows, dspark, dspark_rows, ngram)


def choose_drafts(
    requests: Sequence[Sequence[Candidate]], cost: StepCostModel, min_gain: float = 0.0, max_iterations: int = 20
) -> list[Decision]:
    """The batch's decisions: plain decoding unless a plan is predicted to commit tokens at least
    (1 + min_gain) times as fast (a margin for the predictions' own errors)."""
    plan = _Plan(requests, cost)
    plain = [Decision() for _ in requests]
    plain_rate = plan.rate(plain)
    if _nothing_can_pay(requests, cost, plain_rate * (1 + min_gain)):
        return plain
    best, best_rate = plain, plain_rate
    coef = cost.coefficients()
    for dspark_runs in (False, True):
        if dspark_runs and not any(c.drafter in registry.MODELS for cands in requests for c in cands):
            continue
        options = [_priced_options(cands, coef, dspark_runs) for cands in requests]
        rate = best_rate
        for _ in range(max_iterations):
            decisions = [max(opts, key=lambda o: o[0] - rate * o[1])[2] for opts in options]
            new_rate = plan.rate(decisions)
            if new_rate <= rate * (1 + 1e-12):
                break
            rate = new_rate
            if rate > best_rate:
                best, best_rate = decisions, rate
    return best if best_rate >= plain_rate * (1 + min_gain) else plain


def _priced_options(
    candidates: Sequence[Candidate], coef: dict[str, float], dspark_runs: bool
) -> list[tuple[float, float, Decision]]:
    """(expected tokens, seconds this request adds, decision) for each of its options; DSpark
    options only when the drafter runs (its fixed cost is the batch's, not the request's), each of
    its drafts a verified row and a row of the drafter's heads (it computes the first k)."""
    out = [(1.0, 0.0, Decision())]
    models = registry.MODELS
    for c in candidates:
        model = c.drafter in models
        if model and not dspark_runs:
            continue
        per_row = coef["verify_rows"] + (coef["dspark_rows"] if model else 0.0)
        extra = coef["ngram_requests"] if c.drafter in registry.LOOKUPS else 0.0
        out += [(c.expected_tokens(k), per_row * k + extra, Decision(c.drafter, k)) for k in range(1, len(c.survival) + 1)]
    return out


def _nothing_can_pay(requests: Sequence[Sequence[Candidate]], cost: StepCostModel, plain_rate: float) -> bool:
    best_first = max((c.survival[0] for cands in requests for c in cands if c.survival), default=0.0)
    return plain_beats_every_plan(best_first, cost, plain_rate)


def plain_beats_every_plan(best_first: float, cost: StepCostModel, plain_rate: float) -> bool:
    """An exact shortcut for large batches: with every drafting coefficient non-negative, a plan
    with D draft rows gains at most D * max s_1 tokens for at least D * (cost of a verified row)
    seconds, so if max s_1 / row cost <= plain decoding's tokens per second, no plan beats it."""
    coef = cost.coefficients()
    row = coef["verify_rows"]
    if row <= 0 or any(coef[name] < 0 for name in ("dspark_step", "dspark_rows", "ngram_requests", "verify_step")):
        return False
    return best_first / row <= plain_rate


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
