"""The speculation policy's parts without a model: the online step-cost model, the per-request
acceptance estimates and their calibration, and the batch decision of drafter and draft count."""

from __future__ import annotations

import random

import pytest

from specserve.errors import InternalError
from specserve.names import Algorithm
from specserve.speculative.policy import Calibration, SurvivalEstimate
from specserve.speculative.cost_model import FEATURES, StepCostModel, StepShape
from specserve.speculative.policy import Candidate, Decision, choose_drafts

DSPARK, NGRAM = Algorithm.DSPARK, Algorithm.NGRAM

# A CPU-like step: 7 ms fixed, 0.3 ms per request, 1 ms per verified draft row, 2 ms to run the
# DSpark drafter at all plus 0.2 ms per drafted row, 0.05 ms per NGRAM lookup.
TRUE = [7e-3, 3e-4, 1e-3, 2e-3, 2e-4, 5e-5, 5e-4]


def true_cost(shape: StepShape) -> float:
    return sum(c * f for c, f in zip(TRUE, shape.features()))


def random_shape(rng: random.Random) -> StepShape:
    bs = rng.randint(1, 16)
    dspark = rng.randint(0, bs)
    return StepShape(bs, rng.randint(0, 5 * bs), dspark, 5 * dspark, rng.randint(0, bs - dspark))


def test_cost_model_learns_the_step_cost_online_and_freezing_stops_learning():
    rng = random.Random(0)
    model = StepCostModel([5e-3, 0, 5e-4, 0, 0, 0, 0], prior_steps=5)
    probe = StepShape(8, 20, 8, 40, 0)
    before = abs(model.predict(probe) - true_cost(probe)) / true_cost(probe)
    for _ in range(300):
        shape = random_shape(rng)
        model.observe(shape, true_cost(shape) * rng.uniform(0.97, 1.03))
    after = abs(model.predict(probe) - true_cost(probe)) / true_cost(probe)
    assert before > 0.2 and after < 0.03, (before, after)
    assert model.mean_abs_relative_residual < 0.05
    model.freeze()
    frozen = model.coefficients()
    for _ in range(50):
        model.observe(probe, 1.0)  # a wild measurement: ignored while frozen
    assert model.coefficients() == frozen


def test_cost_model_rejects_bad_priors_and_ignores_bad_times():
    with pytest.raises(InternalError, match="coefficients"):
        StepCostModel([1.0])
    model = StepCostModel([1e-3] * len(FEATURES))
    model.observe(StepShape(1), float("nan"))
    model.observe(StepShape(1), -1.0)
    assert model.steps == 0
    seeded = StepCostModel.from_sps([1, 6, 32], [100.0, 80.0, 30.0])
    assert seeded.predict(StepShape(1)) == pytest.approx(0.01, rel=1e-6)
    assert seeded.predict(StepShape(32)) == pytest.approx(1 / 30.0, rel=1e-6)


def test_a_cost_table_recorded_under_the_old_feature_names_still_loads(tmp_path):
    import json

    from specserve.errors import ConfigError

    now = dict(zip(FEATURES, [1e-2, 1e-3, 1e-4, 2e-4, 1e-5, 3e-5, 4e-6]))
    renamed = {"model_draft_step": "dspark_step", "model_draft_rows": "dspark_rows", "lookup_requests": "ngram_requests"}
    before = {renamed.get(name, name): value for name, value in now.items()}
    tables = {}
    for label, coefficients in (("now", now), ("before", before), ("both", {**now, "dspark_rows": 1.0})):
        tables[label] = str(tmp_path / f"{label}.json")
        with open(tables[label], "w") as f:
            json.dump({"coefficients_s": coefficients}, f)
    assert StepCostModel.load(tables["before"]).coefficients() == StepCostModel.load(tables["now"]).coefficients() == now
    with pytest.raises(ConfigError, match="model_draft_rows"):
        StepCostModel.load(tables["both"])


