"""GGUF quantized weights kept as their exact codes: Q4_0 / Q4_1 (4-bit) and Q8_0 (8-bit).

All three store blocks of 32 weights with a per-block float16 scale d: Q4_1 means w = d*q + m
(q in 0..15), Q4_0 means w = d*(q - 8), Q8_0 means w = d*q (q in -128..127). The codes go to the
CPU kernels unchanged (specserve/kernels/linear.py), so serving computes with the GGUF's own
weights; only the float (dequantized) copies are used by fp32 and non-CPU paths.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specserve.errors import ConfigError
from specserve.kernels.linear import PackedLinear, pack_q4, pack_q8

GROUP = 32
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def _split_cols(start: int, count: int) -> tuple[int, int]:
    if start % GROUP or count % GROUP:
        raise ConfigError(f"tp_size: a quantized weight can only be split at multiples of {GROUP} input columns")
    return start // GROUP, count // GROUP


@dataclass
class Q4Weight:
    """4-bit codes [out, in] (uint8 0..15), per-group scale and offset [out, in / 32] (float32):
    w = scale * q + offset."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    def rows(self, index) -> "Q4Weight":
        return Q4Weight(self.codes[index], self.scale[index], self.offset[index])

    def cols(self, start: int, count: int) -> "Q4Weight":
        g0, gn = _split_cols(start, count)
        return Q4Weight(self.codes[:, start : start + count], self.scale[:, g0 : g0 + gn], self.offset[:, g0 : g0 + gn])

    @staticmethod
    def cat(parts: list["Q4Weight"]) -> "Q4Weight":
        return Q4Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "offset")))

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scale.repeat_interleave(GROUP, dim=1) + self.offset.repeat_interleave(GROUP, dim=1)

    def packed(self) -> PackedLinear:
        return pack_q4(self.codes, self.scale, self.offset)


@dataclass
class Q8Weight:
    """8-bit codes [out, in] (int8) and per-group scale [out, in / 32] (float32): w = scale * q."""

    codes: torch.Tensor
    scale: torch.Tensor

    def rows(self, index) -> "Q8Weight":
        return Q8Weight(self.codes[index], self.scale[index])

    def cols(self, start: int, count: int) -> "Q8Weight":
        g0, gn = _split_cols(start, count)
        return Q8Weight(self.codes[:, start : start + count], self.scale[:, g0 : g0 + gn])

    @staticmethod
    def cat(parts: list["Q8Weight"]) -> "Q8Weight":
        return Q8Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale")))

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scale.repeat_interleave(GROUP, dim=1)

    def packed(self) -> PackedLinear:
        return pack_q8(self.codes, self.scale)


QuantWeight = Q4Weight | Q8Weight


def is_quantized(type_name: str) -> bool:
    return type_name in _BLOCK_BYTES


def parse_quantized(raw: np.ndarray, type_name: str) -> QuantWeight:
    """Split GGUF blocks (raw uint8 [out, blocks * block_bytes]) into codes and scales."""
    out = raw.shape[0]
    blocks = np.asarray(raw).reshape(out, -1, _BLOCK_BYTES[type_name])
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q8_0":
        codes = blocks[:, :, 2:].copy().view(np.int8).reshape(out, -1)
        return Q8Weight(torch.from_numpy(codes), torch.from_numpy(d))
    if type_name == "Q4_1":
        packed = blocks[:, :, 4:]
        offset = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        packed, offset = blocks[:, :, 2:], -8 * d
    # Low nibbles hold elements 0..15 of a block, high nibbles 16..31.
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=2).reshape(out, -1)
    return Q4Weight(torch.from_numpy(codes.astype(np.uint8)), torch.from_numpy(d), torch.from_numpy(offset))
