"""The speculation policy: for every running request of a step, which drafter (or none) and how
many drafts k, chosen before any drafter runs; what the adaptive policy learns to choose so; and
`StepPlan`, the choices one step carries (as the policy made them or as fixed windows give them).

## Choosing: the batch's optimum (`choose_drafts`)

The plan maximises the batch's expected committed tokens per second under the engine's own
step-cost model.
A request's candidates give, per drafter, the survival s_j = P(drafts 1..j all accepted). With k
drafts a request commits 1 + s_1 + ... + s_k tokens in expectation. The step's cost depends on the
whole batch (rows verified, whether a drafter that runs a model runs at all, its rows, the requests of
lookup drafters: the cost model's features), so
the optimum is a batch decision: a fixed drafting cost that no single request repays alone can pay
for many.

The objective is a ratio, tokens(plan) / seconds(plan), and with the model drafters' fixed cost
settled (one runs, or none does) both are sums over requests. Dinkelbach's method then finds the
exact optimum: for the best rate r so far, each request alone picks the option maximising
tokens - r * seconds; the plan's own rate becomes the next r, which rises until it stops. Both
settings of the model drafters are solved and the better kept. Plain decoding (k = 0 everywhere)
is always a candidate plan, so nothing that predicts a loss is ever chosen.

## Learning (`AdaptivePolicy`, `SurvivalEstimate`, `Calibration`), on the forward stream

Before any drafter runs, every live request of a verify step gets candidates: for each drafter its
survival estimates (`SurvivalEstimate`, below), blending the request's own recent survival with
the drafter's engine-wide rates (for NGRAM, the rates of the request's current suffix-match
length). `choose_drafts` (above) turns them into decisions under the step-cost
model. After the accept, the windows update the estimates and the calibration; the step's time
updates the cost model (unless frozen).

What an accepted draft is worth depends on what a freed slot is for. It lets its request leave the
batch a step sooner: when another request can take the slot (one waits, or more may arrive, as on
a server) or the request is alone, that saves a step's share, the step's average cost per token.
In a closed batch (Engine.generate of a list: several requests, nobody waiting) the batch runs
until its last request ends, and requests that run to the same length limit end together, so a
draft saves its request's own row and not a step: the policy then prices an accepted token at that
row's cost (`token_weight`).

Everything the plan depends on is a function of the committed tokens, the batch of live requests,
whether a freed slot is refilled (the scheduler plans a decode step only when no waiting request
can be admitted, and the overlap loop never runs ahead while one waits, so both loops see the same)
and the cost table, so with a frozen table the sync and overlap loops and every tensor-parallel
rank plan identically. A request the forward stream already knows is finished (its length limit
or a stop token id was committed; the overlap loop still runs it one more step) is planned with
no drafts and left out of the batch objective. A drafter a request has not tried for
`explore_every` of its steps is tried once with every draft, so estimates can recover after a
bad stretch; each drafter is explored at most once per `explore_every` planned steps of the
engine (by its stalest request), so exploring costs the same share of the time at every batch
size (one window per request and interval would open more of them the more requests run). A
request's steps are the speculating steps it takes part in (observe_accept), so a batch that
never drafts never explores, nor does a request that drafts in fewer than `explore_every` steps.
(Counting every planned step instead made batch 1 explore too; on MT-Bench with the shipped
drafter no DSpark window paid, so those windows only cost throughput.)

For one request and one drafter, a_j is the probability that draft j is accepted given drafts
1..j-1 were; the survival of k drafts is s_k = a_1 ... a_k. Each verified window updates a_j for
the positions it tested: accepted up to m, rejected at m + 1 (later positions untested). The
estimate blends the request's own recent history (exponential averages, so it follows the text
as it changes) with a hint: the drafter's engine-wide rates.
`Calibration` compares the accept length predicted for each window with the one realised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from specserve import drafters as registry
from specserve.drafters import Hints
from specserve.errors import InternalError
from specserve.sampling_params import SamplingParams
from specserve.speculative.cost_model import FEATURES, StepCostModel, StepShape

# Per request, per drafter with hints: (rate bucket, most useful drafts), as its worker gave them.
StepHints = Mapping[str, Sequence[tuple[int, int]]]
NO_HINT = (0, 0)


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
        tokens, rows, model_drafts, model_rows, lookups_asked = 0.0, 0, 0, 0, 0
        models, lookups = registry.MODELS, registry.LOOKUPS
        for d, c in zip(decisions, self.requests):
            tokens += d.expected_tokens(c)
            if d.drafter is not None and d.drafts > 0:
                rows += d.drafts
                model_drafts += d.drafter in models
                model_rows += d.drafts if d.drafter in models else 0
                lookups_asked += d.drafter in lookups
        return tokens / self.cost.predict_totals(len(self.requests), rows, model_drafts, model_rows, lookups_asked)


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
    for model_runs in (False, True):
        if model_runs and not any(c.drafter in registry.MODELS for cands in requests for c in cands):
            continue
        options = [_priced_options(cands, coef, model_runs) for cands in requests]
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
    candidates: Sequence[Candidate], coef: dict[str, float], model_runs: bool
) -> list[tuple[float, float, Decision]]:
    """(expected tokens, seconds this request adds, decision) for each of its options; a model
    drafter's options only when model drafting runs (its fixed cost is the batch's, not the
    request's), each of its drafts a verified row and a drafted row (DSpark's heads compute the first k)."""
    out = [(1.0, 0.0, Decision())]
    models = registry.MODELS
    for c in candidates:
        model = c.drafter in models
        if model and not model_runs:
            continue
        per_row = coef["verify_rows"] + (coef["model_draft_rows"] if model else 0.0)
        extra = coef["lookup_requests"] if c.drafter in registry.LOOKUPS else 0.0
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
    if row <= 0 or any(coef[name] < 0 for name in FEATURES[3:]):  # the drafting and verify-path parts
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


@dataclass
class _Row:
    """One request slot's state."""

    own: dict[str, SurvivalEstimate]  # the request's own recent conditional rates, per drafter
    done: bool = False  # the forward stream saw it finish (length or stop token id)
    stops: Optional[frozenset[int]] = None  # its stop token ids, eos included unless ignored (set once)
    steps: int = 0
    last_try: dict[str, int] = field(default_factory=dict)  # step of the latest window per drafter


