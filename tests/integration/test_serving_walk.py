"""The training-side evaluator reproduces serving: walking a response with anchors placed where
serving places them gives the engine's per-step accepted-draft counts exactly (fp32, greedy,
static verify), and a walk that places anchors otherwise does not."""

from __future__ import annotations

import pytest

from specserve import Engine
from specserve.datasets import mtbench_first_turns
from specserve.train import eval_drafter, serving_walk

PROMPTS = [q["prompt"] for q in mtbench_first_turns()[10:13]]


@pytest.fixture(scope="module")
def served():
    engine = Engine(dtype="float32", speculative_algorithm="DSPARK", speculative_policy="fixed",
                    max_running_requests=3, random_seed=0)
    yield engine, eval_drafter.serve(engine, PROMPTS, 40)[0]
    engine.shutdown()


def test_walk_reproduces_served_steps_exactly(served):
    engine, responses = served
    report = eval_drafter.walk(engine, responses)
    assert report["walk_equals_served"] == len(PROMPTS)
    assert report["served"]["steps"] == report["serving_walk"]["steps"] > 0
    assert report["served"]["accept_length"] == pytest.approx(report["serving_walk"]["accept_length"])
    assert report["serving_walk"]["accept_length"] > 1.0  # the shipped drafter is accepted: the walk has content
    assert report["every_anchor"]["anchors"] > report["serving_walk"]["steps"]


def test_a_walk_with_misplaced_anchors_is_caught(served, monkeypatch):
    def off_by_one(accepts, prompt_len, length):  # the next anchor is the last accepted draft
        steps, S = [], prompt_len
        while S < length - 1:
            a = int(accepts[S - prompt_len])
            steps.append(a)
            S += max(a, 1)
        return steps

    monkeypatch.setattr(serving_walk, "serving_walk", off_by_one)
    assert eval_drafter.walk(*served)["walk_equals_served"] < len(PROMPTS)


def test_eval_drafter_cli_reports_served_walk_and_every_anchor(tmp_path):
    import json

    from specserve.cli import main as cli_main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS[:2]))
    out = tmp_path / "eval.json"
    assert cli_main(["eval-drafter", "--prompts", str(prompts), "--dtype", "float32", "--max-new-tokens", "24",
                     "--batch-size", "2", "--out", str(out)]) == 0
    report = json.load(open(out))["sets"][str(prompts)]
    assert report["requests"] == report["walk_equals_served"] == 2
    served = report["served"]
    assert served["accept_length"] == pytest.approx(report["serving_walk"]["accept_length"])
    assert served["first_draft_accepted"] == pytest.approx(report["serving_walk"]["first_draft_accepted"])
    assert 0 < served["steps"] < served["completion_tokens"]
