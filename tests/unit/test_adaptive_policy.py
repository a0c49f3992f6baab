"""The adaptive policy's run-time side without a model: per-slot state, finished rows, exploration,
learning per drafter and NGRAM match length, and the NGRAM index it reads."""

from __future__ import annotations

import random

from specserve.names import Algorithm
from specserve.sampling_params import SamplingParams
from specserve.speculative.policy import AdaptivePolicy
from specserve.speculative.cost_model import StepCostModel
from specserve.speculative.ngram_worker import MAX_MATCH_BUCKET, TokenHistory

DSPARK, NGRAM, SUFFIX = Algorithm.DSPARK, Algorithm.NGRAM, Algorithm.SUFFIX

GAMMA = 4
# 10 ms a step, 1 ms a request, 0.5 ms a verified draft, 0.5 ms to run DSpark at all.
TABLE = [1e-2, 1e-3, 5e-4, 5e-4, 1e-5, 1e-5, 0.0]
NEVER_PAYS = [1e-2, 1e-3, 1.0, 1.0, 1e-5, 1e-5, 0.0]  # a verified draft row costs a second


def policy(table=TABLE, drafters=(DSPARK, NGRAM), explore_every=0) -> AdaptivePolicy:
    cost = StepCostModel(table)
    cost.freeze()
    return AdaptivePolicy(drafters, GAMMA, cost, eos_token_ids=(2,), explore_every=explore_every)


def hints(match, suffix=None) -> dict:
    """The step's hints as Speculation gathers them: NGRAM's per match length, SUFFIX's as given."""
    out = {NGRAM: [(min(m, MAX_MATCH_BUCKET), GAMMA) for m in match]}
    return out if suffix is None else {**out, SUFFIX: suffix}


