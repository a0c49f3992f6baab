"""Structured outputs under speculative decoding (fp32, the real model, the shipped DSpark drafter).

Fifty generated schemas (nested objects, enums, bounded arrays and strings, integer ranges,
optional fields) must each yield JSON that parses and validates, with DSPARK drafting; a grammar
that forbids what the drafter proposes still gives NONE's exact output; and a grammar state that
keeps rejected drafts (no rollback) must break that equality (the mutation test).
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from helpers import chat_prompts

from benchmarks.grammar import random_schema
from specserve.logits.grammar import GrammarState

DIGITS = {"temperature": 0, "max_new_tokens": 24, "regex": "[0-9]{1,4}( [0-9]{1,4}){0,8}"}


@pytest.fixture(scope="module")
def schemas():
    rng = random.Random(18)
    return [random_schema(rng) for _ in range(50)]


def test_fifty_schemas_validate_with_dspark_drafting(fp32_spec_engines, schemas):
    engine = fp32_spec_engines["DSPARK"]
    prompts = chat_prompts(engine, ["Reply with one example JSON object for a small web shop."] * len(schemas))
    outputs = engine.generate(input_ids=prompts, sampling_params=[
        {"temperature": 0, "max_new_tokens": 256, "json_schema": json.dumps(s)} for s in schemas])
    for schema, out in zip(schemas, outputs):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["text"]
        jsonschema.validate(json.loads(out["text"]), schema)
    verify = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outputs)
    accepted = sum(o["meta_info"].get("spec_num_correct_drafts", 0) for o in outputs)
    assert verify > 0 and accepted > 0  # speculation stayed on and drafts were accepted under the grammar
    print(f"50 schemas, DSPARK accept length {1 + accepted / verify:.3f} over {verify} verify steps")


@pytest.fixture(scope="module")
def digits_reference(fp32_engine):
    prompts = chat_prompts(fp32_engine, ["Tell me about cats.", "Write a haiku about rain."])
    return prompts, fp32_engine.generate(input_ids=prompts, sampling_params=DIGITS)


@pytest.mark.parametrize("alg", ["NGRAM", "DSPARK"])
def test_a_grammar_that_forbids_the_drafts_is_still_lossless(fp32_spec_engines, digits_reference, alg):
    prompts, reference = digits_reference
    outputs = fp32_spec_engines[alg].generate(input_ids=prompts, sampling_params=DIGITS)
    for ref, out in zip(reference, outputs):
        assert out["output_ids"] == ref["output_ids"]
        assert out["text"].replace(" ", "").isdigit()


def test_mutation_without_rollback_rejected_drafts_corrupt_the_state(fp32_spec_engines, fp32_engine, monkeypatch):
    prompts = chat_prompts(fp32_engine, ["Describe a person named Ann as JSON."])
    params = {"temperature": 0, "max_new_tokens": 48, "json_schema": json.dumps(
        {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
         "required": ["name", "age"], "additionalProperties": False})}
    reference = fp32_engine.generate(input_ids=prompts, sampling_params=params)
    assert fp32_spec_engines["DSPARK"].generate(input_ids=prompts, sampling_params=params)[0]["output_ids"] == \
        reference[0]["output_ids"]

    def keep_drafts(self, window):  # consumes the window and never rolls it back
        self.matcher.try_consume_tokens(list(window))
        return self._unpack(self.matcher.compute_bitmask()) if not self.matcher.is_error() else self._nothing_allowed()

    monkeypatch.setattr(GrammarState, "mask_after", keep_drafts)
    mutated = fp32_spec_engines["DSPARK"].generate(input_ids=prompts, sampling_params=params)
    assert mutated[0]["output_ids"] != reference[0]["output_ids"]
