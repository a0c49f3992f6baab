"""A drafter added as one file plus one registration line (tests/repeat_last_drafter.py): the flag
checks, the builder, the warm-up, the cost model and the adaptive policy take it from its
declaration, and greedy output with it is plain decoding's, under the fixed and the adaptive policy."""

from __future__ import annotations

import pytest

import repeat_last_drafter
from specserve import Engine, drafters
from specserve.args import ServerArgs
from specserve.errors import ConfigError

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6] * 4
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture
def registered():
    drafters.register(repeat_last_drafter.DRAFTER)  # the one registration line
    yield repeat_last_drafter.NAME
    drafters.unregister(repeat_last_drafter.NAME)


def test_an_unregistered_drafter_is_a_flag_error_naming_the_known_ones():
    with pytest.raises(ConfigError, match=r"speculative_algorithm must be one of DSPARK, NGRAM, SUFFIX, STANDALONE, NONE"):
        ServerArgs(speculative_algorithm=repeat_last_drafter.NAME)


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_a_registered_drafter_runs_and_its_greedy_output_is_plain_decodings(registered, fp32_engine, policy):
    plain = fp32_engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
    with Engine(dtype="float32", max_total_tokens=2048, speculative_algorithm=registered, speculative_policy=policy) as engine:
        assert sorted(engine.runner.speculation.workers) == [registered]
        out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        verified = engine.scheduler.stats.verify_steps
    assert out["output_ids"] == plain["output_ids"]
    if policy == "fixed":  # every step drafts with it
        assert verified > 0


def test_the_policy_prices_it_as_its_declaration_says(registered):
    from specserve.speculative.cost_model import StepShape

    shape = StepShape.of([registered, None, "NGRAM", "DSPARK"], [3, 0, 2, 4])
    assert (shape.requests, shape.verify_rows, shape.model_draft_requests, shape.model_draft_rows, shape.lookup_requests) == (4, 9, 1, 4, 2)
