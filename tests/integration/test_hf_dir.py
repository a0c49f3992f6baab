"""Loading a Hugging Face directory (config.json, *.safetensors, tokenizer.json): llama and qwen2."""

from __future__ import annotations

import pytest
import torch
import transformers  # a test dependency: a broken install fails the run, never skips it
from helpers import prefill_logits

from specserve import Engine



# RoPE scalings, with an original context short enough that the test's positions reach the
# scaled frequencies (llama3: long wavelengths divided by the factor, the middle smoothed; yarn:
# the same with its own ramp, and the cos/sin magnitude).
SCALINGS = {
    "llama": None,
    "llama-rope-llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 32},
    "llama-rope-linear": {"rope_type": "linear", "factor": 4.0},
    # YaRN: the ramp spans pairs 0..2 of 8 at this size; every cos/sin scaled by 0.1 ln(8) + 1.
    "llama-rope-yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32},
}


def _tiny_dir(tmp_path, hf_tokenizer, arch: str):
    common = dict(vocab_size=len(hf_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  eos_token_id=2, bos_token_id=1)
    if arch.startswith("llama"):
        scaling = SCALINGS[arch]
        config = transformers.LlamaConfig(**common, tie_word_embeddings=True, rope_theta=10000.0,
                                          **({"rope_scaling": {**scaling, "rope_theta": 10000.0}} if scaling else {}))
        model_cls = transformers.LlamaForCausalLM
    else:
        config = transformers.Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1e6)
        model_cls = transformers.Qwen2ForCausalLM
    return _saved_random(model_cls(config), tmp_path, hf_tokenizer)


def _saved_random(model, tmp_path, hf_tokenizer):
    """`model` with random weights (seeded), saved with the tokenizer as a Hugging Face directory."""
    torch.manual_seed(0)
    model = model.eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(tmp_path, safe_serialization=True)
    hf_tokenizer.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("arch", [*SCALINGS, "qwen2"])
def test_hf_directory_logits_match_transformers(tmp_path, hf_tokenizer, arch):
    model = _tiny_dir(tmp_path, hf_tokenizer, arch)
    engine = Engine(model_path=str(tmp_path), dtype="float32", max_total_tokens=1024)
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    assert ids == hf_tokenizer.encode("The quick brown fox jumps over the lazy dog", add_special_tokens=False)
    ours = prefill_logits(engine.runner.model, ids)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4
    out = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
    with torch.no_grad():
        ref_ids = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8, min_new_tokens=8)[0, len(ids):]
    assert out["output_ids"] == ref_ids.tolist()
    engine.scheduler.check_integrity()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_hf_mixture_directory_logits_and_tokens_match_transformers(tmp_path, hf_tokenizer, arch):
    """Qwen3-MoE (q/k norms, renormalised top-k) and Qwen2-MoE (Q/K/V biases, a gated shared expert)
    from a Hugging Face directory: its per-expert tensors are the GGUF loader's names."""
    common = dict(vocab_size=len(hf_tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                  num_experts_per_tok=2, max_position_embeddings=256, eos_token_id=2, bos_token_id=1,
                  tie_word_embeddings=False)  # fmt: skip
    if arch == "qwen3_moe":
        config, model_cls = transformers.Qwen3MoeConfig(**common, head_dim=16, norm_topk_prob=True), transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.Qwen2MoeConfig(**common, shared_expert_intermediate_size=48)
        model_cls = transformers.Qwen2MoeForCausalLM
    model = _saved_random(model_cls(config), tmp_path, hf_tokenizer)
    engine = Engine(model_path=str(tmp_path), dtype="float32", max_total_tokens=1024, speculative_algorithm="NONE")
    assert engine.runner.model.config.is_moe
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
        ref_ids = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8, min_new_tokens=8)[0, len(ids):]
    assert (prefill_logits(engine.runner.model, ids) - ref).abs().max().item() < 1e-4
    out = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
    assert out["output_ids"] == ref_ids.tolist()
    engine.shutdown()
