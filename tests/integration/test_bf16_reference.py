"""The default path (bf16 on specserve's CPU kernels) against an independent reference: the fp32
model on stock torch ops, teacher-forced over real chat text (ShareGPT exchanges, 320 tokens
each). Measured on AMD EPYC (avx512_bf16 kernels): top-1 agreement 0.9875-0.9937 per sequence,
largest logit difference 1.47-1.70 (logits reach about 40). The bounds below leave a margin for
other kernel paths and CPUs, and the mutation tests show planted wiring bugs land far outside
them (measured: RoPE turned the wrong way 0.22 agreement and 41.6; the last layer's MLP dropped
0.64 and 48.8; a skipped residual 0.02 and 55.6)."""

from __future__ import annotations

import pytest
import torch
from helpers import prefill_logits

import specserve.models.backend as backend
from specserve import Engine
from specserve.datasets import sharegpt_exchanges

MIN_TOP1 = 0.97  # per sequence
MAX_LOGIT_DIFF = 3.0
TOKENS = 320


@pytest.fixture(scope="module")
def bf16_engine():
    with Engine(dtype="bfloat16", cpu_activations="bf16", max_total_tokens=4096, speculative_algorithm="NONE") as engine:
        yield engine


@pytest.fixture(scope="module")
def sequences(fp32_engine):
    """Teacher-forced token ids and their fp32 reference logits."""
    out = []
    for human, answer in sharegpt_exchanges(3):
        ids = fp32_engine.tokenizer.apply_chat_template([{"role": "user", "content": human},
                                                         {"role": "assistant", "content": answer}])[:TOKENS]
        with torch.no_grad():
            out.append((ids, prefill_logits(fp32_engine.runner.model, ids).float()))
    return out


def agreement(bf16_engine, sequences) -> list[tuple[float, float]]:
    """(top-1 agreement, largest |logit difference|) of each sequence."""
    found = []
    for ids, reference in sequences:
        with torch.no_grad():
            logits = prefill_logits(bf16_engine.runner.model, ids).float()
        found.append(((logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
                      (logits - reference).abs().max().item()))
    return found


def within_bounds(found: list[tuple[float, float]]) -> bool:
    return all(top1 >= MIN_TOP1 and diff <= MAX_LOGIT_DIFF for top1, diff in found)


def test_bf16_kernels_agree_with_the_fp32_stock_reference(bf16_engine, sequences):
    assert sum(len(ids) for ids, _ in sequences) >= 600
    found = agreement(bf16_engine, sequences)
    assert within_bounds(found), found


def _reversed_rope(monkeypatch, engine):
    original = backend.rope_store
    monkeypatch.setattr(backend, "rope_store", lambda qkv, cos, sin, *rest: original(qkv, cos, -sin, *rest))


def _dropped_last_mlp(monkeypatch, engine):
    layer = engine.runner.model.layers[-1]
    forward = layer.forward
    monkeypatch.setattr(layer, "forward", lambda *args: torch.zeros_like(forward(*args)))


def _skipped_residual(monkeypatch, engine):
    """The residual stream restarts at the middle layer: everything before it reaches the layer
    only through that layer's input."""
    layer = engine.runner.model.layers[len(engine.runner.model.layers) // 2]
    forward = layer.forward
    monkeypatch.setattr(layer, "forward", lambda out, residual, *rest: forward(None, residual.copy_(out), *rest))


@pytest.mark.parametrize("plant", [_reversed_rope, _dropped_last_mlp, _skipped_residual],
                         ids=["rope-turned-the-wrong-way", "last-mlp-dropped", "middle-residual-skipped"])
def test_a_planted_wiring_bug_falls_outside_the_bounds(bf16_engine, sequences, monkeypatch, plant):
    monkeypatch.setattr(bf16_engine.runner.model, "native", None)  # planted in the per-op layers (the native ones equal them)
    plant(monkeypatch, bf16_engine)
    found = agreement(bf16_engine, sequences)
    assert not within_bounds(found), f"the planted bug stayed within the bounds: {found}"
