"""The native decoder layer's argument checks (kernels/csrc/decoder_layer.cpp): a pass's rows and a
layer's inputs that do not fit are clear errors before any kernel runs (the bitwise equality with
the per-op layers is tested on real and tiny models: tests/integration/test_gguf_architectures.py)."""

from __future__ import annotations

import pytest
import torch

from specserve.kernels.build import load
from specserve.kernels.dispatch import path_id
from specserve.kernels.linear import pack_bf16
from specserve.models.native_layer import native_linear

HIDDEN, HEADS, KV_HEADS, DIM, FFN, SLOTS = 64, 2, 1, 32, 96, 9


def _linear(n: int, k: int):
    return native_linear(pack_bf16(torch.randn(n, k) * 0.05))


def _layer(norms=None):
    ones = torch.ones(HIDDEN, dtype=torch.bfloat16)
    return load().DecoderLayer(
        _linear((HEADS + 2 * KV_HEADS) * DIM, HIDDEN), None, _linear(HIDDEN, HEADS * DIM), _linear(2 * FFN, HIDDEN),
        _linear(HIDDEN, FFN), None, norms if norms is not None else [ones, ones, None, None, None, None],
        HEADS, KV_HEADS, DIM, DIM**-0.5, 0, False, 1e-6,
    )  # fmt: skip


def _step(positions=(0, 1), slots=(1, 2), lens=(1, 2), pool_slots=SLOTS):
    table = torch.arange(1, 5).view(1, 4)
    requests = torch.zeros(len(positions), dtype=torch.int64)
    return load().LayerStep(torch.tensor(positions), torch.tensor(slots), table, requests, torch.tensor(lens), pool_slots,
                            path_id())


def _run(layer, step, rows=2, pool_slots=SLOTS, table_len=16):
    residual = torch.randn(rows, HIDDEN).bfloat16()
    pools = [torch.zeros(pool_slots, KV_HEADS, DIM, dtype=torch.bfloat16) for _ in range(2)]
    cos, sin = torch.ones(table_len, DIM // 2), torch.zeros(table_len, DIM // 2)
    return layer.forward(None, residual, step, *pools, cos, sin)


def test_a_fitting_pass_runs_and_writes_its_rows_k_v():
    out = _run(_layer(), _step())
    assert out.shape == (2, HIDDEN) and torch.isfinite(out.float()).all()


@pytest.mark.parametrize("step_args, message", [
    (dict(slots=(1, SLOTS)), "slot 9 is outside the K/V pool"),
    (dict(positions=(0, -1)), "position -1 is negative"),
    (dict(lens=(1, 5)), "row 1 sees 5 positions"),
    (dict(slots=(1,)), "one position, slot, request and length per row"),
])
def test_rows_that_do_not_fit_are_clear_errors(step_args, message):
    with pytest.raises(RuntimeError, match=message):
        _step(**step_args)


def test_inputs_that_do_not_fit_the_layer_are_clear_errors():
    layer, step = _layer(), _step()
    with pytest.raises(RuntimeError, match="K/V pools must be contiguous bf16"):
        _run(layer, step, pool_slots=SLOTS + 1)
    with pytest.raises(RuntimeError, match="out and residual must be contiguous bf16"):
        _run(layer, step, rows=3)
    with pytest.raises(RuntimeError, match="outside the RoPE table"):
        _run(layer, step, table_len=1)
    with pytest.raises(RuntimeError, match="the attention's shapes do not chain"):
        load().DecoderLayer(_linear(HIDDEN, HIDDEN), None, _linear(HIDDEN, HEADS * DIM), _linear(2 * FFN, HIDDEN),
                            _linear(HIDDEN, FFN), None, [torch.ones(HIDDEN, dtype=torch.bfloat16)] * 2 + [None] * 4,
                            HEADS, KV_HEADS, DIM, 1.0, 0, False, 1e-6)
    with pytest.raises(RuntimeError, match="norms are input, post-attention"):
        _layer(norms=[torch.ones(HIDDEN, dtype=torch.bfloat16)] * 3 + [None] * 3)