def brute_force_match(tokens: list[int], gamma: int, max_ngram: int = 4) -> tuple[int, list[int]]:
    """The definition: the latest earlier occurrence of the longest suffix (max_ngram..1 tokens)."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                follow = tokens[start + n:start + n + gamma]
                return n, follow + [follow[-1]] * (gamma - len(follow))
    return 0, [tokens[-1]] * gamma


def test_the_ngram_index_finds_what_a_scan_finds():
    rng = random.Random(0)
    for trial in range(200):
        tokens = [rng.randint(0, 2 + trial % 7) for _ in range(rng.randint(1, 60))]
        history = TokenHistory()
        cut = rng.randint(1, len(tokens))
        history.extend(tokens[:cut])  # grown in two commits, as the forward stream does
        history.extend(tokens[cut:])
        for gamma in (1, 3, 6):
            assert history.match(gamma) == brute_force_match(tokens, gamma), (tokens, gamma)


def teach(p: AdaptivePolicy, row: int, drafter: str, accepted: int, steps: int, match_len: int = 0) -> None:
    """Feed `steps` windows of GAMMA drafts by `drafter` with `accepted` accepted each."""
    for _ in range(steps):
        plan = p.plan([row], [True], hints([match_len]))
        plan.drafters, plan.drafts = [drafter], [GAMMA]
        plan.buckets = [min(match_len, MAX_MATCH_BUCKET) if drafter == NGRAM else 0]  # the rates it is priced by
        p.observe_accept([row], plan, [accepted])


def test_windows_follow_acceptance_engine_wide_and_per_request():
    p = policy()
    p.start(0)
    teach(p, 0, DSPARK, GAMMA, 30)  # everything accepted
    plan = p.plan([0], [True], hints([0]))
    assert plan.drafters == [DSPARK] and plan.drafts[0] >= 3 and plan.predicted[0] > 3.0
    p = policy()
    p.start(1)
    teach(p, 1, DSPARK, 0, 100)  # nothing accepted
    plan = p.plan([1], [True], hints([0]))
    assert plan.drafts == [0] and plan.drafters == [None] and plan.predicted == [1.0]
    # Same engine-wide rates, different own histories: the request that accepts drafts more.
    p = policy(drafters=(DSPARK,))
    p.start(0)
    p.start(1)
    for _ in range(20):
        teach(p, 0, DSPARK, GAMMA, 1)
        teach(p, 1, DSPARK, 1, 1)
    plan = p.plan([0, 1], [True, True], hints([0, 0]))
    assert plan.drafts[0] > plan.drafts[1], plan


def test_one_rejected_window_does_not_rule_a_drafter_out():
    """After one engine-wide window with its first draft rejected, the DSPARK rate is its prior
    halved, not 0, and a fresh request still drafts where that pays: the plain-wins shortcut reads
    the same smoothed rate as the search (it read the raw counts, 0, and planned plain decoding)."""
    p = policy(drafters=(DSPARK,))
    p.rates[DSPARK][0].observe(GAMMA, 0)
    assert p.rates[DSPARK][0].rates[0] > 0.1
    p.start(0)
    plan = p.plan([0], [True], hints([0]))
    assert plan.drafters == [DSPARK] and plan.drafts[0] >= 1, plan


def test_ngram_rates_are_learned_per_match_length():
    p = policy(drafters=(NGRAM,))
    p.start(0)
    p.start(1)
    teach(p, 0, NGRAM, GAMMA, 40, match_len=4)  # long matches: copied text, accepted
    teach(p, 1, NGRAM, 0, 40, match_len=1)  # one-token matches: rejected
    p.start(2)
    p.start(3)
    plan = p.plan([2, 3], [True, True], hints([4, 1]))  # fresh requests: only the engine-wide rates differ
    assert plan.drafters == [NGRAM, None] and plan.drafts[0] > 0


def test_finished_rows_get_no_drafts_and_do_not_change_the_others_plans():
    p = policy()
    for row in range(3):
        p.start(row)
    teach(p, 0, DSPARK, 3, 10)
    teach(p, 1, NGRAM, 2, 10, match_len=3)
    teach(p, 2, DSPARK, GAMMA, 10)
    alone = p.plan([0, 1], [True, True], hints([0, 3]))
    p.observe_tokens(2, [7, 2], SamplingParams(max_new_tokens=100), out_len=20)  # 2 is EOS: finished
    with_finished = p.plan([0, 1, 2], [True, True, True], hints([0, 3, 0]))
    assert with_finished.drafts[2] == 0 and with_finished.drafters[2] is None
    assert (with_finished.drafters[:2], with_finished.drafts[:2]) == (alone.drafters, alone.drafts)
    p.start(2)  # a new request in the slot
    assert p.plan([2], [True], hints([0])).drafts[0] > 0


def test_finished_by_length_and_eos_ignored():
    p = policy()
    p.start(0)
    p.observe_tokens(0, [2], SamplingParams(max_new_tokens=100, ignore_eos=True), out_len=5)
    assert not p.rows[0].done
    p.observe_tokens(0, [9, 9], SamplingParams(max_new_tokens=8), out_len=8)
    assert p.rows[0].done
    p.start(1)
    p.observe_tokens(1, [5], SamplingParams(max_new_tokens=100, stop_token_ids=[5]), out_len=3)
    assert p.rows[1].done


def test_requests_without_a_drafter_never_draft():
    p = policy()
    p.start(0)
    teach(p, 0, DSPARK, GAMMA, 20)
    assert p.plan([0], [False], hints([4])).drafts == [0]


def _explore_windows(rows: list[int], steps: int, explore_every: int) -> list[tuple[int, int, str, int]]:
    """(step, row, drafter, drafts) of every window a never-paying policy opens in `steps` steps."""
    p = policy(table=NEVER_PAYS, explore_every=explore_every)
    for row in rows:
        p.start(row)
    windows = []
    for step in range(steps):
        plan = p.plan(rows, [True] * len(rows), hints([2] * len(rows)))
        mine = [(step, row, d, k) for row, d, k in zip(rows, plan.drafters, plan.drafts) if k]
        assert len(mine) <= 1  # at most one exploring window per step
        windows += mine
        p.observe_accept(rows, plan, [0] * len(rows))
    return windows


def test_exploration_tries_an_unused_drafter_once_per_interval_one_window_a_step():
    windows = _explore_windows([0, 1, 2], 40, explore_every=8)
    assert all(k == GAMMA for *_, k in windows)
    for name in (DSPARK, NGRAM):
        steps = [step for step, _, d, _ in windows if d == name]
        assert 4 <= len(steps) <= 5 and all(b - a >= 8 for a, b in zip(steps, steps[1:])), (name, steps)
        for row in (0, 1, 2):  # the stalest request explores first, so each one gets its turn
            assert any(r == row for _, r, d, _ in windows if d == name), (name, row, windows)
    assert policy(table=NEVER_PAYS).plan([0, 1, 2], [True] * 3, hints([2] * 3)).drafts == [0, 0, 0]  # explore_every=0


def test_a_large_batch_explores_each_drafter_as_rarely_as_one_request_does():
    """Exploring is budgeted per planned step of the engine, not per request: 16 requests would
    otherwise open an exploring window in most steps (one each per interval and drafter)."""
    alone = _explore_windows([0], 64, explore_every=8)
    batch = _explore_windows(list(range(16)), 64, explore_every=8)
    for name in (DSPARK, NGRAM):
        assert sum(d == name for _, _, d, _ in batch) <= sum(d == name for _, _, d, _ in alone) <= 64 // 8


def test_calibration_per_window_and_per_step():
    p = policy()
    p.start(0)
    p.start(1)
    plan = p.plan([0, 1], [True, True], hints([0, 0]))
    plan.drafters, plan.drafts, plan.predicted = [DSPARK, DSPARK], [2, 2], [2.0, 1.0]
    p.observe_accept([0, 1], plan, [2, 0])  # realised 3 and 1
    assert p.calibration.windows == 2 and p.calibration.mean_abs_error == 0.5 * (1.0 + 0.0)
    assert p.step_calibration.windows == 1 and p.step_calibration.mean_abs_error == 0.5  # |1.5 - 2.0|


# A verified draft row costs 2 ms, a request's own row 1 ms, a step 10 ms on top.
ROWS_COST = [1e-2, 1e-3, 2e-3, 5e-4, 1e-5, 1e-5, 0.0]


def test_a_closed_batch_prices_drafts_by_the_row_they_save():
    """Drafts of two sure tokens per window: where a freed slot is refilled (or a request is alone),
    each saves a step's share of 14 ms / 4 and pays for its 2 ms row; in a closed batch of 4 it
    saves only its request's 1 ms row, and plain decoding wins."""
    p = policy(table=ROWS_COST, drafters=(NGRAM,))
    rows = [0, 1, 2, 3]
    for row in rows:
        p.start(row)
        teach(p, row, NGRAM, 2, 30, match_len=4)
    open_plan = p.plan(rows, [True] * 4, hints([4] * 4), refills=True)
    assert all(k >= 2 for k in open_plan.drafts), open_plan
    closed = p.plan(rows, [True] * 4, hints([4] * 4), refills=False)
    assert closed.drafts == [0] * 4 and not closed.speculates, closed
    assert p.token_weight(4, refills=False) == 1e-3 * 4 / (1e-2 + 4e-3)
    alone = p.plan([0], [True], hints([4]), refills=False)  # the last request of a closed batch saves whole steps
    assert alone.drafts[0] >= 2, alone
    # The expected accept length it reports is the drafts' own, not the priced share.
    assert open_plan.predicted[0] > 2.5


