"""NGRAM speculative decoding through the verify/accept path: lossless in fp32 greedy."""

from __future__ import annotations

import pytest

from helpers import chat_prompts, policy_args

from specserve import Engine

CONTENTS = ["Repeat this list exactly three times: apple, banana, cherry, date.",
            "Write a python function that adds two numbers, then call it twice.",
            "What is the capital of France?", "Count from 1 to 20, separated by commas.",
            "Spell the word 'banana' letter by letter, twice.", "Tell me a short story about a robot.",
            "List the days of the week.", "Write the alphabet in capital letters."]
GREEDY = {"temperature": 0, "max_new_tokens": 40}


@pytest.fixture(scope="module")
def prompts(fp32_engine):
    return chat_prompts(fp32_engine, CONTENTS)


@pytest.fixture(scope="module")
def reference(fp32_engine, prompts):
    fp32_engine.scheduler.ledger.tree.reset()
    return [o["output_ids"] for o in fp32_engine.generate(input_ids=prompts, sampling_params=GREEDY)]


@pytest.mark.parametrize("gamma", [1, 3, 5, 7])
def test_ngram_greedy_is_lossless(fp32_engine, prompts, reference, gamma):
    spec = Engine(dtype="float32", max_total_tokens=8192, speculative_algorithm="NGRAM", **policy_args(),
                  speculative_num_steps=gamma)
    batch = spec.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in batch] == reference
    alone = spec.generate(input_ids=prompts[0], sampling_params=GREEDY)
    assert alone["output_ids"] == reference[0]
    accepted = sum(o["meta_info"].get("spec_num_correct_drafts", 0) for o in batch)
    assert accepted > 0, "repetitive prompts must accept some drafts"
    for out in batch:
        info = out["meta_info"]
        # The first token comes from prefill; every verify step emits its accepted drafts and a
        # bonus, except that a stop (or max_new_tokens) inside the last run may cut its bonus.
        bonuses = info["completion_tokens"] - 1 - info.get("spec_num_correct_drafts", 0)
        steps = sum(info["spec_draft_len_histogram"].values())  # decode steps, with drafts or without
        assert bonuses in (steps, steps - 1), info
        assert info.get("spec_verify_ct", 0) == steps - info["spec_draft_len_histogram"].get(0, 0)
    spec.scheduler.check_integrity()
    spec.scheduler.ledger.tree.reset()
    assert spec.scheduler.ledger.allocator.available == spec.scheduler.ledger.allocator.size


def test_stop_inside_an_accepted_run_emits_nothing_past_it(fp32_engine):
    prompt = fp32_engine.tokenizer.apply_chat_template([{"role": "user", "content": CONTENTS[3]}])
    full = fp32_engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 60})
    assert "9. 9" in full["text"], full["text"]
    spec = Engine(dtype="float32", max_total_tokens=4096, speculative_algorithm="NGRAM", **policy_args(), speculative_num_steps=7)
    params = {"temperature": 0, "max_new_tokens": 60, "stop": ["9. 9"]}
    ours = spec.generate(input_ids=prompt, sampling_params=params)
    plain = fp32_engine.generate(input_ids=prompt, sampling_params=params)
    assert ours["text"] == plain["text"] == full["text"][:full["text"].index("9. 9")]
    assert ours["output_ids"] == plain["output_ids"]
    stop_id = full["output_ids"][10]
    ours = spec.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 60, "stop_token_ids": [stop_id]})
    assert ours["output_ids"] == full["output_ids"][:full["output_ids"].index(stop_id) + 1]
    limited = spec.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 9})
    assert limited["output_ids"] == full["output_ids"][:9]
    spec.scheduler.check_integrity()


@pytest.mark.parametrize("drafter,policy", [("NGRAM", "adaptive"), ("SUFFIX", "fixed")])
def test_lookup_sampling_is_seeded_and_reproducible(drafter, policy):
    """A seeded request samples the same tokens batched and alone, given the same drafts: each run
    on a fresh engine, since SUFFIX's drafts also come from the outputs of earlier requests (SUFFIX
    with every window drafted: on this short sampled reply the policy may draft none)."""
    def engine() -> Engine:
        chosen = policy_args() if policy == "adaptive" else {"speculative_policy": "fixed"}
        return Engine(dtype="float32", max_total_tokens=4096, speculative_algorithm=drafter, **chosen,
                      speculative_num_steps=4)

    spec = engine()
    prompt = spec.tokenizer.apply_chat_template([{"role": "user", "content": CONTENTS[0]}])
    params = {"temperature": 0.7, "top_p": 0.9, "seed": 5, "max_new_tokens": 32}
    a = spec.generate(input_ids=[prompt, prompt[:-3]], sampling_params=[params, {**params, "temperature": 0}])
    spec.scheduler.check_integrity()
    b = engine().generate(input_ids=prompt, sampling_params=params)
    assert a[0]["output_ids"] == b["output_ids"]
    assert a[0]["meta_info"]["spec_verify_ct"] > 0


def test_speculative_disable_batch_size_on_the_real_engine(prompts, reference):
    """--speculative-disable-batch-size 2 (with the fixed policy: every window drafts otherwise):
    with 3 requests running the step's plan has no drafts and the step runs as a plain decode step;
    windows carry drafts again once at most 2 run; the tokens are the plain ones."""
    spec = Engine(dtype="float32", max_total_tokens=4096, speculative_algorithm="NGRAM", speculative_policy="fixed",
                  speculative_num_steps=3, speculative_disable_batch_size=2)
    plans, verifies = [], []
    plan, verify = spec.runner._plan, spec.runner._verify

    def plan_spy(step, gamma):
        out = plan(step, gamma)
        plans.append((step.size, out.speculates))
        return out

    def verify_spy(step, *rest):
        verifies.append(step.size)
        return verify(step, *rest)

    spec.runner._plan, spec.runner._verify = plan_spy, verify_spy
    lens = [5, 10, 16]
    outs = spec.generate(input_ids=prompts[:3], sampling_params=[{**GREEDY, "max_new_tokens": n} for n in lens])
    assert [o["output_ids"] for o in outs] == [ref[:n] for ref, n in zip(reference, lens)]
    assert {speculates for size, speculates in plans if size == 3} == {False}, plans
    assert any(speculates for size, speculates in plans if size <= 2), plans
    assert 3 not in verifies and verifies == [size for size, speculates in plans if speculates]
    # Finished while 3 were running: every plan it was in had no drafts.
    assert "spec_verify_ct" not in outs[0]["meta_info"]
    assert set(outs[0]["meta_info"]["spec_draft_len_histogram"]) == {0}
    assert sum(n for k, n in outs[2]["meta_info"]["spec_draft_len_histogram"].items() if k > 0) > 0
    assert spec.scheduler.stats.verify_steps == sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    spec.scheduler.check_integrity()
