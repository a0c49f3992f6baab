"""GGUF quantized weights kept as their exact codes and scales, in the two layouts of the CPU
kernels (specserve/kernels/linear.py):

- Unsigned 4-, 5- or 6-bit codes q with a scale and an offset per 32 (or 16) weights, w = d*q + m:
  Q4_0 (m = -8d), Q4_1, Q4_K (d = super-block scale x 6-bit sub-scale, m = -(super-block min x
  6-bit sub-min)); Q5_0 (m = -16d), Q5_1, Q5_K; Q6_K (d = scale x 8-bit sub-scale per 16 weights,
  m = -32d).
- 4-bit indices into the E2M1 table with a power-of-two scale per 32 weights: MXFP4 (gpt-oss's
  experts), w = d * (E2M1_CODES[c] - 12), in the Q4 layout with `bits` = E2M1.
- Signed 8-bit codes with a scale per 32 weights: Q8_0 (and, with offsets, any of the above fused
  with a Q8_0 neighbour, e.g. q and k in Q5_0 with v in Q8_0).

Every scale and offset is an exact float32 value and every dequantized weight equals the `gguf`
package's (tests/unit/test_quant_formats.py). K-quants also keep their float16 super-block values
(`supers`), so the kernels store each scale and offset as the file does, an int8 multiple of one
(kernels/linear.py _group_tables). Other GGUF types (Q2_K, Q3_K, IQ*) are dequantized at load and
computed in bf16.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from specserve.errors import ConfigError
from specserve.kernels.build import load
from specserve.kernels.linear import E2M1, E2M1_CODES, E2M1_OFFSET, SUPER, PackedLinear, Supers, pack_q4, pack_q8

GROUP = 32
_BLOCK_BYTES = {
    "Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "MXFP4": 17,
}  # fmt: skip


def _split_cols(start: int, count: int, group: int) -> tuple[int, int]:
    if start % GROUP or count % GROUP:
        raise ConfigError(f"tp_size: a quantized weight can only be split at multiples of {GROUP} input columns")
    return start // group, count // group


def _groups(t: torch.Tensor, group: int) -> torch.Tensor:
    """Per-group values [out, in / group] spread over their columns, in float64."""
    return t.double().repeat_interleave(group, dim=1)


@dataclass
class Q4Weight:
    """Unsigned codes [out, in] (uint8, `bits` = 4, 5 or 6 bits), per-group scale and offset
    [out, in / group] (float32): w = scale * q + offset, in groups of 32 or 16 input columns. With
    `bits` = E2M1 q is E2M1_CODES[code] (MXFP4: 4-bit codes, offset -12 * scale)."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    group: int = GROUP
    bits: int = 4
    # K-quants: the float16 super-block values [out, in / 256] that scale and offset are integer
    # multiples of (the kernels then store the multiples in a byte, kernels/linear.py _group_tables)
    supers: Optional[Supers] = None

    def rows(self, index) -> "Q4Weight":
        supers = None if self.supers is None else _super_rows(self.supers, index)
        return Q4Weight(self.codes[index], self.scale[index], self.offset[index], self.group, self.bits, supers)

    def cols(self, start: int, count: int) -> "Q4Weight":
        g0, gn = _split_cols(start, count, self.group)
        cut = slice(g0, g0 + gn)
        supers = None
        end = start + count  # whole super-blocks, or up to the end (where the last may be partial)
        if self.supers is not None and start % SUPER == 0 and (count % SUPER == 0 or end == self.codes.shape[1]):
            supers = _super_rows(self.supers, (slice(None), slice(start // SUPER, -(-end // SUPER))))  # else float32 tables
        codes = self.codes[:, start : start + count]
        return Q4Weight(codes, self.scale[:, cut], self.offset[:, cut], self.group, self.bits, supers)

    def values(self) -> torch.Tensor:
        """The q of w = scale * q + offset (uint8): the codes, or E2M1 codes' table values."""
        return E2M1_CODES[self.codes.long()] if self.bits == E2M1 else self.codes

    def dequantize(self) -> torch.Tensor:
        """float32 weights, each rounded once from the exact value (as the gguf package's are)."""
        return (self.values().double() * _groups(self.scale, self.group) + _groups(self.offset, self.group)).float()

    def packed(self) -> PackedLinear:
        return pack_q4(self.codes, self.scale, self.offset, self.group, self.bits, self.supers)

    def as_q8(self) -> "Q8Weight":
        """The same weights in the 8-bit layout (to fuse with 8-bit neighbours); E2M1 codes become
        their signed values (table - 12), with no offset."""
        if self.bits == E2M1:
            return Q8Weight(self.values().to(torch.int8) - E2M1_OFFSET, self.scale, None, self.group)
        return Q8Weight(self.codes.to(torch.int8), self.scale, self.offset, self.group)

    def regrouped(self, group: int, bits: int) -> "Q4Weight":
        """The same weights with a scale per `group` columns (a divisor of this one's) and wider codes."""
        rep = self.group // group
        scale, offset = (t.repeat_interleave(rep, dim=1) for t in (self.scale, self.offset))
        return Q4Weight(self.codes, scale, offset, group, max(bits, self.bits), self.supers)


@dataclass
class Q8Weight:
    """8-bit codes [out, in] (int8), per-group scale and optional offset [out, in / group] (float32):
    w = scale * q (+ offset), in groups of 32 or 16 input columns."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: Optional[torch.Tensor] = None
    group: int = GROUP

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> "Q8Weight":
        """ggml's Q8_0 of a float weight [out, in] (in a multiple of 32), bit for bit: per 32 columns
        d = amax / 127 and q = w / d rounded half away from zero, both in float32; d stored as a
        float16 (so the weights are float16(d) * q)."""
        w = weight.detach().float()
        if w.dim() != 2 or w.shape[1] % GROUP:
            raise ConfigError(f"Q8_0 needs a 2-D weight with a multiple of {GROUP} columns, got {tuple(w.shape)}")
        blocks = w.view(w.shape[0], -1, GROUP)
        d = blocks.abs().amax(-1, keepdim=True) / 127
        scaled = blocks * torch.where(d == 0, torch.zeros_like(d), 1 / d)
        whole = scaled.abs().floor()
        codes = scaled.sign() * (whole + (2 * (scaled.abs() - whole)).floor())
        return cls(codes.to(torch.int8).view_as(w), d.squeeze(-1).half().float())

    def rows(self, index) -> "Q8Weight":
        offset = None if self.offset is None else self.offset[index]
        return Q8Weight(self.codes[index], self.scale[index], offset, self.group)

    def cols(self, start: int, count: int) -> "Q8Weight":
        g0, gn = _split_cols(start, count, self.group)
        offset = None if self.offset is None else self.offset[:, g0 : g0 + gn]
        return Q8Weight(self.codes[:, start : start + count], self.scale[:, g0 : g0 + gn], offset, self.group)

    def dequantize(self) -> torch.Tensor:
        """float32 weights, each rounded once from the exact value (as the gguf package's are)."""
        w = self.codes.double() * _groups(self.scale, self.group)
        return (w if self.offset is None else w + _groups(self.offset, self.group)).float()

    def packed(self) -> PackedLinear:
        return pack_q8(self.codes, self.scale, self.offset, self.group)

    def regrouped(self, group: int) -> "Q8Weight":
        """The same weights with a scale (and offset) per `group` columns, a divisor of this one's."""
        if group == self.group:
            return self
        rep = self.group // group
        offset = None if self.offset is None else self.offset.repeat_interleave(rep, dim=1)
        return Q8Weight(self.codes, self.scale.repeat_interleave(rep, dim=1), offset, group)

    def with_offset(self) -> "Q8Weight":
        return (
            self if self.offset is not None else Q8Weight(self.codes, self.scale, torch.zeros_like(self.scale), self.group)
        )


QuantWeight = Q4Weight | Q8Weight
# A weight's codes read on demand (models/loader.py GGUFCodes): a layer reads them only to pack them.
QuantSource = Callable[[], QuantWeight]


def concat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Fused parts (e.g. q, k, v) stacked by rows in one layout: all 4-bit stay 4-bit; otherwise
    all become 8-bit, in the finest group, with offsets if any part has them."""
    q4 = [p for p in parts if isinstance(p, Q4Weight)]
    if len(q4) == len(parts) and len({p.bits == E2M1 for p in q4}) == 1:  # E2M1 codes fuse only with their own
        group, bits = min(p.group for p in q4), max(p.bits for p in q4)
        q4 = [p.regrouped(group, bits) for p in q4]
        codes, scale, offset = (torch.cat([getattr(p, f) for p in q4]) for f in ("codes", "scale", "offset"))
        return Q4Weight(codes, scale, offset, group, bits, _concat_supers([p.supers for p in q4]))
    q8 = [p.as_q8() if isinstance(p, Q4Weight) else p for p in parts]
    group = min(p.group for p in q8)
    q8 = [p.regrouped(group) for p in q8]
    if any(p.offset is not None for p in q8):
        q8 = [p.with_offset() for p in q8]
    offsets = [p.offset for p in q8 if p.offset is not None]
    return Q8Weight(
        torch.cat([p.codes for p in q8]), torch.cat([p.scale for p in q8]), torch.cat(offsets) if offsets else None, group
    )


def _super_rows(supers: Supers, index) -> Supers:
    return supers[0][index], None if supers[1] is None else supers[1][index]


def _concat_supers(parts: list[Optional[Supers]]) -> Optional[Supers]:
    """The stacked parts' super-values, if every part has them (else the tables stay float32)."""
    if any(p is None or (p[1] is None) != (parts[0][1] is None) for p in parts):  # type: ignore[index]
        return None
    scale = torch.cat([p[0] for p in parts])  # type: ignore[index]
    return scale, None if parts[0][1] is None else torch.cat([p[1] for p in parts])  # type: ignore[index,misc]


def is_quantized(type_name: str) -> bool:
    """Whether a GGUF tensor type is kept as codes (else it is dequantized at load)."""
    return type_name in _BLOCK_BYTES


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of every block, as float32 [rows, blocks]."""
    return blocks[:, :, at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., 16 bytes] -> [..., 32] codes: low nibbles are elements 0..15, high ones 16..31."""
    out = np.empty((*packed.shape[:-1], 32), dtype=np.uint8)  # written in place: one pass each
    np.bitwise_and(packed, 0x0F, out=out[..., :16])
    np.right_shift(packed, 4, out=out[..., 16:])
    return out


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 high bits: [rows, blocks, 4 bytes] -> [rows, blocks, 32] (bit j of the
    little-endian word)."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")


def _tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def _parse_legacy(blocks: np.ndarray, type_name: str) -> QuantWeight:
    out = blocks.shape[0]
    d = _f16(blocks, 0)
    if type_name == "Q8_0":
        return Q8Weight(_tensor(blocks[:, :, 2:].copy().view(np.int8).reshape(out, -1)), _tensor(d))
    if type_name in ("Q5_0", "Q5_1"):
        start = 2 if type_name == "Q5_0" else 4
        q = _nibbles(blocks[:, :, start + 4 :]) | (_fifth_bits(blocks[:, :, start : start + 4]) << 4)
        offset = -16 * d if type_name == "Q5_0" else _f16(blocks, 2)
        return Q4Weight(_tensor(q.reshape(out, -1)), _tensor(d), _tensor(offset), GROUP, 5)
    if type_name == "Q4_1":
        packed, offset = blocks[:, :, 4:], _f16(blocks, 2)
    else:
        packed, offset = blocks[:, :, 2:], -8 * d
    codes = _nibbles(packed).reshape(out, -1)
    return Q4Weight(_tensor(codes.astype(np.uint8)), _tensor(d), _tensor(offset))


def _k_scales(blocks: np.ndarray, scale_min: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray, Supers]:
    """Q4_K/Q5_K per-32 scale d*sc and offset -(dmin*m), float32 [rows, super-blocks * 8], and
    their super-values d and -dmin [rows, super-blocks]; scale_min: the 6-bit (sc, m) [rows, super-blocks * 8]."""
    out, n = blocks.shape[:2]
    sc, mn = scale_min
    d, dmin = _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]
    scale = d * sc.reshape(out, n, 8).astype(np.float32)
    offset = -(dmin * mn.reshape(out, n, 8).astype(np.float32))
    return scale.reshape(out, -1), offset.reshape(out, -1), (_tensor(d[..., 0]), _tensor(-dmin[..., 0]))


def k_scale_min(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 6-bit sub-block scales and mins, uint8 [rows, super-blocks * 8] each, from the
    raw blocks [rows, bytes] (csrc/pack.cpp: one pass; k_scale_min_reference is the definition)."""
    both = load().gguf_k_scale_min(_raw_tensor(raw), type_name).numpy()
    return both[0], both[1]


def k_scale_min_reference(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray]:
    """k_scale_min through the `gguf` package's own unpacking."""
    import gguf

    blocks = raw.reshape(-1, _BLOCK_BYTES[type_name])
    sc, mn = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    return sc.reshape(raw.shape[0], -1).astype(np.uint8), mn.reshape(raw.shape[0], -1).astype(np.uint8)


def k_codes(raw: np.ndarray, type_name: str) -> torch.Tensor:
    """A K-quant tensor's codes, uint8 [rows, k] in column order, from its raw blocks [rows, bytes]
    (csrc/pack.cpp: one pass; k_codes_reference is the definition)."""
    return load().gguf_k_codes(_raw_tensor(raw), type_name)


def _low_nibble_rows(qs: np.ndarray) -> np.ndarray:
    """K-quant 4-bit codes: [rows, super-blocks, 128] -> [rows, super-blocks, 8, 32]; each 32
    bytes give the low nibbles (sub-block 2j) and then the high ones (sub-block 2j + 1)."""
    chunks = qs.reshape(*qs.shape[:2], 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    return (chunks & 0x0F).reshape(*qs.shape[:2], 8, 32)


def k_codes_reference(raw: np.ndarray, type_name: str) -> torch.Tensor:
    """k_codes in numpy, after llama.cpp's dequantize_row_q{4,5,6}_K."""
    out = raw.shape[0]
    blocks = raw.reshape(out, -1, _BLOCK_BYTES[type_name])
    n = blocks.shape[1]
    if type_name == "Q6_K":
        ql = blocks[:, :, :128].reshape(out, n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        qh = blocks[:, :, 128:192].reshape(out, n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
        q = (ql & 0x0F).reshape(out, n, 8, 32) | ((qh & 0x03).reshape(out, n, 8, 32) << 4)
    elif type_name == "Q4_K":
        q = _low_nibble_rows(blocks[:, :, 16:])
    else:
        qh = blocks[:, :, 16:48].reshape(out, n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
        q = _low_nibble_rows(blocks[:, :, 48:]) | ((qh & 1) << 4)
    return _tensor(q.reshape(out, -1))


def _raw_tensor(raw: np.ndarray) -> torch.Tensor:
    """raw [rows, bytes] as a uint8 tensor without a copy where it is contiguous. The file is mapped
    read-only and the native code only reads it: torch's warning about a read-only array is moot."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(raw))


def _parse_k(raw: np.ndarray, type_name: str) -> QuantWeight:
    out = raw.shape[0]
    blocks = raw.reshape(out, -1, _BLOCK_BYTES[type_name])
    codes = k_codes(raw, type_name)
    if type_name == "Q6_K":
        sub = blocks[:, :, 192:208].copy().view(np.int8).astype(np.float32)  # [rows, n, 16]
        d = _f16(blocks, 208)
        scale = (d[..., None] * sub).reshape(out, -1)
        q6_supers: Supers = (_tensor(d), _tensor(-32 * d))
        return Q4Weight(codes, _tensor(scale), _tensor(-32 * scale), 16, 6, q6_supers)
    scale, offset, supers = _k_scales(blocks, k_scale_min(raw, type_name))
    bits = 4 if type_name == "Q4_K" else 5
    return Q4Weight(codes, _tensor(scale), _tensor(offset), GROUP, bits, supers)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """MXFP4's block scales: 2^(e - 128) for the E8M0 byte e (ggml's e8m0_to_fp32_half: the table
    holds doubled E2M1 values), float32 (exact; 2^-128 and 2^-127 as subnormals)."""
    bits = np.where(e < 2, np.uint32(0x00200000) << e.astype(np.uint32), (e.astype(np.uint32) - 1) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def mxfp4_codes(raw: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    """MXFP4's codes uint8 [rows, k] and which blocks of 32 hold only zeros (+0 or -0), bool
    [rows, k / 32], from the raw blocks [rows, bytes] (csrc/pack.cpp: one pass;
    mxfp4_codes_reference is the definition)."""
    codes, zero = load().gguf_mxfp4_codes(_raw_tensor(raw))
    return codes, zero.numpy().astype(bool)


def mxfp4_codes_reference(raw: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    """mxfp4_codes in numpy."""
    out = raw.shape[0]
    codes = _nibbles(raw.reshape(out, -1, _BLOCK_BYTES["MXFP4"])[:, :, 1:]).reshape(out, -1)
    return _tensor(codes), ((codes & 7) == 0).reshape(out, -1, GROUP).all(axis=-1)


def _parse_mxfp4(blocks: np.ndarray) -> Q4Weight:
    """MXFP4 [rows, blocks, 17]: a scale byte, then 16 bytes of codes (low nibbles are elements
    0..15, high ones 16..31). A block whose codes all read 0 (E2M1 +0 and -0) may carry any scale:
    it is given its super-block's, so the tables stay one byte per group (kernels/linear.py
    _group_tables) where a real file's scales span less than 2^6 per 256 columns (the last 256 may
    be partial: gpt-oss's rows are 2880 long)."""
    out = blocks.shape[0]
    codes, zero = mxfp4_codes(blocks.reshape(out, -1))
    scale = e8m0_half(blocks[:, :, 0])  # [rows, blocks]
    per, groups = SUPER // GROUP, scale.shape[1]
    grid = np.pad(np.where(zero, np.inf, scale), ((0, 0), (0, -groups % per)), constant_values=np.inf)
    top = grid.reshape(out, -1, per).min(axis=-1)  # the smallest scale per 256 columns: the others are 2^j times it
    top = np.where(np.isinf(top), np.float32(1.0), top).astype(np.float32)
    scale = np.where(zero, np.repeat(top, per, axis=1)[:, :groups], scale).astype(np.float32)
    t_scale = _tensor(scale)
    return Q4Weight(codes, t_scale, -E2M1_OFFSET * t_scale, GROUP, E2M1, (_tensor(top), None))


def parse_quantized(raw: np.ndarray, type_name: str) -> QuantWeight:
    """Split GGUF blocks (raw uint8 [out, blocks * block_bytes]) into codes and scales."""
    raw = np.asarray(raw)
    if type_name.endswith("_K"):
        return _parse_k(raw, type_name)
    if type_name == "MXFP4":
        return _parse_mxfp4(raw.reshape(raw.shape[0], -1, _BLOCK_BYTES[type_name]))
    return _parse_legacy(raw.reshape(raw.shape[0], -1, _BLOCK_BYTES[type_name]), type_name)