def frozen_true_model() -> StepCostModel:
    model = StepCostModel(TRUE)
    model.freeze()
    return model


def test_plain_decoding_when_a_verify_row_costs_more_than_it_gains():
    weak = [[Candidate(DSPARK, (0.05, 0.01, 0.0)), Candidate(NGRAM, (0.02, 0.0, 0.0))]] * 4
    assert choose_drafts(weak, frozen_true_model()) == [Decision()] * 4


def test_ngram_is_chosen_for_a_request_whose_suffix_matches():
    copying = [Candidate(DSPARK, (0.3, 0.1, 0.03)), Candidate(NGRAM, (0.95, 0.9, 0.85))]
    chatting = [Candidate(DSPARK, (0.3, 0.1, 0.03)), Candidate(NGRAM, (0.0, 0.0, 0.0))]
    decisions = choose_drafts([copying, chatting], frozen_true_model())
    assert decisions[0] == Decision(NGRAM, 3)
    assert decisions[1] == Decision()


def test_drafts_grow_longer_as_acceptance_rises():
    counts = []
    for rate in (0.3, 0.6, 0.8, 0.9, 0.97):
        survival = tuple(rate ** j for j in range(1, 7))
        counts.append(choose_drafts([[Candidate(NGRAM, survival)]], frozen_true_model())[0].drafts)
    assert counts == sorted(counts) and counts[0] < counts[-1], counts


def test_the_batch_optimum_differs_from_each_request_deciding_alone():
    # A step where each request's own row is dear (1 ms), a verified draft row cheap (0.3 ms) and
    # running the DSpark drafter at all costs 10 ms: one request's expected gain does not repay
    # that fixed cost, eight requests drafting in the same step share it.
    requests = [[Candidate(DSPARK, (0.75, 0.5))]] * 8
    model = StepCostModel([7e-3, 1e-3, 3e-4, 1e-2, 5e-5, 0.0, 0.0])
    model.freeze()
    alone = [choose_drafts([r], model)[0] for r in requests]
    together = choose_drafts(requests, model)
    assert alone == [Decision()] * 8
    assert all(d.drafter == DSPARK and d.drafts > 0 for d in together)

    def rate(decisions):
        tokens = sum(d.expected_tokens(r) for d, r in zip(decisions, requests))
        drafting = sum(d.drafts > 0 for d in decisions)
        rows = sum(d.drafts for d in decisions)
        shape = StepShape(8, rows, drafting, rows, 0)  # every draft here is DSPARK's: a row of its heads
        return tokens / model.predict(shape)

    assert rate(together) > rate(alone) * 1.05


def test_dspark_drafts_are_priced_by_the_rows_its_heads_compute():
    """The drafter computes its heads for the k drafts a window verifies (its block is whole
    whatever k): each DSPARK draft costs a verified row plus a head row, so dear head rows make
    shorter DSPARK windows, where a per-block price could not tell k = 1 from k = gamma."""
    requests = [[Candidate(DSPARK, (0.9, 0.75, 0.6))]]

    def chosen(head_row_s: float) -> Decision:
        model = StepCostModel([7e-3, 1e-3, 3e-4, 1e-3, head_row_s, 0.0, 0.0])
        model.freeze()
        return choose_drafts(requests, model)[0]

    cheap, dear = chosen(0.0), chosen(4.5e-3)
    assert cheap == Decision(DSPARK, 3)
    assert dear.drafter == DSPARK and 0 < dear.drafts < 3, dear


def test_candidates_must_be_non_increasing_probabilities():
    with pytest.raises(InternalError, match="non-increasing"):
        Candidate(DSPARK, (0.5, 0.7))
    with pytest.raises(InternalError, match="non-increasing"):
        Candidate(NGRAM, (1.5,))


