"""GGUF Q4/Q8 weights served as their codes: exact codes, and logits close to the dequantized bf16 model."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from helpers import layer_path_mismatches, prefill_logits

from specserve.kernels.linear import BF16, Q4, Q8
from specserve.models.backend import CpuKernelOps
from specserve.models.llama import LlamaForCausalLM
from specserve.models.loader import load_model


@pytest.fixture(scope="module")
def loaded(model_path):
    return load_model(model_path)


def test_q4_codes_reproduce_gguf_dequantization(loaded, model_path):
    reader = gguf.GGUFReader(model_path)
    raw = {t.name: t for t in reader.tensors}
    for hf_name, gguf_name in [("model.layers.0.mlp.gate_proj.weight", "blk.0.ffn_gate.weight"),
                               ("model.layers.3.self_attn.v_proj.weight", "blk.3.attn_v.weight")]:
        t = raw[gguf_name]
        ref = gguf.quants.dequantize(t.data, t.tensor_type)
        assert np.array_equal(loaded.quantized[hf_name].dequantize().numpy(), ref)
    # Q and K rows were un-permuted for rotate-half RoPE; the codes must follow the same order.
    q = loaded.quantized["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(q.dequantize(), loaded.weights["model.layers.0.self_attn.q_proj.weight"])


def test_int4_model_agrees_with_dequantized_bf16(loaded):
    def build(quantized):
        m = LlamaForCausalLM(loaded.config, torch.bfloat16)
        m.load_weights(loaded.weights, quantized)
        m.use_backend(CpuKernelOps())
        return m.eval()

    int4, bf16 = build(loaded.quantized), build(None)
    assert int4.layers[0].mlp.gate_up_proj.kernel.format == Q4
    assert int4.lm_head.kernel.format == Q8  # the tied Q8_0 embedding's codes
    assert bf16.layers[0].mlp.gate_up_proj.kernel.format == BF16
    from specserve.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(loaded.path, loaded.gguf_reader)
    ids = tok.encode("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg")
    a, b = prefill_logits(int4, ids), prefill_logits(bf16, ids)
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    assert agree >= 0.85, f"top-1 agreement {agree}"
    corr = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()
    assert corr > 0.99, corr
    # Each decoder layer as one native call gives the bits of the layer op by op (models/native_layer.py).
    prompts = [ids, ids[:7], tok.encode("Hello, world! How are you today?")]
    assert layer_path_mismatches(int4, prompts) == layer_path_mismatches(bf16, prompts) == []
