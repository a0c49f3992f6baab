"""The payload of a synthetic GGUF file (bench/synth_model.py): random codes with scales drawn in a
trained range, zero-mean per (sub-)block as trained weights are (`_zero_mean`), for speed work only.

With a shared mean every hidden state lies on one direction and a mixture's router sends every
token to the same experts, where a real model's tokens spread."""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from specserve.errors import ConfigError
from specserve.models.gguf_file import TensorInfo

# Byte offsets of each block's float16 scales (d, then the offset m or dmin where there is one, set
# from d: CODE_MEAN) and the range d is drawn in, so that weights come out at a few hundredths (like
# trained ones): no NaN, inf or runaway activations through the layers.
BLOCK_SCALES: dict[QType, tuple[tuple[int, ...], float, float]] = {
    QType.Q4_0: ((0,), 2e-3, 6e-3), QType.Q4_1: ((0, 2), 2e-3, 6e-3), QType.Q5_0: ((0,), 1e-3, 3e-3),
    QType.Q5_1: ((0, 2), 1e-3, 3e-3), QType.Q8_0: ((0,), 2e-4, 6e-4), QType.Q2_K: ((80, 82), 1e-3, 3e-3),
    QType.Q3_K: ((108,), 5e-4, 1.5e-3), QType.Q4_K: ((0, 2), 1e-4, 4e-4), QType.Q5_K: ((0, 2), 5e-5, 2e-4),
    QType.Q6_K: ((208,), 2e-5, 8e-5),
}
# MXFP4: each block's E8M0 scale byte (offset 0) drawn from this range of exponents (2^-10 .. 2^-7
# with the table's doubled values: weights of a few hundredths), the codes random.
E8M0_SCALES = {QType.MXFP4: (0, 118, 122)}
# Zero-mean weights, as trained ones are: a shared positive mean puts every hidden state on one
# direction, and a mixture's router then sends every token to the same experts (Qwen3-30B-A3B's
# top 8 of 128 read 8.0 experts per layer for one row and 8.75 for a 4-row window of random tokens).
# Exact in expectation per (sub-)block where the block has an offset: Q4_1 and Q5_1's m = -mean(q) d,
# and the K-quants' min codes copying their scale codes with dmin = mean(q) d, so that each sub-block
# is d sc (q - mean(q)) (CODE_MEAN: the codes' mean; MIN_CODES: where the packed scale codes are).
# Without one, each (sub-)block is within half a step of zero (its codes' mean is half a code off):
# Q4_0 and Q5_0 (d (q - 8), d (q - 16)) and Q3_K and Q6_K (signed scales) with that half step's sign
# drawn, so zero over the blocks (Q4_0 and Q5_0's d signed, as ggml's quantizer's d = max / -8 is);
# Q8_0 at -d/2 throughout, 0.007 of its spread of 74 d. MXFP4's codes are symmetric: exact.
CODE_MEAN = {QType.Q4_1: 7.5, QType.Q5_1: 15.5, QType.Q2_K: 1.5, QType.Q4_K: 7.5, QType.Q5_K: 15.5}
MIN_CODES = {QType.Q2_K: 0, QType.Q4_K: 4, QType.Q5_K: 4}
SIGNED_D = {QType.Q4_0, QType.Q5_0}
PLAIN = {QType.F32: np.float32, QType.F16: np.float16}
WEIGHT_STD = 0.02
CHUNK_BYTES = 64 << 20  # random payload is drawn in pieces of this size (bounded memory)
PayloadFn = Callable[[TensorInfo], Iterator[bytes]]  # a tensor's bytes, in pieces


def tensor_bytes(info: TensorInfo) -> int:
    """Bytes of a tensor's data in its type."""
    n = int(np.prod(info.dims))
    block, size = GGML_QUANT_SIZES[info.tensor_type]
    return n // block * size


def random_payload(seed: int) -> PayloadFn:
    """A payload function: random codes with drawn scales (BLOCK_SCALES) for block types, normal
    values for plain ones (norm weights around 1, others around 0), in chunks of CHUNK_BYTES."""
    def payload(info: TensorInfo) -> Iterator[bytes]:
        rng = np.random.default_rng([seed, *info.name.encode()])
        if info.tensor_type in PLAIN:
            yield from _plain_values(info, rng)
        else:
            yield from random_blocks(info, rng)
    return payload


