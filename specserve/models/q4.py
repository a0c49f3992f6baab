"""GGUF 4-bit weights (Q4_0, Q4_1) served as they are, through PyTorch's int4 CPU kernel.

Both formats store blocks of 32 weights as 4-bit codes q with per-block floats; Q4_1 means
w = d*q + m and Q4_0 means w = d*(q - 8). PyTorch's `_weight_int4pack_mm_for_cpu` computes
w = (q - 8)*scale + zero per group of 32, so scale = d and zero = m + 8d (Q4_1) or 0 (Q4_0)
carry the GGUF weights over without re-quantizing. At one row per step this kernel moves about
a quarter of the bytes of a bf16 matmul: the 30-layer decode matmuls took 4.5 ms instead of
14-17 ms (bf16, pre-packed) on these CPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}


@dataclass
class Q4Weight:
    """4-bit codes [out, in] (uint8 0..15) and per-group scale and zero [out, in / 32] (float32)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def rows(self, index) -> "Q4Weight":
        return Q4Weight(self.codes[index], self.scale[index], self.zero[index])

    def cols(self, start: int, count: int) -> "Q4Weight":
        if start % GROUP or count % GROUP:
            raise ValueError(f"tp_size: a 4-bit weight can only be split at multiples of {GROUP} input columns")
        g0, gn = start // GROUP, count // GROUP
        return Q4Weight(self.codes[:, start:start + count], self.scale[:, g0:g0 + gn], self.zero[:, g0:g0 + gn])

    @staticmethod
    def cat(parts: list["Q4Weight"]) -> "Q4Weight":
        return Q4Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "zero")))

    def dequantize(self) -> torch.Tensor:
        scale = self.scale.repeat_interleave(GROUP, dim=1)
        zero = self.zero.repeat_interleave(GROUP, dim=1)
        return (self.codes.float() - 8) * scale + zero

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed codes, scales_and_zeros [in/32, out, 2] bf16) for `_weight_int4pack_mm_for_cpu`."""
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.codes.to(torch.int32).contiguous(), 8)
        sz = torch.stack([self.scale, self.zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        return packed, sz


def is_q4(type_name: str) -> bool:
    return type_name in _BLOCK_BYTES


def parse_q4(raw: np.ndarray, type_name: str) -> Q4Weight:
    """Split GGUF Q4_0 / Q4_1 blocks (raw uint8 [out, blocks * block_bytes]) into codes and scales."""
    out = raw.shape[0]
    blocks = np.asarray(raw).reshape(out, -1, _BLOCK_BYTES[type_name])
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q4_1":
        m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        packed, zero = blocks[:, :, 4:], m + 8 * d
    else:
        packed, zero = blocks[:, :, 2:], np.zeros_like(d)
    # Low nibbles hold elements 0..15 of a block, high nibbles 16..31.
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=2).reshape(out, -1)
    return Q4Weight(torch.from_numpy(codes.astype(np.uint8)), torch.from_numpy(d), torch.from_numpy(zero))


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]), packed, GROUP, scales_zeros)
    return y.view(*shape[:-1], y.shape[-1])