def test_a_reused_plan_is_the_plan_a_fresh_search_makes():
    """The policy reuses the last step's search while nothing it depends on changed; fed the same
    steps, a policy that searches afresh every step must plan identically (a key that leaves out
    the match bucket, or an accepted window that does not invalidate it, fails this)."""
    rng = random.Random(5)
    table = [6e-3, 1e-3, 2e-3, 4e-3, 1e-5, 1e-5, 1e-4]  # drafts pay only where they survive well
    cached, fresh = (AdaptivePolicy((DSPARK, NGRAM), GAMMA, StepCostModel(table), (2,), 32) for _ in range(2))
    reused = 0
    for step in range(600):
        bs = 1 if step % 200 < 150 else rng.choice((2, 3))  # long runs at batch 1, as a closed tail
        rows = list(range(bs))
        if rng.random() < 0.02:
            for p in (cached, fresh):
                p.start(rows[0])
        speculating = [rng.random() < 0.95 for _ in rows]
        match = [rng.choice((0,) * 12 + (1, 2, 5)) for _ in rows]
        refills = rng.random() < 0.8
        fresh._last_key = None
        before = cached._last_key
        plans = [p.plan(rows, speculating, hints(match), refills) for p in (cached, fresh)]
        reused += before is not None and cached._last_key is before
        assert (plans[0].drafters, plans[0].drafts, plans[0].predicted, plans[0].shape) == (
            plans[1].drafters, plans[1].drafts, plans[1].predicted, plans[1].shape), step
        accepted = [rng.randint(0, k) if rng.random() < 0.2 else 0 for k in plans[0].drafts]  # drafts rarely right
        seconds = 6e-3 + 1e-3 * bs + 2e-3 * sum(plans[0].drafts) * rng.uniform(0.5, 1.5)
        for p, plan in zip((cached, fresh), plans):
            p.observe_accept(rows, plan, accepted)
            p.observe_step(plan.shape, seconds)
    assert reused > 200, reused  # the reuse path ran