def test_survival_estimate_follows_the_request_and_blends_hints():
    est = SurvivalEstimate(gamma=4, prior=0.5, decay=0.5)
    for _ in range(10):
        est.observe(drafted=4, accepted=4)  # everything accepted
    high = est.survival()
    assert high[0] > 0.99 and high[3] > 0.95
    for _ in range(10):
        est.observe(drafted=4, accepted=0)  # first draft rejected: later positions untested
    low = est.survival()
    assert low[0] < 0.01
    assert est.rates[1] > 0.99  # position 2 was never tested again
    own = est.tested[0] / (est.tested[0] + est.credibility)
    assert est.survival(hint=[1.0, 1.0, 1.0, 1.0])[0] == pytest.approx(own * est.rates[0] + (1 - own) * 1.0)
    fresh = SurvivalEstimate(gamma=2)
    assert fresh.survival(hint=[0.3, 0.5]) == pytest.approx((0.3, 0.15))  # no own evidence: the hint alone


def test_a_prior_with_weight_survives_one_rejected_window():
    """The engine-wide rates count their prior as one window: a single rejection halves the
    rate instead of zeroing it (which kept the policy off a drafter until its next exploration),
    and steady evidence still wins."""
    est = SurvivalEstimate(gamma=2, prior=0.4, decay=0.98, prior_weight=1.0)
    est.observe(drafted=2, accepted=0)
    assert est.rates == pytest.approx([0.2, 0.4])
    for _ in range(200):
        est.observe(drafted=2, accepted=2)
    assert est.rates[0] > 0.97
    assert SurvivalEstimate(gamma=1, prior=0.4).rates == [0.4]  # no evidence: the prior, whatever its weight


def test_calibration_tracks_error_and_bias():
    cal = Calibration()
    for predicted, realised in ((2.0, 1.0), (1.5, 2.5), (3.0, 3.0)):
        cal.record(predicted, realised)
    assert cal.windows == 3
    assert cal.mean_abs_error == pytest.approx(2.0 / 3)
    assert cal.bias == pytest.approx(0.0)


def test_the_large_batch_shortcut_never_changes_the_decision(monkeypatch):
    """When the shortcut says no plan beats plain decoding, the full search agrees."""
    import specserve.speculative.policy as policy_module

    rng = random.Random(3)
    model = frozen_true_model()
    shortcuts = 0
    for _ in range(60):
        bs = rng.randint(1, 24)
        scale = rng.choice([0.05, 0.2, 0.6])
        def candidate(name: str) -> Candidate:
            rate = scale * rng.random()
            return Candidate(name, tuple(rate ** j for j in range(1, 4)))

        requests = [[candidate(DSPARK), candidate(NGRAM)] for _ in range(bs)]
        fast = choose_drafts(requests, model)
        with monkeypatch.context() as m:
            m.setattr(policy_module, "_nothing_can_pay", lambda *a: False)
            full = choose_drafts(requests, model)
        assert fast == full
        plain = policy_module._Plan(requests, model).rate([Decision()] * bs)
        shortcuts += policy_module._nothing_can_pay(requests, model, plain)
    assert shortcuts > 5  # the shortcut was actually taken in some cases


def test_directions_the_steps_never_separate_stay_at_the_prior():
    """One-draft NGRAM windows only: verified rows, NGRAM lookups and the verify path's fixed
    cost always rise together, so the
    data fixes their sum, not the split. Anchored to the prior, the split stays where the prior
    put it and a five-draft window is still predicted sensibly (plain forgetting RLS drifted here
    to 5.3 ms a row and -3.4 ms a lookup on the real engine)."""
    rng = random.Random(1)
    prior = [7e-3, 3e-4, 1e-3, 2e-3, 2e-4, 1e-4, 0.0]
    truth = [7.5e-3, 3e-4, 1.2e-3, 2e-3, 2e-4, 1e-4, 0.0]
    model = StepCostModel(prior)
    for i in range(3000):
        shape = StepShape(1, 1, 0, 0, 1) if i % 3 else StepShape(1)
        model.observe(shape, sum(c * f for c, f in zip(truth, shape.features())) * rng.uniform(0.9, 1.1))
    coef = model.coefficients()
    together = coef["verify_rows"] + coef["lookup_requests"] + coef["verify_step"]  # all rise together here
    assert together == pytest.approx(truth[2] + truth[5] + truth[6], rel=0.1)
    assert 0.5e-3 < coef["verify_rows"] < 2e-3 and 0 <= coef["lookup_requests"] < 1e-3, coef
    assert abs(coef["verify_step"]) < 0.5e-3, coef
    five = StepShape(1, 5, 0, 0, 1)
    assert model.predict(five) == pytest.approx(sum(c * f for c, f in zip(truth, five.features())), rel=0.1)


