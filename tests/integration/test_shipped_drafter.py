"""The shipped drafter for the embedded model: the default, lossless in fp32, accepted well above a
random drafter, identical acceptance in both loops, and the stale-accept race's second symptom (draft K/V
injected at positions shifted by commit_len) visible as an accept-length drop."""

from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import chat_prompts, policy_args

from specserve import Engine
from specserve.assets import default_drafter_path
from specserve.models.dspark_checkpoint import read_drafter_config

CONTENTS = ["Explain what a CPU does.", "Write a short story about a cat who learns to swim.",
            "List five tips for staying healthy.", "Describe how a bicycle works."]
GREEDY = {"temperature": 0, "max_new_tokens": 48}
# The default engine, its policy on a frozen table where drafting pays and with the shipped drafter
# as its only candidate: these tests measure that drafter, in both loops alike.
DSPARK_ONLY = {**policy_args(), "speculative_policy_drafters": "DSPARK"}


@pytest.fixture(scope="module")
def shipped() -> str:
    path = default_drafter_path()
    assert path is not None, "specserve/assets/drafters/smollm2-135m-instruct is missing"
    return path


@pytest.fixture(scope="module")
def prompts(fp32_engine):
    return chat_prompts(fp32_engine, CONTENTS)


@pytest.fixture(scope="module")
def reference(fp32_engine, prompts):
    fp32_engine.scheduler.ledger.tree.reset()
    return [o["output_ids"] for o in fp32_engine.generate(input_ids=prompts, sampling_params=GREEDY)]


def accept_length(outs: list[dict]) -> float:
    steps = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    return sum(o["meta_info"]["completion_tokens"] - 1 for o in outs) / steps


def test_shipped_drafter_fits_the_size_budget_and_has_a_card(shipped):
    size = sum(os.path.getsize(os.path.join(shipped, f)) for f in os.listdir(shipped))
    assert size <= 30 * 2**20, size
    read_drafter_config(shipped)
    with open(os.path.join(shipped, "train_state.json")) as f:
        state = json.load(f)  # every extension that made it, the first run included
    assert state["steps"] > 0 and state["extensions"] and state["extensions"][-1]["steps"] == state["steps"]
    assert os.path.isfile(os.path.join(shipped, "README.md"))


@pytest.fixture(scope="module")
def loop_runs(shipped, prompts) -> dict[bool, list[dict]]:
    """The default engine (no speculative flags) under the overlap and the normal loop."""
    runs = {}
    for overlap in (True, False):
        engine = Engine(dtype="float32", max_total_tokens=4096, disable_overlap_schedule=not overlap, **DSPARK_ONLY)
        assert engine.args.speculative_algorithm == "DSPARK"
        assert engine.args.speculative_draft_model_path == shipped
        runs[overlap] = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        engine.scheduler.check_integrity()
        engine.shutdown()
    return runs


@pytest.mark.parametrize("overlap", [True, False])
def test_lossless_and_accepted(loop_runs, reference, overlap):
    outs = loop_runs[overlap]
    assert [o["output_ids"] for o in outs] == reference
    length = accept_length(outs)
    assert length > 1.15, length  # a random drafter gives 1.00-1.01 (measured on MT-Bench)


def test_both_loops_accept_identically(loop_runs):
    def acceptance(outs):
        return [(o["meta_info"]["spec_verify_ct"], o["meta_info"]["spec_correct_drafts_histogram"]) for o in outs]

    assert acceptance(loop_runs[True]) == acceptance(loop_runs[False])


def test_injection_shifted_by_commit_len_drops_acceptance(shipped, prompts, fp32_engine):
    """Mutation: inject each step's committed rows at S + commit_len (the positions a view of
    `new_seq_lens`, rewritten by the step, would give): still lossless, but acceptance drops."""
    # Every window drafted whole (the policy off): accept lengths compare the drafter alone. 96 tokens:
    # the drafter leans on its context K/V more as the answer grows (at 48 the drop can vanish).
    long = {**GREEDY, "max_new_tokens": 96}
    fp32_engine.scheduler.ledger.tree.reset()
    reference = [o["output_ids"] for o in fp32_engine.generate(input_ids=prompts, sampling_params=long)]
    engine = Engine(dtype="float32", max_total_tokens=4096, disable_overlap_schedule=True, speculative_policy="fixed")
    good = accept_length(engine.generate(input_ids=prompts, sampling_params=long))
    runner = engine.runner

    def shifted(hidden, out, prefix, window_slots, verify_lens):
        return type(runner)._verified_rows(runner, hidden, out, prefix + out.commit_lens, window_slots, verify_lens)

    runner._verified_rows = shifted
    engine.scheduler.ledger.tree.reset()
    outs = engine.generate(input_ids=prompts, sampling_params=long)
    assert [o["output_ids"] for o in outs] == reference  # the target still decides every token
    bad = accept_length(outs)
    # Deterministic (fp32, fixed prompts). With this weakly context-bound drafter the drop is small
    # (extension 2: 1.418 -> 1.392); the exact positions are checked by the oracle tests.
    assert bad < good, (good, bad)
    engine.shutdown()


def test_q8_drafter_weights_stay_lossless_accepted_and_take_the_target_heads_codes(prompts):
    """--speculative-draft-weights q8: the drafter's linears and reduced head computed from Q8_0
    codes (the head's are the target's own Q8_0 codes, with int8 activations), the Markov head's
    one-row W2 in bf16; bf16 output still the target's alone."""
    from specserve.kernels.linear import BF16, Q8

    plain = Engine(max_total_tokens=4096, speculative_algorithm="NONE")
    reference = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=GREEDY)]
    plain.shutdown()
    engine = Engine(max_total_tokens=4096, speculative_draft_weights="q8", speculative_policy="fixed")
    drafter = engine.runner.speculation.workers["DSPARK"].drafter
    linears = [m for m in drafter.modules() if getattr(m, "kernel", None) is not None and m is not drafter.markov_w2]
    assert linears and all(m.kernel.format == Q8 and m.weight.numel() == 0 for m in linears)
    assert drafter.markov_w2.kernel.format == BF16 and drafter.lm_head.kernel.int8_activations
    target_rows = engine.runner.model.lm_head.rows(drafter.draft_to_target, torch.float32)
    assert torch.equal(drafter.lm_head.kernel.dense_rows(torch.arange(drafter.draft_vocab_size)), target_rows)
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == reference
    assert accept_length(outs) > 1.15
    engine.shutdown()
