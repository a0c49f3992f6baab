"""The adaptive speculation policy on the real engine (bf16, the default): lossless whatever it
plans, the same plans in both loops when its cost table is frozen, calibrated predictions, and
its decisions in every request's meta_info."""

from __future__ import annotations

import pytest

from helpers import chat_prompts, policy_args

from specserve import Engine
from specserve.datasets import mtbench_first_turns

CONTENTS = ["Repeat this list exactly three times: apple, banana, cherry, date.",
            "Correct the grammar: 'me and him goes to the store yesterday and buyed three apple.'",
            "What is the capital of France?", "Count from 1 to 20, separated by commas.",
            "Write a python function that adds two numbers, then call it twice.",
            "Tell me a short story about a robot."]
LENGTHS = [40, 24, 12, 40, 32, 20]  # requests finish at different steps: the batch shrinks under the policy


def greedy(n: int) -> dict:
    return {"temperature": 0, "max_new_tokens": n}


@pytest.fixture(scope="module")
def reference():
    with Engine(max_total_tokens=8192, speculative_algorithm="NONE") as engine:
        prompts = chat_prompts(engine, CONTENTS)
        outs = engine.generate(input_ids=prompts, sampling_params=[greedy(n) for n in LENGTHS])
        return prompts, [o["output_ids"] for o in outs]


def run_to_end(engine: Engine, prompts, params) -> list:
    reqs = [engine.submit(ids, p) for ids, p in zip(prompts, params)]
    while not all(r.finished for r in reqs):
        engine.step()
    return reqs


def test_lossless_with_identical_plans_in_both_loops(reference):
    prompts, want = reference
    plans, engines_outputs = {}, {}
    for overlap in (True, False):
        with Engine(max_total_tokens=8192, disable_overlap_schedule=not overlap, **policy_args()) as engine:
            reqs = run_to_end(engine, prompts, [greedy(n) for n in LENGTHS])
            engines_outputs[overlap] = [r.output_ids for r in reqs]
            plans[overlap] = [r.spec_plans for r in reqs]
            engine.scheduler.check_integrity()
    assert engines_outputs[True] == engines_outputs[False] == want  # lossless in bf16, batch shrinking
    assert plans[True] == plans[False]  # the same drafter and draft count for every request at every step
    decisions = [d for per_req in plans[True] for d in per_req]
    drafters = {name for name, k in decisions if k}
    assert drafters == {"DSPARK", "NGRAM", "SUFFIX"}, decisions  # every candidate was chosen somewhere
    assert {k for _, k in decisions} - {0}, decisions  # and windows of different lengths
    assert len({k for _, k in decisions}) >= 3, decisions


def test_lossless_for_every_candidate_set_at_batch_1_and_8(reference):
    prompts, want = reference
    for drafters in ("NGRAM", "SUFFIX", "DSPARK", "DSPARK,NGRAM", "NGRAM,SUFFIX"):
        with Engine(max_total_tokens=8192, speculative_policy_drafters=drafters, **policy_args()) as engine:
            outs = engine.generate(input_ids=prompts + prompts[:2], sampling_params=[greedy(n) for n in LENGTHS + LENGTHS[:2]])
            assert [o["output_ids"] for o in outs] == want + want[:2], drafters
            alone = engine.generate(input_ids=prompts[3], sampling_params=greedy(LENGTHS[3]))
            assert alone["output_ids"] == want[3]
            used = {d for o in outs for d in o["meta_info"].get("spec_drafter_steps", {})}
            assert used == set(drafters.split(",")), (drafters, used)


def test_meta_info_reports_the_plan_and_predictions(reference):
    prompts, _ = reference
    with Engine(max_total_tokens=8192, **policy_args()) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=[greedy(n) for n in LENGTHS])
    for o, n in zip(outs, LENGTHS):
        info = o["meta_info"]
        steps = sum(info["spec_draft_len_histogram"].values())
        assert steps <= n - 1  # every decode step of the request, with drafts or without
        assert info.get("spec_verify_ct", 0) == steps - info["spec_draft_len_histogram"].get(0, 0)
        assert sum(info["spec_drafter_steps"].values()) == info.get("spec_verify_ct", 0)
        if info.get("spec_verify_ct"):
            assert 1.0 <= info["spec_predicted_accept_length"] <= 1 + max(info["spec_draft_len_histogram"])


def test_predicted_accept_length_is_calibrated_on_mt_bench():
    """Eight MT-Bench first turns at batch 8, the default candidates on the frozen table where
    drafting pays (so that every step drafts and is judged): per step, the mean predicted accept
    length of its windows is within 0.3 tokens of the realised one on average, without a bias
    past 0.15. (A single window is a coin flip: even exact probabilities err by ~0.4 on it.)"""
    questions = mtbench_first_turns()[::10]
    with Engine(max_total_tokens=16384, **policy_args()) as engine:
        prompts = chat_prompts(engine, [q["prompt"] for q in questions])
        engine.generate(input_ids=prompts, sampling_params=greedy(64))
        policy = engine.runner.speculation.policy
        per_step, per_window = policy.step_calibration, policy.calibration
        stats = engine.scheduler.stats
    assert per_step.windows >= 40, per_step
    assert per_step.mean_abs_error <= 0.3, (per_step.mean_abs_error, per_step.bias, per_window.mean_abs_error)
    assert abs(per_step.bias) <= 0.15, per_step
    # The scheduler's view (from each window's outcome) counts the same windows.
    assert stats.predicted_windows == per_window.windows
    assert abs(stats.predicted_sum - per_window.predicted_sum) < 1e-6 * per_window.windows


def test_generate_runs_a_closed_batch_and_submitted_requests_an_open_one(reference):
    """Engine.generate tells the policy that a freed slot stays empty; requests submitted one by
    one (as the server does) run as an open batch, and the engine is open again after generate."""
    prompts, _ = reference
    with Engine(max_total_tokens=8192, **policy_args()) as engine:
        seen: list[bool] = []
        plan = engine.runner._plan
        engine.runner._plan = lambda step, gamma: seen.append(step.refills) or plan(step, gamma)
        engine.generate(input_ids=prompts[:2], sampling_params=greedy(8))
        assert seen and not any(seen), seen
        assert not engine.scheduler.queues.closed
        seen.clear()
        run_to_end(engine, prompts[:2], [greedy(8)] * 2)
        assert seen and all(seen), seen