def _bound_violations(rng: random.Random, steps: int = 400) -> tuple[int, int, int]:
    """Random requests with own evidence (some far better than the engine-wide rates) and random
    match lengths: (steps where the bound shortcut says plain wins but the exact check does not,
    steps the bound settled, steps only the exact check settled)."""
    table = [6e-3, 1e-3, 2e-3, 4e-3, 1e-5, 1e-5, 1e-4]
    p = AdaptivePolicy((DSPARK, NGRAM), GAMMA, StepCostModel(table), (2,), 0)
    violations = settled = exact_only = 0
    for step in range(steps):
        bs = rng.choice((1, 2, 4, 8, 16))
        rows = list(range(bs))
        if rng.random() < 0.1:  # a request's own windows: mostly poor, sometimes all accepted
            row, name = rng.choice(rows), rng.choice((DSPARK, NGRAM))
            teach(p, row, name, GAMMA if rng.random() < 0.3 else 0, rng.randint(1, 6), rng.randint(0, 5))
        live = [i for i in rows if not p._row(i).done]
        speculating = [rng.random() < 0.9 for _ in rows]
        match = [rng.choice((0, 0, 0, 1, 2, 5)) for _ in rows]
        weight = rng.choice((1.0, 0.3, 0.05))
        p._hints = {name: dict(zip(rows, found)) for name, found in hints(match).items()}
        bound = p._plain_wins_by_bound(rows, live, speculating, weight)
        exact = p._plain_wins(rows, live, speculating, weight)
        violations += bound and not exact
        settled += bound
        exact_only += exact and not bound
    return violations, settled, exact_only


def test_the_plain_shortcut_bound_never_claims_more_than_the_exact_check():
    """The large-batch shortcut (`_plain_wins_by_bound`) may leave a step to the exact check but
    never says plain decoding wins where the exact check says a plan may beat it."""
    violations, settled, exact_only = _bound_violations(random.Random(7))
    assert violations == 0
    assert settled > 50 and exact_only > 0, (settled, exact_only)  # both outcomes occur


def test_a_bound_that_ignores_own_evidence_fails_the_bound_check(monkeypatch):
    """Mutation: a bound from the engine-wide rates alone misses a request whose own drafts are
    all accepted, so the check above must catch it."""

    def hints_only(self, rows, live, speculating, weight, every_bucket=""):
        bound = max(r.first_rate for rates in self.rates.values() for r in rates)
        return self._plain_beats(live, min(bound, 1.0) * weight) if live else True

    monkeypatch.setattr(AdaptivePolicy, "_plain_wins_by_bound", hints_only)
    violations, _, _ = _bound_violations(random.Random(7))
    assert violations > 0


def test_suffix_hints_are_skipped_only_where_the_plan_cannot_use_them():
    """A batch where no draft can pay (every drafted row costs a second) plans plainly without
    SUFFIX's lookups, and the plan is the one the hints would give; where drafting pays they are needed."""
    rows, speculating, match = list(range(8)), [True] * 8, [0] * 8
    costly = policy(NEVER_PAYS, drafters=(NGRAM, SUFFIX))
    assert not costly.needs_hints(SUFFIX, rows, speculating, hints(match))
    without = costly.plan(rows, speculating, hints(match))
    with_hints = policy(NEVER_PAYS, drafters=(NGRAM, SUFFIX)).plan(rows, speculating, hints(match, [(4, GAMMA)] * 8), True)
    assert without.drafts == with_hints.drafts == [0] * 8
    assert policy(drafters=(NGRAM, SUFFIX)).needs_hints(SUFFIX, rows, speculating, hints(match))


def test_suffix_is_offered_only_the_drafts_its_walk_found_even_when_explored():
    p = policy(drafters=(NGRAM, SUFFIX), explore_every=1)
    for step in range(6):
        plan = p.plan([0], [True], hints([0], [(4, 2)]), True)  # a long match, two tokens drafted
        assert plan.drafts[0] <= (2 if plan.drafters[0] == SUFFIX else GAMMA), plan
        p.observe_accept([0], plan, [min(plan.drafts[0], 1)])
    nothing = p.plan([0], [True], hints([0], [(0, 0)]), True)  # no walk: SUFFIX never drafts
    assert nothing.drafters[0] != SUFFIX


def test_each_hinted_drafter_has_a_prior_for_every_bucket_its_worker_gives():
    """The declarations' priors (torch-free) and the workers' hint buckets are written apart: a
    bucket past the priors would fail a step, so their counts are checked here."""
    from specserve import drafters
    from specserve.speculative.suffix_worker import MATCH_BUCKETS

    assert len(drafters.get(NGRAM).priors) == MAX_MATCH_BUCKET + 1  # match lengths 0..MAX_MATCH_BUCKET
    assert len(drafters.get(SUFFIX).priors) == len(MATCH_BUCKETS) + 1  # nothing matched, then each bucket
