"""Weights packed for the CPU linear kernels, and y = x W^T through them.

Three weight layouts share one kernel family (see csrc/linear.h): unsigned 4-, 5- or 6-bit codes
with a scale and an offset per 32 or 16 columns (GGUF Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K),
signed 8-bit codes with a scale (and optionally an offset) per 32 or 16 columns (Q8_0, and the
others' 8-bit fusions), and plain bf16. Packing keeps the GGUF's codes and scales exactly; only
the layout changes (models/quant.py maps each GGUF type onto a layout). The scale tables take the
file's bytes: float16 values, or for K-quants int8 multiples of float16 super-values per 256
columns; offsets that are -c * scale are not stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.errors import ConfigError
from specserve.kernels.build import load
from specserve.kernels.dispatch import path_id

GROUP = 32
# A Q4 weight's `bits` where its 4-bit codes index the E2M1 table (GGUF MXFP4, csrc/linear.h kE2M1):
# code c is read as E2M1_CODES[c] (the doubled E2M1 value + 12), with code offset 12.
E2M1 = -4
E2M1_OFFSET = 12
E2M1_CODES = torch.tensor([12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0], dtype=torch.uint8)
SUPER = 256  # input columns per super-value of int8 scale tables (a K-quant super-block)
BLOCK = 16  # output columns per packed block
Q4, Q8, BF16 = 0, 1, 2
_Q4_SHIFTS = torch.tensor([0, 16, 4, 20, 8, 24, 12, 28])  # column 2p of an oct at bit 4p, 2p + 1 at 16 + 4p
# The high bits of 5- and 6-bit codes (csrc/linear.h), after each oct's nibble words: per lane a byte
# (bit p: column 2p, bit 4 + p: column 2p + 1) or a uint16 (bits 2p, 2p + 1: column 2p; 8 + 2p,
# 9 + 2p: 2p + 1).
_HIGH_SHIFTS = {5: torch.tensor([0, 4, 1, 5, 2, 6, 3, 7]), 6: torch.tensor([0, 8, 2, 10, 4, 12, 6, 14])}
_HIGH_BYTES = {5: 1, 6: 2}


def block_bytes(fmt: int, k: int, bits: int = 4) -> int:
    """Bytes of one packed block of 16 columns (csrc/linear.cpp block_bytes)."""
    if fmt == Q4:
        return k // 2 * BLOCK + k // 8 * BLOCK * _HIGH_BYTES.get(bits, 0)
    return k * BLOCK if fmt == Q8 else (k + 1) // 2 * 4 * BLOCK


@dataclass
class PackedLinear:
    """One weight [n, k] in a kernel format: codes (uint8 bytes), float16 scales and offsets per group."""

    format: int
    codes: torch.Tensor
    # Per group and column [blocks, k / group, 16]: float16; for K-quants int8 sub-values times the
    # float16 super-values in scale_super [blocks, k / 256, 16]; float32 otherwise (_group_tables).
    scale: torch.Tensor
    # Offsets in the scales' dtype; empty for BF16, for Q8 without offsets and where every offset is
    # -code_offset * scale (the kernels compute them so).
    zero: torch.Tensor
    n: int
    k: int
    # Biased exponent bounds of a BF16 weight's nonzero values, (-1, -1) if it has a subnormal,
    # infinite or NaN value: they tell the AVX2 path when FMAs are exact (csrc/linear_avx2.cpp).
    exponents: tuple[int, int] = (-1, -1)
    group: int = GROUP  # input columns per scale: 32 or 16
    bits: int = 4  # Q4 layout: bits per code (4, 5 or 6), or E2M1
    # c > 0 where every offset is -c * scale (GGUF Q4_0, Q5_0, Q6_K): the integer kernels fold it
    # into their exact sums (csrc/linear_int8.h).
    code_offset: int = 0
    # Activations quantized to int8 per row (blocks of 32) and integer dot products, instead of bf16
    # activations (set by quantize_activations; Q4 and Q8 layouts only).
    int8_activations: bool = False
    scale_super: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.float16))
    zero_super: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.float16))

    def quantize_activations(self, enabled: bool = True) -> bool:
        """Run through the integer-activation kernels from now on where this weight's layout has
        them (quantized codes, K a multiple of 32); returns whether it does."""
        self.int8_activations = enabled and self.format != BF16 and self.k % GROUP == 0
        return self.int8_activations

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """x [..., k] bf16 -> [..., n] in out_dtype (bf16 or float32)."""
        out_bf16 = out_dtype == torch.bfloat16
        if x.dim() == 2 and x.dtype == torch.bfloat16 and x.is_contiguous():  # the common case, kept short
            return self.run(x, out_bf16, path_id())
        flat = x.reshape(-1, self.k).to(torch.bfloat16).contiguous()
        return self.run(flat, out_bf16, path_id()).view(*x.shape[:-1], self.n)

    def continue_sums(self, x: torch.Tensor, init: torch.Tensor) -> torch.Tensor:
        """The float32 sums of an earlier part of K (init [..., n], e.g. the previous rank's shard)
        continued over this weight's K: the same operations, in the same order, as one weight over
        both parts, so a chain of shards gives the unsplit layer's float32 result bit for bit."""
        flat = x.reshape(-1, self.k).to(torch.bfloat16).contiguous()
        out = self._kernel(flat, False, path_id(), init.reshape(-1, self.n).float())
        return out.view(*x.shape[:-1], self.n)

    def run(self, x: torch.Tensor, out_bf16: bool, path: int) -> torch.Tensor:
        """The kernel on a contiguous bf16 [m, k] x through the given path."""
        return self._kernel(x, out_bf16, path, None)

    def _kernel(self, x: torch.Tensor, out_bf16: bool, path: int, init: torch.Tensor | None) -> torch.Tensor:
        weight = (self.format, self.codes, self.scale, self.zero, self.n, self.k, out_bf16, path)
        if self.int8_activations:
            return load().linear_int8(x, *weight, init, self.group, self.bits, *self.table_args())
        return load().linear(x, *weight, *self.exponents, init, self.group, self.bits, *self.table_args())

    def native(self) -> Any:
        """This weight as the native decoder layer holds it (csrc/decoder_layer.cpp NativeLinear):
        the arguments `_kernel` passes, its tensors shared, not copied."""
        return load().NativeLinear(
            self.format, self.codes, self.scale, self.zero, self.n, self.k, *self.exponents, self.group, self.bits,
            *self.table_args(), self.int8_activations,
        )  # fmt: skip

    def table_args(self) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
        """The kernels' code_offset, scale_super and zero_super arguments."""
        return (
            self.code_offset,
            self.scale_super if self.scale_super.numel() else None,
            self.zero_super if self.zero_super.numel() else None,
        )

    def group_values(
        self, offsets: bool = False, block: torch.Tensor | None = None, lane: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The scales (or offsets) as float64, exactly: [blocks, k / group, 16], or [len(block),
        k / group] for the rows at (block, lane) only; offsets not stored are -code_offset * scale;
        a weight without offsets gives an empty tensor."""
        table, super_values = (self.zero, self.zero_super) if offsets else (self.scale, self.scale_super)
        if offsets and not table.numel():
            return -self.code_offset * self.group_values(False, block, lane) if self.code_offset else table.double()
        pick = (lambda t: t) if block is None else (lambda t: t[block, :, lane])
        if table.dtype != torch.int8:
            return pick(table).double()
        values = pick(table)  # a partial last super-block: its super-value covers fewer groups
        tops = pick(super_values).double().repeat_interleave(SUPER // self.group, dim=1)[:, : values.shape[1]]
        return values.double() * tops

    def dense_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` of the weight [len(index), k] as float32, read from the packed layout (an
        embedding lookup in a tied head's codes): the values the kernel multiplies, rounded once to
        float32 (computed in float64), which for GGUF codes are the `gguf` package's dequantized ones."""
        block, lane = index // BLOCK, index % BLOCK
        if self.format == BF16:
            words = self.codes.view(torch.bfloat16).view(-1, (self.k + 1) // 2, BLOCK, 2)
            return words[block, :, lane].reshape(len(index), -1)[:, : self.k].float()
        if self.format == Q8:
            codes = self.codes.view(torch.int8).view(-1, self.k // 2, BLOCK, 2)[block, :, lane].reshape(len(index), -1)
        else:
            codes = self._q4_codes(block, lane)
        w = codes.double() * self.group_values(False, block, lane).repeat_interleave(self.group, dim=1)
        offsets = self.group_values(True, block, lane)
        return (w + offsets.repeat_interleave(self.group, dim=1) if offsets.numel() else w).float()

    def bf16_rows(self, index: torch.Tensor) -> torch.Tensor:
        """dense_rows(index).to(torch.bfloat16) in one kernel call (the same values, bit for bit)."""
        weight = (self.format, self.codes, self.scale, self.zero, self.n, self.k, self.group, self.bits)
        return load().dense_rows_bf16(*weight, *self.table_args(), index.long().contiguous())

    def _q4_codes(self, block: torch.Tensor, lane: torch.Tensor) -> torch.Tensor:
        """Codes [len(block), k] of Q4-layout rows: octs of nibble words [oct, lane], then the high bits."""
        octs, picked = self.k // 8, torch.arange(len(block))
        blocks = self.codes.view(-1, octs, 64 + BLOCK * _HIGH_BYTES.get(self.bits, 0))[block]  # [T, oct, bytes]
        words = blocks[..., :64].contiguous().view(torch.int32)[picked, :, lane]
        codes = (words.unsqueeze(-1).long() >> _Q4_SHIFTS) & 0xF  # [T, oct, 8 columns]
        if self.bits == E2M1:
            codes = E2M1_CODES.long()[codes]
        if self.bits > 4:
            high_bytes = blocks[..., 64:].contiguous().view(len(block), octs, BLOCK, _HIGH_BYTES[self.bits])
            plane = high_bytes[picked, :, lane]
            high = plane[..., 0].long() | (plane[..., -1].long() << 8 if self.bits == 6 else 0)
            codes |= ((high.unsqueeze(-1) >> _HIGH_SHIFTS[self.bits]) & ((1 << (self.bits - 4)) - 1)) << 4
        return codes.reshape(len(block), -1)

    def nbytes(self) -> int:
        tensors = (self.codes, self.scale, self.zero, self.scale_super, self.zero_super)
        return sum(t.numel() * t.element_size() for t in tensors)


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -t.shape[0] % multiple
    return t if extra == 0 else torch.cat([t, t.new_zeros(extra, *t.shape[1:])])


def _scale_dtype(*values: torch.Tensor | None) -> torch.dtype:
    """float16 if every scale and offset is a float16 value (GGUF block scales are), else float32."""
    for v in values:
        if v is None:
            continue
        if not torch.equal(v.to(torch.float32), v):
            raise ConfigError("packing: scales and offsets must be float32 values")
        if not torch.equal(v.half().float(), v.float()):
            return torch.float32
    return torch.float16


def _block_scales(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, G] per-column group values -> [blocks, G, 16] in dtype (which holds them exactly)."""
    v = _pad_rows(values.to(dtype), BLOCK)
    return v.view(-1, BLOCK, v.shape[1]).transpose(1, 2).contiguous()


def _sub_values(values: torch.Tensor, super_values: torch.Tensor, group: int) -> torch.Tensor | None:
    """values [n, k / group] as int8 sub-values of float16 super_values [n, ceil(k / 256)], if every
    value is exactly one times its super-value (as a K-quant's scales are), else None."""
    if not torch.equal(super_values.half().float(), super_values.float()):
        return None
    per, groups = SUPER // group, values.shape[1]
    if super_values.shape != (values.shape[0], -(-groups // per)):
        return None
    top = super_values.float().unsqueeze(-1)  # broadcast over each super-block's groups, not repeated
    v = torch.nn.functional.pad(values.float(), (0, -groups % per)).reshape(*super_values.shape, per)
    sub = v / torch.where(top == 0, 1.0, top)
    sub.masked_fill_(top.expand_as(sub) == 0, 0.0)
    ok = torch.equal(sub.round(), sub) and bool(((sub >= -128) & (sub <= 127)).all()) and torch.equal(sub * top, v)
    return sub.to(torch.int8).reshape(values.shape[0], -1)[:, :groups].contiguous() if ok else None


# The per-group tables of a quantized weight: scale, offset (None: -code_offset * scale or none),
# and the two super-value tables (empty unless the first two are int8).
Supers = tuple[torch.Tensor, torch.Tensor | None]


def _group_tables(
    scale: torch.Tensor, offset: torch.Tensor | None, group: int, supers: Supers | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' tables: int8 sub-values with float16 super-values where the weight's scales
    (and offsets) factor so per 256 columns (K-quants: 1 byte per group and column), else float16
    or float32 values. supers: the super-values [n, k / 256] of scale and offset."""
    empty = torch.empty(0, dtype=torch.float16)
    if supers is not None:
        scale_top, zero_top = supers
        scale_sub = _sub_values(scale, scale_top, group)
        zero_sub = None if offset is None or zero_top is None else _sub_values(offset, zero_top, group)
        if scale_sub is not None and offset is None:
            return _block_scales(scale_sub, torch.int8), empty.to(torch.int8), _block_scales(scale_top, torch.float16), empty
        if scale_sub is not None and zero_sub is not None and zero_top is not None:
            tops = [_block_scales(t, torch.float16) for t in (scale_top, zero_top)]
            return _block_scales(scale_sub, torch.int8), _block_scales(zero_sub, torch.int8), tops[0], tops[1]
    dtype = _scale_dtype(scale, offset)
    zero = torch.empty(0, dtype=dtype) if offset is None else _block_scales(offset, dtype)
    return _block_scales(scale, dtype), zero, empty, empty


def pack_q4(
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    group: int = GROUP,
    bits: int = 4,
    supers: Supers | None = None,
) -> PackedLinear:
    """w = scale * q + offset per group of `group` (32 or 16) columns (codes [n, k] of `bits` (4, 5
    or 6) bits, or E2M1 codes read through their table; scale/offset [n, k/group], float32 tensors;
    supers as for _group_tables)."""
    n, k = codes.shape
    if group not in (16, 32) or k % group:
        raise ConfigError(f"4-bit weights need k divisible by {group}, got {k}")
    width = 4 if bits == E2M1 else bits
    if width not in (4, 5, 6) or (codes.numel() and int(codes.max()) >= 1 << width):
        raise ConfigError(f"packing: codes must be {width}-bit (4, 5 or 6)")
    packed = pack_codes(_pad_rows(codes.to(torch.uint8).contiguous(), BLOCK), width)
    centre = E2M1_OFFSET if bits == E2M1 else 1 << (bits - 1)  # GGUF's symmetric types: w = scale * (q - centre)
    code_offset = centre if torch.equal(offset.float(), -centre * scale.float()) else 0
    if bits == E2M1 and (code_offset != E2M1_OFFSET or group != GROUP):
        raise ConfigError(f"packing: E2M1 codes need groups of {GROUP} and offsets of -{E2M1_OFFSET} times the scale")
    tables = _group_tables(scale, None if code_offset else offset, group, supers)
    return PackedLinear(
        Q4,
        packed,
        tables[0],
        tables[1],
        n,
        k,
        group=group,
        bits=bits,
        code_offset=code_offset,
        scale_super=tables[2],
        zero_super=tables[3],
    )


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes uint8 [16 * blocks, k] (k a multiple of 8) in the Q4 layout, as one uint8 tensor: per
    block of 16 rows and oct of 8 columns, the 16 lanes' nibble words, then their high bits (csrc/
    pack.cpp, one pass; kernels/pack_reference.py is the definition)."""
    return load().pack_q4_codes(codes, bits)


def pack_q8(
    codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None = None, group: int = GROUP
) -> PackedLinear:
    """w = scale * q (+ offset) per group of `group` (32 or 16) columns (codes [n, k] int8;
    scale/offset [n, k/group], float32 tensors)."""
    n, k = codes.shape
    if group not in (16, 32) or k % group:
        raise ConfigError(f"8-bit weights need groups of 16 or 32 columns dividing k, got {group} and k={k}")
    c = _pad_rows(codes.to(torch.int8), BLOCK).view(-1, BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    scale_table, zero, _, _ = _group_tables(scale, offset, group, None)
    return PackedLinear(Q8, c.view(torch.uint8).reshape(-1), scale_table, zero, n, k, group=group)


def pack_bf16(weight: torch.Tensor) -> PackedLinear:
    """A bf16 weight [n, k] as it is (k padded to even with zeros)."""
    n, k = weight.shape
    w = weight.detach().to(torch.bfloat16)
    if k % 2:
        w = torch.cat([w, w.new_zeros(n, 1)], dim=1)
    exponents = bf16_exponent_range(w)
    w = _pad_rows(w, BLOCK).view(-1, BLOCK, w.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()
    return PackedLinear(BF16, w.view(torch.uint8).reshape(-1), torch.empty(0), torch.empty(0), n, k, exponents)


def bf16_exponent_range(w: torch.Tensor) -> tuple[int, int]:
    """(lowest, highest) biased exponent of w's nonzero bf16 values; (255, 0) if all are zero;
    (-1, -1) if any is subnormal, infinite or NaN."""
    bits = w.view(torch.int16).to(torch.int32)
    exponent, mantissa = (bits >> 7) & 0xFF, bits & 0x7F
    if bool(((exponent == 0xFF) | ((exponent == 0) & (mantissa != 0))).any()):
        return (-1, -1)
    nonzero = exponent[exponent != 0]
    return (int(nonzero.min()), int(nonzero.max())) if nonzero.numel() else (255, 0)


def concat_columns(parts: list[PackedLinear]) -> PackedLinear | None:
    """One weight whose output columns are the parts' side by side (a fused QKV or gate/up from
    separate linears), or None unless every part is whole 16-column blocks of one layout. A column's
    sums do not depend on the weight around it, so the fused weight gives each part's outputs bit
    for bit. The parts are re-pointed at views of the fused tensors: the codes are held once."""
    first = parts[0]
    same = ("format", "k", "group", "bits", "code_offset", "int8_activations")
    if any(p.n % BLOCK or any(getattr(p, a) != getattr(first, a) for a in same) for p in parts):
        return None
    tables = ("codes", "scale", "zero", "scale_super", "zero_super")
    if any(len({(getattr(p, t).dtype, bool(getattr(p, t).numel())) for p in parts}) > 1 for t in tables):
        return None  # one table type, present in every part or in none
    los, his = [p.exponents[0] for p in parts], [p.exponents[1] for p in parts]
    exponents = (-1, -1) if -1 in los else (min(los), max(his))
    cat = {t: torch.cat([getattr(p, t) for p in parts]) for t in tables}
    fused = PackedLinear(
        first.format, cat["codes"], cat["scale"], cat["zero"], sum(p.n for p in parts), first.k, exponents, first.group,
        first.bits, first.code_offset, first.int8_activations, cat["scale_super"], cat["zero_super"],
    )  # fmt: skip
    offsets = {t: 0 for t in tables}
    for p in parts:  # each part reads its own rows of the fused tensors
        for t in tables:
            n = getattr(p, t).shape[0]
            setattr(p, t, getattr(fused, t)[offsets[t] : offsets[t] + n])
            offsets[t] += n
    return fused