def _plain_values(info: TensorInfo, rng: np.random.Generator) -> Iterator[bytes]:
    dtype = PLAIN[info.tensor_type]
    n = int(np.prod(info.dims))
    centre = 1.0 if "norm" in info.name else 0.0
    step = max(1, CHUNK_BYTES // np.dtype(dtype).itemsize)
    for start in range(0, n, step):
        count = min(step, n - start)
        yield (centre + WEIGHT_STD * rng.standard_normal(count, dtype=np.float32)).astype(dtype).tobytes()


def random_blocks(info: TensorInfo, rng: np.random.Generator) -> Iterator[bytes]:
    """Random blocks of a quantized tensor, each block's scales drawn in range (_draw_scales)."""
    if info.tensor_type not in BLOCK_SCALES and info.tensor_type not in E8M0_SCALES:
        raise ConfigError(f"synth-model: no synthetic payload for tensor type {info.tensor_type.name} ({info.name})")
    size = GGML_QUANT_SIZES[info.tensor_type][1]
    blocks = tensor_bytes(info) // size
    step = max(1, CHUNK_BYTES // size)
    for start in range(0, blocks, step):
        raw = rng.integers(0, 256, size=(min(step, blocks - start), size), dtype=np.uint8)
        _draw_scales(raw, info.tensor_type, rng)
        yield raw.tobytes()


def _draw_scales(raw: np.ndarray, qtype: QType, rng: np.random.Generator) -> None:
    """Blocks `raw` [count, bytes] given scales in range, in place: an E8M0 byte (MXFP4) or float16
    values, their offsets and min codes making the weights zero-mean (_zero_mean)."""
    count = raw.shape[0]
    if qtype in E8M0_SCALES:
        at, lo, hi = E8M0_SCALES[qtype]
        raw[:, at] = rng.integers(lo, hi, size=count, dtype=np.uint8)
        return
    offsets, lo, hi = BLOCK_SCALES[qtype]
    d = rng.uniform(lo, hi, size=count).astype(np.float16)
    if qtype in SIGNED_D:
        d = np.where(rng.integers(0, 2, size=count) == 1, -d, d)
    _put_f16(raw, offsets[0], d)
    _zero_mean(raw, qtype, d)


def _zero_mean(raw: np.ndarray, qtype: QType, d: np.ndarray) -> None:
    """Blocks `raw` with scales `d` given the offset that takes their codes' mean off (CODE_MEAN),
    the K-quants' min codes a copy of their scale codes first: each sub-block d sc (q - mean(q))."""
    if qtype in MIN_CODES:
        _copy_min_codes(raw, MIN_CODES[qtype], qtype == QType.Q2_K)
    if qtype in CODE_MEAN:
        sign = -1.0 if qtype in (QType.Q4_1, QType.Q5_1) else 1.0  # w = d q + m there, d sc q - dmin m in the K-quants
        _put_f16(raw, BLOCK_SCALES[qtype][0][1], sign * CODE_MEAN[qtype] * d.astype(np.float32))


def _copy_min_codes(raw: np.ndarray, at: int, nibbles: bool) -> None:
    """Each sub-block's min code set to its scale code, in place: Q2_K's 16 bytes of (min << 4 | scale),
    or the K-quants' 12 bytes of 6-bit codes (ggml's get_scale_min_k4: bytes 0-3 the scales' low 6
    bits and 4-7 the mins', each with 2 high bits of a later one; bytes 8-11 (min << 4 | scale))."""
    if nibbles:
        raw[:, at : at + 16] = (raw[:, at : at + 16] & 0x0F) * np.uint8(0x11)
        return
    raw[:, at + 4 : at + 8] = raw[:, at : at + 4]
    raw[:, at + 8 : at + 12] = (raw[:, at + 8 : at + 12] & 0x0F) * np.uint8(0x11)


def _put_f16(raw: np.ndarray, at: int, values: np.ndarray) -> None:
    raw[:, at : at + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)