class AdaptivePolicy:
    """Plans each verify step and learns from it; one per engine rank (rank 0's plan is used)."""

    def __init__(
        self,
        drafters: Sequence[str],
        gamma: int,
        cost: StepCostModel,
        eos_token_ids: Sequence[int] = (),
        explore_every: int = 64,
        min_gain: float = 0.0,
        closed_batch_pricing: bool = True,
    ):
        self.drafters = tuple(drafters)
        self.closed_batch_pricing = closed_batch_pricing  # False: price every batch as if refilled
        self.gamma = gamma
        self.cost = cost
        self.eos_token_ids = frozenset(eos_token_ids)
        self.explore_every = explore_every
        self.min_gain = min_gain  # a plan must beat plain decoding by this fraction (prediction errors)
        self.rows: dict[int, _Row] = {}
        self.declarations = {name: registry.get(name) for name in self.drafters}
        # Engine-wide conditional rates per drafter, per position, one estimate per rate bucket of its hints.
        self.rates = {
            name: [SurvivalEstimate(gamma, prior=p, decay=0.98, prior_weight=1.0) for p in d.priors]
            for name, d in self.declarations.items()
        }
        # this step's hints per drafter and request slot: (rate bucket, most useful drafts)
        self._hints: dict[str, dict[int, tuple[int, int]]] = {}
        self.calibration = Calibration()  # per window with drafts
        self.step_calibration = Calibration()  # per step: the mean over its windows with drafts
        self._estimates_version = 0  # bumped whenever a survival estimate changes (see _decide)
        self._last_key: Optional[tuple] = None
        self._weight_key: Optional[tuple[int, int, int]] = None  # token_weight's (live requests, cost table, its version)
        self._weight = 1.0
        self._own_bound, self._own_bound_version = 0.0, -1  # the largest own first rate, per estimates version
        self._plans = 0  # planned steps with a live request (the engine's clock for exploration)
        self._explored: dict[str, int] = {}  # the planned step of each drafter's latest exploring window
        self._last: tuple[bool, list[list[Candidate]], list[Decision]] = (True, [], [])

    # ------------------------------------------------------------ per request slot

    def start(self, row: int) -> None:
        """A new request occupies this slot (its prefill finished)."""
        self.rows[row] = _Row({name: SurvivalEstimate(self.gamma) for name in self.drafters})
        self._estimates_version += 1

    def observe_tokens(self, row: int, tokens: Sequence[int], params: SamplingParams, out_len: int) -> None:
        """Tokens the slot committed (out_len: its output length after them): marks it finished
        when the scheduler will see it finish by length or by a stop token id."""
        state = self.rows.get(row)
        if state is None:
            return
        if state.stops is None:
            state.stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        if out_len >= params.max_new_tokens or any(t in state.stops for t in tokens):
            state.done = True

    # ------------------------------------------------------------ planning

    def plan(
        self, rows: Sequence[int], speculating: Sequence[bool], hints: Optional[StepHints] = None, refills: bool = True
    ) -> StepPlan:
        """speculating[i]: request i may draft at all (a request without a drafter never does);
        hints: per drafter with hints, each request's (rate bucket, most useful drafts) (a drafter
        whose hints are missing is priced at bucket 0; see `needs_hints`); refills: a slot freed early
        lets another request in."""
        bs = len(rows)
        self._hints = {name: dict(zip(rows, found)) for name, found in (hints or {}).items()}
        drafters: list[Optional[str]] = [None] * bs
        drafts, predicted = [0] * bs, [1.0] * bs
        live = [i for i, row in enumerate(rows) if not self._row(row).done]
        self._plans += bool(live)  # steps of finished requests only (the overlap loop's extra step) do not count
        weight = self.token_weight(len(live), refills)
        plain, candidates, decisions = self._decide(rows, live, speculating, weight)
        if plain:  # most large-batch steps: no survival curves, unless a request is due to explore
            candidates = (
                [self._candidates(rows[i]) if speculating[i] else [] for i in live]
                if self._stale(rows, live)
                else [[] for _ in live]
            )
        decisions = self._explore(rows, live, candidates, decisions)
        for i, decision, cands in zip(live, decisions, candidates):
            if decision.drafter is not None and decision.drafts > 0:
                drafters[i], drafts[i] = decision.drafter, decision.drafts
                predicted[i] = decision.expected_tokens(cands)
        buckets = [self._bucket(name, row) if name is not None else 0 for name, row in zip(drafters, rows)]
        return StepPlan(drafters, drafts, predicted, StepShape.of(drafters, drafts), buckets)

    def _decide(
        self, rows: Sequence[int], live: list[int], speculating: Sequence[bool], weight: float
    ) -> tuple[bool, list[list[Candidate]], list[Decision]]:
        """Whether plain decoding wins outright, else the live requests' candidates and the
        search's decisions. Reused from the last step while nothing they depend on changed (the
        estimates: no window with drafts and no new request since; the cost table: no refit; the
        requests, their match buckets and the weight): a run of plain steps then plans for the
        price of a comparison, where the search cost about 2% of a 135M model's decode step."""
        if self._plain_wins_by_bound(rows, live, speculating, weight):
            return True, [], [Decision()] * len(live)
        key = (
            self._estimates_version,
            self.cost.version,
            weight,
            tuple((rows[i], tuple(h.get(rows[i]) for h in self._hints.values()), speculating[i]) for i in live),
        )
        if key != self._last_key:
            if self._plain_wins(rows, live, speculating, weight):
                self._last = (True, [], [Decision() for _ in live])
            else:
                candidates = [self._candidates(rows[i]) if speculating[i] else [] for i in live]
                self._last = (False, candidates, choose_drafts(_weighted(candidates, weight), self.cost, self.min_gain))
            self._last_key = key
        return self._last

    def token_weight(self, live: int, refills: bool) -> float:
        """An accepted draft's worth as a share of the step's average cost per token (module
        docstring): 1 when a freed slot is refilled or one request runs alone; in a closed batch of `live` requests
        its own row's cost, coefficient `requests` x live / the plain step's time."""
        if refills or live <= 1 or not self.closed_batch_pricing:
            return 1.0
        key = (live, id(self.cost), self.cost.version)
        if self._weight_key != key:  # the same until the batch or the cost table changes
            row = max(self.cost.coefficients()["requests"], 0.0)
            self._weight_key, self._weight = key, min(1.0, row * live / self.cost.predict(StepShape(live)))
        return self._weight

    def needs_hints(
        self, name: str, rows: Sequence[int], speculating: Sequence[bool], hints: StepHints, refills: bool = True
    ) -> bool:
        """Whether this step's plan may depend on drafter `name`'s hints (an ON_DEMAND drafter's: a
        lookup per request, the cost that matters in a large batch), given the hints already found:
        not when plain decoding wins even with every request in its best bucket and no request is
        due to explore; then the plan is the same without them."""
        if name not in self.drafters:
            return False
        self._hints = {n: dict(zip(rows, found)) for n, found in hints.items()}
        live = [i for i, row in enumerate(rows) if not self._row(row).done]
        weight = self.token_weight(len(live), refills)
        wins = self._plain_wins_by_bound(rows, live, speculating, weight, every_bucket=name)
        return not wins or self._stale(rows, live)

    def _plain_wins_by_bound(
        self, rows: Sequence[int], live: list[int], speculating: Sequence[bool], weight: float, every_bucket: str = ""
    ) -> bool:
        """_plain_wins from an upper bound of every request's first-draft survival, in a few reads:
        a blend of a request's own rate and its hint is at most the larger of the two, so the bound
        is the largest of the engine-wide rates of the buckets present and of every request's own
        first rate (kept until an estimate changes); drafter `every_bucket`'s, of all its buckets. A
        large batch that never drafts then plans each step without a pass over its requests; where
        the bound does not settle it, _plain_wins does."""
        if not live:
            return True
        if self._own_bound_version != self._estimates_version:
            own = [est.first_rate for row in self.rows.values() for est in row.own.values() if est.tested[0] > 0]
            self._own_bound, self._own_bound_version = max(own, default=0.0), self._estimates_version
        bound = self._own_bound
        for name, rates in self.rates.items():
            if name == every_bucket:
                buckets = set(range(len(rates)))
            elif self.declarations[name].hints is Hints.EVERY_STEP:
                buckets = {self._bucket(name, rows[i]) for i in live if speculating[i]}
            else:  # this step's requests' (a superset of the live)
                buckets = {bucket for bucket, _ in self._hints.get(name, {}).values()} or {0}
            bound = max([bound] + [rates[b].first_rate for b in buckets])
        return self._plain_beats(live, min(max(bound, 0.0), 1.0) * weight)

    def _plain_beats(self, live: list[int], best_first: float) -> bool:
        """No plan beats plain decoding when no request's first draft survives beyond best_first."""
        plain_rate = len(live) / self.cost.predict(StepShape(len(live)))
        return plain_beats_every_plan(best_first, self.cost, plain_rate * (1 + self.min_gain))

    def _plain_wins(self, rows: Sequence[int], live: list[int], speculating: Sequence[bool], weight: float) -> bool:
        """No plan beats plain decoding, judged from each request's first-draft survival alone."""
        best_first = 0.0
        for i in live:
            if speculating[i]:
                state = self._row(rows[i])
                for name in self.drafters:
                    hint = self._global(name, self._bucket(name, rows[i])).first_rate
                    best_first = max(best_first, state.own[name].first(hint))
        return not live or self._plain_beats(live, best_first * weight)

    def _stale(self, rows: Sequence[int], live: list[int]) -> bool:
        """Some live request is due to explore a drafter that the engine may explore now (it then
        needs its candidates)."""
        due = self._explorable()
        if not due:
            return False
        return any(
            self._row(rows[i]).steps - min(self._row(rows[i]).last_try.get(n, 0) for n in due) >= self.explore_every
            for i in live
        )

    def _explorable(self) -> tuple[str, ...]:
        """The drafters not explored in the last explore_every planned steps."""
        if self.explore_every <= 0:
            return ()
        return tuple(
            n for n in self.drafters if self._plans - self._explored.get(n, -self.explore_every) >= self.explore_every
        )

    def _row(self, row: int) -> _Row:
        if row not in self.rows:
            self.start(row)
        return self.rows[row]

    def _hint(self, name: str, row: int) -> tuple[int, int]:
        return self._hints.get(name, {}).get(row, NO_HINT)

    def _bucket(self, name: str, row: int) -> int:
        return self._hint(name, row)[0]

    def _global(self, name: str, bucket: int) -> SurvivalEstimate:
        """The engine-wide rates a request's estimate blends with: the drafter's, for the bucket
        its hint put the request in this step (one bucket without hints)."""
        return self.rates[name][bucket]

    def _candidates(self, row: int) -> list[Candidate]:
        state = self._row(row)
        out = []
        for name in self.drafters:
            bucket, most = self._hint(name, row)
            survival = state.own[name].survival(self._global(name, bucket).rates)
            if self.declarations[name].caps_drafts:  # no more drafts than it found: past them a window verifies filler
                survival = survival[:most]
            out.append(Candidate(name, survival))
        return out

    def _explore(
        self, rows: Sequence[int], live: list[int], candidates: list[list[Candidate]], decisions: list[Decision]
    ) -> list[Decision]:
        """At most one window per step tries a drafter its request has not used for explore_every
        of its steps, and only a drafter the engine has not explored for explore_every planned steps;
        with every draft the drafter has for it (gamma; SUFFIX: what its walk found, never none)."""
        due = self._explorable()
        if not due:
            return decisions
        stale = []
        for j, i in enumerate(live):
            state = self._row(rows[i])
            offered = {c.drafter: len(c.survival) for c in candidates[j] if c.survival}
            for name in due:
                idle = state.steps - state.last_try.get(name, 0)
                if name in offered and idle >= self.explore_every and decisions[j].drafter != name:
                    stale.append((-idle, j, name, offered[name]))
        if not stale:
            return decisions
        _, j, name, drafts = min(stale)
        self._explored[name] = self._plans
        out = list(decisions)
        out[j] = Decision(name, drafts)
        return out

    # ------------------------------------------------------------ learning

    def observe_accept(self, rows: Sequence[int], plan: StepPlan, accepted: Sequence[int]) -> None:
        """The accepted drafts of each window of a planned step."""
        predicted_sum, realised_sum, windows = 0.0, 0, 0
        buckets = plan.buckets or [0] * len(rows)
        for row, name, k, predicted, a, bucket in zip(rows, plan.drafters, plan.drafts, plan.predicted, accepted, buckets):
            state = self._row(row)
            if state.done:  # a step after its last (the overlap loop's extra one): nothing to learn
                continue
            state.steps += 1
            if name is None or k == 0:
                continue
            state.last_try[name] = state.steps
            self._estimates_version += 1
            state.own[name].observe(k, a)
            self._global(name, bucket).observe(k, a)
            self.calibration.record(predicted, 1 + a)
            predicted_sum, realised_sum, windows = predicted_sum + predicted, realised_sum + 1 + a, windows + 1
        if windows:
            self.step_calibration.record(predicted_sum / windows, realised_sum / windows)

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        self.cost.observe(shape, seconds)


def _weighted(candidates: list[list[Candidate]], weight: float) -> list[list[Candidate]]:
    """Candidates whose drafts count `weight` tokens each: survival scaled (still non-increasing
    probabilities), so 1 + weight * (s_1 + .. + s_k) is what the policy maximises per second."""
    if weight >= 1.0:
        return candidates
    return [[Candidate(c.drafter, tuple(weight * s for s in c.survival)) for c in cands] for cands in candidates]
