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


@pytest.fixture
def weights_read(monkeypatch) -> list[str]:
    """The names read from any lazily loaded file's weights (loader.LazyWeights) from now on
    (the session shares each file's parse, so what an earlier test read stays materialized)."""
    from specserve.models import loader

    read: list[str] = []
    original = loader.LazyWeights.__getitem__

    def spy(self, name):
        read.append(name)
        return original(self, name)

    monkeypatch.setattr(loader.LazyWeights, "__getitem__", spy)
    return read


def test_packed_load_reads_no_dense_copy_of_what_it_packs(loaded, weights_read):
    """On the CPU kernels the linears and the tied embedding compute from the file's codes, so
    loading them never dequantizes those weights (loader.LazyWeights), holds no dense copy, and
    gives the logits of a model that also loaded the dense weights, bit for bit."""

    def build(dense: bool) -> LlamaForCausalLM:
        m = LlamaForCausalLM(loaded.config, torch.bfloat16)
        m.load_weights(loaded.weights, loaded.quantized, dense_quantized=dense)
        m.use_backend(CpuKernelOps())
        return m.eval()

    packed = build(dense=False)
    assert set(weights_read) & set(loaded.quantized) == set()
    assert {"model.norm.weight", "model.layers.0.input_layernorm.weight"} <= set(weights_read)
    assert packed.layers[0].mlp.gate_up_proj.weight.numel() == 0 and packed.embed_tokens.weight.numel() == 0
    dense = build(dense=True)
    assert "model.layers.0.mlp.gate_proj.weight" in weights_read  # the control reads them
    ids = list(range(20, 60))
    assert torch.equal(prefill_logits(packed, ids), prefill_logits(dense, ids))


def test_engine_on_cpu_kernels_dequantizes_no_packed_weight(weights_read):
    """What `specserve serve` loads (bf16 on the CPU kernels, the default drafter attached) reads
    no quantized weight of the file densely: the start-up does not dequantize what it packs."""
    from specserve.engine import Engine

    engine = Engine(dtype="bfloat16", max_total_tokens=512)
    try:
        head = engine.runner.model.lm_head.kernel
        assert head is not None and head.format == Q8  # packed from the tied Q8_0 embedding's codes
        assert weights_read and not [n for n in weights_read if n.endswith(("proj.weight", "embed_tokens.weight"))]
    finally:
        engine.shutdown()