def test_the_search_finds_the_exact_optimum_of_small_batches():
    """Against every combination of options (Dinkelbach's method is exact for this objective)."""
    import itertools

    from specserve.speculative.policy import _Plan

    rng = random.Random(7)
    model = StepCostModel([7e-3, 1e-3, 8e-4, 3e-3, 2e-4, 1e-4, 3e-4])
    model.freeze()
    for _ in range(40):
        bs = rng.randint(1, 3)
        requests = []
        for _ in range(bs):
            a, b = rng.random(), rng.random()
            requests.append([Candidate(DSPARK, (a, a * a * rng.random())), Candidate(NGRAM, (b, b * b))])
        plan = _Plan(requests, model)
        options = [[Decision()] + [Decision(c.drafter, k) for c in cands for k in (1, 2)] for cands in requests]
        best = max(plan.rate(list(combo)) for combo in itertools.product(*options))
        assert plan.rate(choose_drafts(requests, model)) == pytest.approx(best, rel=1e-9)


def test_first_is_the_first_survival():
    rng = random.Random(5)
    est = SurvivalEstimate(gamma=3)
    for _ in range(30):
        hint = rng.random()
        assert est.first(hint) == pytest.approx(est.survival([hint, 0.5, 0.5])[0])
        est.observe(3, rng.randint(0, 3))


def test_a_plan_must_beat_plain_decoding_by_the_margin():
    """A draft whose predicted gain is small (about +3% tokens per second here) is taken with no
    margin and refused with a 5% one; a large gain passes either way."""
    model = StepCostModel([7e-3, 3e-4, 1e-3, 0.0, 0.0, 0.0, 0.0])
    model.freeze()
    small = [[Candidate(NGRAM, (0.18,))]]  # 1.18 tokens in 8.3 ms against 1 in 7.3 ms: +3.8%
    assert choose_drafts(small, model) == [Decision(NGRAM, 1)]
    assert choose_drafts(small, model, min_gain=0.05) == [Decision()]
    large = [[Candidate(NGRAM, (0.9,))]]
    assert choose_drafts(large, model, min_gain=0.05) == [Decision(NGRAM, 1)]


def test_batched_refits_fit_what_one_update_a_step_fits():
    """The model refits every refit_every steps from the pending steps in one weighted update; the
    sums must be those of one update a step (a mutation giving the newest step the oldest step's
    weight fails this)."""
    rng = random.Random(3)
    prior = [5e-3, 1e-4, 5e-4, 1e-3, 1e-4, 1e-5, 1e-4]
    every_step, batched = StepCostModel(prior, refit_every=1), StepCostModel(prior, refit_every=8)
    for i in range(8 * 40):
        shape = random_shape(rng)
        seconds = true_cost(shape) * rng.uniform(0.8, 1.2)
        every_step.observe(shape, seconds)
        batched.observe(shape, seconds)
        if i == 6:  # before its first refit the batched model still predicts from the prior
            assert list(batched.coefficients().values()) == prior
    for name, value in every_step.coefficients().items():
        assert batched.coefficients()[name] == pytest.approx(value, rel=1e-9, abs=1e-15), name
    batched.observe(StepShape(3), 1.0)  # pending at freeze: folded in, as one update a step would
    every_step.observe(StepShape(3), 1.0)
    batched.freeze()
    assert batched.coefficients() == pytest.approx(every_step.coefficients(), rel=1e-9)
