"""The real model against Hugging Face transformers loading the same GGUF, in float32."""

from __future__ import annotations

import pytest
import torch
from helpers import CHAT_PROMPTS
from helpers import prefill_logits

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


def test_multi_token_window_after_cached_prefix_matches_full_prefill(fp32_engine):
    """A batched step of several new tokens per request over cached KV (the verify shape)."""
    from helpers import windowed_logits

    model = fp32_engine.runner.model
    prompts = [fp32_engine.tokenizer.encode(t) for t in
               ["The capital of France is Paris, and the capital of Italy is Rome.",
                "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
                "Once upon a time, in a small village by the sea, there lived an old fisherman."]]
    windows = windowed_logits(model, prompts, window=6)
    for ids, got in zip(prompts, windows):
        full = prefill_logits(model, ids)[-6:]
        assert (got - full).abs().max().item() < 1e-3
