"""Every GGUF architecture the engine reads, on tiny random models written in the test: fp32 greedy
tokens identical to Hugging Face transformers loading the same file (an independent reader and
model), in the tensor types real files mix; bf16 output independent of batch, cache and
speculation; an architecture the engine does not run is one clear error before weights load."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from helpers import int8_activations, layer_path_mismatches, prefill_logits
from tiny_gguf import (GPT_OSS, GPT_OSS_TYPES, MOE_TYPES, QWEN2_MOE, QWEN3_MOE, TinySpec, transformers_reference,
                       write_tiny_gguf)  # fmt: skip

from specserve import envs
from specserve.engine import Engine
from specserve.errors import ConfigError
from specserve.kernels.dispatch import available_paths
from specserve.kernels.linear import Q4, Q8
from specserve.models.layers import _ParallelLinear
from specserve.models.loader import load_model_config
from specserve.models.native_layer import NativeLayers
from specserve.models.rope_scaling import llama3_factors

# A Q4_K_M-like mix: the types llama.cpp's Q4_K_M and Q5_K_M files hold.
K_MIX = {"attn_q": Q.Q5_0, "attn_k": Q.Q8_0, "attn_v": Q.Q6_K, "attn_output": Q.Q4_K, "ffn_gate": Q.Q4_K,
         "ffn_up": Q.Q5_K, "ffn_down": Q.Q6_K, "token_embd": Q.Q8_0, "output": Q.Q6_K}
LEGACY = {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.Q5_1, "ffn_gate": Q.Q4_0,
          "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_1, "token_embd": Q.Q8_0}
MOE_MIX = {**K_MIX, **MOE_TYPES}
# Llama 3.1's RoPE scaling with an original context short enough for the prompts to reach it.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
MODELS = {
    "qwen2-kquants": (TinySpec("qwen2", bias=True, rope_base=1e6), K_MIX, "qwen2"),
    "qwen2-f32-untied": (TinySpec("qwen2", bias=True, tied=False), {}, "qwen2"),
    "llama-legacy-quants": (TinySpec("llama", tied=False), LEGACY, "llama-bpe"),
    "llama3-rope-freqs-kquants": (TinySpec("llama", rope_freqs=llama3_factors(1e4, 64, 8.0, 1.0, 4.0, 16)), K_MIX,
                                  "llama-bpe"),
    # YaRN from the file's rope.scaling keys, with an original context the prompts pass.
    "qwen2-yarn-kquants": (TinySpec("qwen2", bias=True, rope_base=1e6, yarn=(4.0, 8)), K_MIX, "qwen2"),
    "qwen3-kquants": (TinySpec("qwen3", head_dim=128, qk_norm=True, rope_base=1e6), K_MIX, "qwen2"),
    # Six layers: five with a sliding window shorter than the prompts, then a global one.
    "gemma3-kquants": (TinySpec("gemma3", layers=6, heads=2, kv_heads=1, head_dim=256, qk_norm=True, sandwich=True,
                                window=6, rope_base=1e6), K_MIX, "default"),
    # Mixtures of experts: 4 of 8 experts per token (renormalised), and 2 of 8 plus a gated shared expert.
    "qwen3moe-kquants": (QWEN3_MOE, MOE_MIX, "qwen2"),
    "qwen2moe-kquants": (QWEN2_MOE, MOE_MIX, "qwen2"),
    # gpt-oss: MXFP4 experts with biases, attention sinks, a sliding window on alternate layers, YaRN.
    "gpt-oss-mxfp4": (GPT_OSS, GPT_OSS_TYPES, "gpt-4o"),
}
PROMPTS = [[72, 101, 108, 108, 111, 44, 32, 119], [40, 98, 200, 17, 5, 250, 33, 101, 99, 1, 2, 3, 4], [100] * 5]
NEW_TOKENS = 24
LOGITS_ATOL = 1e-3  # float32 rounding only (the embedded model's parity test sees 6e-5)


@pytest.fixture(scope="module", params=sorted(MODELS))
def tiny_model(request, tmp_path_factory) -> str:
    spec, types, pre = MODELS[request.param]
    path = tmp_path_factory.mktemp(request.param) / "model.gguf"
    write_tiny_gguf(str(path), spec, types, seed=len(request.param), pre=pre)
    return str(path)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """transformers' model from the same file, float32 (its GGUF reader skips `rope_freqs` and the
    rope.scaling keys: the scaling they stand for is set on its config)."""
    model = transformers_reference(tiny_model)
    scaling = LLAMA3_ROPE if "rope-freqs" in tiny_model else YARN_ROPE if "yarn" in tiny_model else None
    if scaling is not None:
        model.config.rope_parameters = {**scaling, "rope_theta": model.config.rope_parameters["rope_theta"]}
        model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    return model


def _transformers_greedy(model) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for ids in PROMPTS:
            gen = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                                 min_new_tokens=NEW_TOKENS, pad_token_id=0)
            out.append(gen[0, len(ids):].tolist())
    return out


def _greedy(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]


def test_fp32_greedy_tokens_and_logits_identical_to_transformers(tiny_model, reference):
    long_prompt = [(7 * i + 3) % 256 for i in range(40)]  # longer than the gemma3 model's sliding window
    with Engine(model_path=tiny_model, dtype="float32", speculative_algorithm="NONE", max_total_tokens=2048) as engine:
        ours = _greedy(engine, PROMPTS)
        logits = prefill_logits(engine.runner.model, long_prompt)
    assert ours == _transformers_greedy(reference)
    assert len({tuple(t) for t in ours}) == len(PROMPTS), "the prompts must not all give one output"
    with torch.no_grad():
        ref = reference(torch.tensor([long_prompt])).logits[0]
    assert (logits - ref).abs().max().item() < LOGITS_ATOL


def _speculated(model_path: str) -> tuple[list[list[int]], int]:
    """bf16 greedy tokens under speculation, and how many drafted tokens verify accepted: the leg
    proves nothing unless output tokens came from accepted drafts. The model drafts for itself
    (STANDALONE, every step: the fixed policy), so most drafts are its own next tokens, decoded
    one row at a time, and verify must take them in a window of rows to the same bits."""
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    with Engine(model_path=model_path, dtype="bfloat16", speculative_algorithm="STANDALONE",
                speculative_draft_model_path=model_path, speculative_policy="fixed", max_total_tokens=2048) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    return [o["output_ids"] for o in outs], sum(o["meta_info"].get("spec_num_correct_drafts", 0) for o in outs)


def test_bf16_output_independent_of_batch_cache_and_speculation(tiny_model):
    with Engine(model_path=tiny_model, dtype="bfloat16", speculative_algorithm="NONE", max_total_tokens=2048) as engine:
        alone = [_greedy(engine, [p])[0] for p in PROMPTS]
        batched = _greedy(engine, PROMPTS)
        cached = _greedy(engine, PROMPTS[::-1])[::-1]  # the prompts' KV is in the radix cache now
    speculated, accepted = _speculated(tiny_model)
    assert alone == batched == cached == speculated
    assert accepted > 0, "no drafted token was accepted: the speculative leg compared plain decoding with itself"


def test_the_speculative_leg_fails_when_no_draft_is_accepted(tmp_path, monkeypatch):
    """Mutation: the drafter planted to propose a token the model never emits (the last vocabulary
    id). The tokens still equal plain decoding's (verify rejects every draft), so only the accepted
    count tells this run from one that checked speculation, and it must say 0."""
    import torch

    from specserve.speculative.standalone_worker import StandaloneWorker
    from specserve.speculative.worker import Drafts

    spec, types, pre = MODELS["qwen2-kquants"]
    path = str(tmp_path / "model.gguf")
    write_tiny_gguf(path, spec, types, seed=len("qwen2-kquants"), pre=pre)
    never = load_model_config(path).vocab_size - 1
    monkeypatch.setattr(StandaloneWorker, "draft",
                        lambda self, inp: Drafts(torch.full((len(inp.rows), inp.gamma), never, dtype=torch.int64)))
    tokens, accepted = _speculated(path)
    assert never not in {t for seq in tokens for t in seq}
    assert accepted == 0


def test_quantized_tensors_stay_codes_on_the_cpu_kernels(tiny_model):
    """Every K-quant and legacy type is computed from its codes: no layer keeps a dequantized weight,
    and the embedding reads its rows from packed codes (the tied head's, or its own)."""
    if not any(kind in tiny_model for kind in ("kquants", "legacy", "mxfp4")):
        pytest.skip("a float model: nothing quantized")
    with Engine(model_path=tiny_model, dtype="bfloat16", speculative_algorithm="NONE", max_total_tokens=256) as engine:
        model = engine.runner.model
        routers = ("mlp.gate", "mlp.shared_expert_gate")  # a mixture's routing vectors: F32 in every file
        linears = [m for n, m in model.named_modules()
                   if isinstance(m, _ParallelLinear) and m is not model.lm_head and not n.endswith(routers)]  # fmt: skip
        assert linears and all(m.kernel is not None and m.kernel.format in (Q4, Q8) for m in linears)
        assert all(m.weight.numel() == 0 for m in linears)
        assert model.embed_tokens.table is not None and model.embed_tokens.weight.numel() == 0
        if model._tied_head:
            assert model.embed_tokens.table is model.lm_head.kernel


def test_native_layers_give_the_per_op_layers_bits(tiny_model, monkeypatch):
    """Each decoder layer as one C++ call against the same layer op by op: logits, captured layer
    outputs and K/V bitwise equal on prefill chunks, extends, verify windows and decode rows, on
    every kernel path, with bf16 and with integer activations. A native layer built with the other
    MLP activation (a mixture: the other top-k weighting) must differ: the comparison can fail."""
    with Engine(model_path=tiny_model, dtype="bfloat16", speculative_algorithm="NONE", max_total_tokens=256) as engine:
        model = engine.runner.model
        assert model.native is not None and len(model.native.layers) == model.config.num_layers
        for path in available_paths():
            monkeypatch.setenv(envs.CPU_KERNEL_PATH, path)
            assert layer_path_mismatches(model, PROMPTS) == [], path
        monkeypatch.delenv(envs.CPU_KERNEL_PATH)
        native = model.native
        with int8_activations(model) as switched:
            assert switched == 0 or layer_path_mismatches(model, PROMPTS) == []
        mlp = model.layers[0].mlp
        # a mixture: its top-k weights renormalised or not (gpt-oss: its softmax before or after the top k)
        flag = "gelu" if hasattr(mlp, "gelu") else "softmax_after_topk" if mlp.softmax_after_topk else "normalize"
        setattr(mlp, flag, not getattr(mlp, flag))
        try:
            model.native = NativeLayers.build(list(model.layers))
        finally:
            setattr(mlp, flag, not getattr(mlp, flag))
        planted = layer_path_mismatches(model, PROMPTS)
        model.native = native
    assert "logits0" in planted and "k1" in planted, planted


def test_unsupported_architecture_is_one_error_before_weights_load(tmp_path):
    path = str(tmp_path / "phi.gguf")
    write_tiny_gguf(path, TinySpec("phi3"), {})
    with pytest.raises(ConfigError, match="GGUF architecture 'phi3' is not supported"):
        load_model_config(path)


def test_unsupported_pre_tokenizer_is_named(tmp_path):
    path = str(tmp_path / "odd.gguf")
    write_tiny_gguf(path, TinySpec("qwen2"), {}, pre="made-up")
    with pytest.raises(ConfigError, match="pre-tokenizer 'made-up' is not supported"):
        Engine(model_path=path, dtype="float32", speculative_algorithm="NONE", max_total_tokens=256)
