"""bench/synth_payload.py's random blocks are zero-mean like trained weights, per (sub-)block and not
only on average: a shared mean puts every hidden state on one direction and a mixture's router
then picks the same experts for every token. Planted, the old draw (a K-quant's dmin in d's
positive range, its min codes random; Q4_0's d always positive) and a dmin right only on average
fail the checks."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import Q4_K

import specserve.bench.synth_payload as sm
from specserve.models.gguf_file import TensorInfo

BLOCK_TYPES = [*sm.BLOCK_SCALES, *sm.E8M0_SCALES]


def weights(qtype: Q, rows: int = 16) -> np.ndarray:
    """A random [4096 x rows] tensor of `qtype` as the writer draws it, dequantized by gguf-py."""
    raw = b"".join(sm.random_blocks(TensorInfo("blk.0.w.weight", (4096, rows), qtype, 0), np.random.default_rng(0)))
    return gguf.quants.dequantize(np.frombuffer(raw, dtype=np.uint8), qtype).ravel()


def mean_faults(w: np.ndarray) -> list[str]:
    """What is off zero-mean: the tensor's mean, or its 32-weight pieces' means (a (sub-)block's
    offset; zero-mean pieces give about 0.8 / sqrt(32) = 0.14 of the spread)."""
    std, faults = w.std(), []
    if abs(w.mean()) >= 0.05 * std:
        faults.append(f"mean {w.mean():+.4f} against a spread of {std:.4f}")
    piece = np.abs(w.reshape(-1, 32).mean(axis=1)).mean()
    if piece >= 0.25 * std:
        faults.append(f"32-weight pieces' |mean| {piece:.4f} against a spread of {std:.4f}")
    return faults


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_every_block_type_is_zero_mean_at_a_few_hundredths(qtype):
    w = weights(qtype)
    assert np.isfinite(w).all() and 0.01 < w.std() < 0.1, (qtype.name, w.std())
    assert mean_faults(w) == [], qtype.name


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K], ids=lambda t: t.name)
def test_k_quant_min_codes_copy_the_scale_codes(qtype):
    """Each sub-block is d sc (q - mean(q)): m_j == sc_j and dmin = mean(q) d (to float16)."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = np.frombuffer(b"".join(sm.random_blocks(TensorInfo("w", (256, 64), qtype, 0), np.random.default_rng(0))),
                        dtype=np.uint8).reshape(-1, size)  # fmt: skip
    sc, m = Q4_K.get_scale_min(raw[:, 4:16].copy())
    assert np.array_equal(sc, m) and sc.max() > 32
    d, dmin = (raw[:, at : at + 2].copy().view(np.float16).astype(np.float32)[:, 0] for at in (0, 2))
    assert np.allclose(dmin, sm.CODE_MEAN[qtype] * d, rtol=1e-3)


def old_offsets(raw: np.ndarray, qtype: Q, d: np.ndarray) -> None:
    """The draw before zero-mean payloads: a K-quant's dmin in d's positive range with its min codes
    random, Q4_1 and Q5_1's m = -8 d."""
    offsets, lo, hi = sm.BLOCK_SCALES[qtype]
    if qtype in (Q.Q4_1, Q.Q5_1):
        sm._put_f16(raw, offsets[1], -8 * d.astype(np.float32))
    elif len(offsets) > 1:
        sm._put_f16(raw, offsets[1], np.random.default_rng(0).uniform(lo, hi, size=raw.shape[0]))


def offsets_right_on_average(raw: np.ndarray, qtype: Q, d: np.ndarray) -> None:
    """dmin = mean(q) d with the min codes left random: zero-mean over the tensor, not per sub-block."""
    offsets = sm.BLOCK_SCALES[qtype][0]
    if qtype in sm.CODE_MEAN:
        sign = -1.0 if qtype in (Q.Q4_1, Q.Q5_1) else 1.0
        sm._put_f16(raw, offsets[1], sign * sm.CODE_MEAN[qtype] * d.astype(np.float32))


def test_planted_old_draw_and_a_mean_right_only_on_average_fail(monkeypatch):
    monkeypatch.setattr(sm, "_zero_mean", old_offsets)
    monkeypatch.setattr(sm, "SIGNED_D", set())  # Q4_0's d always positive: every block at -d/2
    for qtype in (Q.Q2_K, Q.Q4_K, Q.Q5_K, Q.Q4_0, Q.Q4_1, Q.Q5_1):
        assert any(f.startswith("mean") for f in mean_faults(weights(qtype))), qtype.name
    monkeypatch.setattr(sm, "_zero_mean", offsets_right_on_average)
    for qtype in (Q.Q2_K, Q.Q4_K, Q.Q5_K):
        faults = mean_faults(weights(qtype))
        assert len(faults) == 1 and faults[0].startswith("32-weight"), (qtype.name, faults)
