"""SUFFIX speculative decoding through the verify/accept path: lossless in fp32 greedy, and a
repeated task drafted from the earlier requests' outputs (seeded sampling: test_ngram_spec.py)."""

from __future__ import annotations

import pytest

from helpers import policy_args

from specserve import Engine
from test_ngram_spec import CONTENTS, GREEDY, prompts, reference  # noqa: F401 (the shared fixtures)

FIXED = {"speculative_algorithm": "SUFFIX", "speculative_policy": "fixed"}


@pytest.mark.parametrize("gamma,policy", [(3, FIXED), (7, FIXED), (5, {"speculative_algorithm": "SUFFIX", **policy_args()})])
def test_suffix_greedy_is_lossless(fp32_engine, prompts, reference, gamma, policy):
    spec = Engine(dtype="float32", max_total_tokens=8192, speculative_num_steps=gamma, **policy)
    batch = spec.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in batch] == reference
    alone = spec.generate(input_ids=prompts[0], sampling_params=GREEDY)
    assert alone["output_ids"] == reference[0]
    assert sum(o["meta_info"].get("spec_num_correct_drafts", 0) for o in batch) > 0
    spec.scheduler.check_integrity()


def test_a_repeated_task_drafts_from_past_outputs(fp32_engine, prompts, reference):
    """The same request again: its own tokens hold no answer yet, the global index holds the first
    answer, so the second run accepts most of its tokens as drafts (and still equals plain decoding)."""
    spec = Engine(dtype="float32", max_total_tokens=8192, speculative_num_steps=5, **FIXED)
    first = spec.generate(input_ids=prompts[5], sampling_params=GREEDY)  # a story: little repeats within it
    spec.scheduler.ledger.tree.reset()
    second = spec.generate(input_ids=prompts[5], sampling_params=GREEDY)
    assert first["output_ids"] == second["output_ids"] == reference[5]
    first_hits, second_hits = (o["meta_info"].get("spec_num_correct_drafts", 0) for o in (first, second))
    assert second_hits > max(first_hits, GREEDY["max_new_tokens"] // 2), (first_hits, second_hits)
    suffix = spec.runner.speculation.worker("SUFFIX")
    # the first request's output only (entered as the second started), with any tokens its last verify
    # committed past the length limit (the forward stream commits them; the scheduler cuts the reply)
    held = suffix.global_index.tokens[:-1]
    assert held[: len(first["output_ids"])] == first["output_ids"] and len(held) <= len(first["output_ids"]) + 5


def test_a_request_scoped_engine_never_drafts_from_past_outputs(fp32_engine, prompts, reference):
    """The same request again under --speculative-suffix-scope request: its drafts come from its own
    tokens only, so it accepts exactly as many as the first run (above, under the default global
    scope, the second run accepts more), and no output is kept."""
    spec = Engine(dtype="float32", max_total_tokens=8192, speculative_num_steps=5,
                  speculative_suffix_scope="request", **FIXED)
    first = spec.generate(input_ids=prompts[5], sampling_params=GREEDY)
    spec.scheduler.ledger.tree.reset()
    second = spec.generate(input_ids=prompts[5], sampling_params=GREEDY)
    assert first["output_ids"] == second["output_ids"] == reference[5]
    first_hits, second_hits = (o["meta_info"].get("spec_num_correct_drafts", 0) for o in (first, second))
    assert second_hits == first_hits, (first_hits, second_hits)
    suffix = spec.runner.speculation.worker("SUFFIX")
    assert not suffix.config.shares_outputs and len(suffix.global_index) == 0
