"""The real model against Hugging Face transformers loading the same GGUF, in float32."""

from __future__ import annotations

import pytest
import torch
from conftest import CHAT_PROMPTS
from model_helpers import prefill_logits

# Observed here: 6.3e-5 max abs difference on logits of magnitude ~40 (fp32 rounding only).
LOGITS_ATOL = 1e-3


@pytest.mark.parametrize("text", ["The quick brown fox jumps over the lazy dog.", "1234 + 5678 = ", "def fib(n):\n    return"])
def test_prefill_logits_match_transformers(fp32_engine, hf_model, text):
    ids = fp32_engine.tokenizer.encode(text)
    ours = prefill_logits(fp32_engine.runner.model, ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff < LOGITS_ATOL, f"max |logit diff| {diff}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_chat_prompt_logits_match_transformers(fp32_engine, hf_model):
    ids = fp32_engine.tokenizer.apply_chat_template([{"role": "user", "content": CHAT_PROMPTS[0]}])
    ours = prefill_logits(fp32_engine.runner.model, ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max().item() < LOGITS_ATOL


def test_greedy_generation_token_identical_to_transformers(checked, hf_model):
    engine = checked
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[1:4]]
    ours = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 64})
    for ids, out in zip(prompts, ours):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=64,
                                    pad_token_id=engine.tokenizer.eos_token_id)
        ref_new = ref[0, len(ids):].tolist()
        assert out["output_ids"] == ref_new
        assert len(ref_new) == 64, "the prompts are chosen to produce at least 64 tokens"
