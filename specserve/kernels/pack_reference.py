"""The definition of the Q4 layout's packing (kernels/linear.py pack_codes, which csrc/pack.cpp
does in one pass): whole-array torch shifts on one int64 word per oct of 8 codes."""

from __future__ import annotations

import torch

from specserve.kernels.linear import BLOCK


def pack_codes_reference(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """pack_codes through whole-array torch shifts."""
    k = codes.shape[1]
    c = codes.view(-1, BLOCK, k // 8, 8)  # [B, lane, oct, 8 columns]
    octs = c.view(torch.int64).squeeze(-1)  # [B, lane, oct]: codes < 64, so every word is >= 0
    parts = [_nibble_words(octs & _NIBBLES).unsqueeze(-1).view(torch.uint8)]
    if bits > 4:
        parts.append(_high_plane(octs >> 4 & _NIBBLES, bits))
    # each [B, lane, oct, bytes] -> per block and oct: its 16 lanes' nibble words, then their high bits
    return torch.cat([p.transpose(1, 2).reshape(c.shape[0], k // 8, -1) for p in parts], dim=2).reshape(-1)


# Every oct's 8 codes (one byte each) read as one int64 word: on little-endian CPUs (x86, Arm) byte j is column j.
_NIBBLES = 0x0F0F0F0F0F0F0F0F


def _nibble_words(octs: torch.Tensor) -> torch.Tensor:
    """Each oct's nibble word (kernels/linear.py _Q4_SHIFTS: column 2p at bit 4p, 2p + 1 at 16 + 4p) from its int64
    word of 8 low nibbles (`octs`, overwritten), as int32. A few whole-array shifts on one int64
    per oct, in place where they can be, not byte arithmetic on strided views."""
    pairs = octs >> 12
    pairs |= octs  # byte 0: columns 0 | 2 << 4, byte 1: 1 | 3 << 4, bytes 4, 5: the same for 4..7
    return _gather(pairs, octs, ((0, 0xFF), (24, 0xFF00), (-8, 0xFF0000), (16, 0xFF000000))).to(torch.int32)


def _high_plane(octs: torch.Tensor, bits: int) -> torch.Tensor:
    """Each oct's high-bit plane (kernels/linear.py _HIGH_SHIFTS) from its int64 word of 8 codes' high bits (`octs`,
    overwritten), as bytes [..., 1 or 2]: for 5 bits one byte (column 2p at bit p, 2p + 1 at bit
    4 + p); for 6 bits a little-endian uint16 whose low byte holds the even columns' 2 bits, 2p at
    bit 2p, and its high byte the odd ones'."""
    if bits == 5:
        both = octs >> 4
        both |= octs
        both &= 0x0011001100110011  # column 2p at bit 16p, 2p + 1 at bit 16p + 4
        plane = _gather(both, octs, ((0, 0x11), (15, 0x22), (30, 0x44), (45, 0x88)))
        return plane.to(torch.uint8).unsqueeze(-1)
    plane = _gather(octs, octs.clone(), ((0, 0x0303), (14, 0x0C0C), (28, 0x3030), (42, 0xC0C0)))
    return plane.to(torch.int32).unsqueeze(-1).view(torch.uint8)[..., :2]


def _gather(words: torch.Tensor, scratch: torch.Tensor, moves: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """A new tensor: the OR over `moves` of (words >> shift) & mask (a negative shift moves left);
    `scratch` (words' shape, int64) is overwritten."""
    out = words & moves[0][1]
    for shift, mask in moves[1:]:
        if shift > 0:
            torch.bitwise_right_shift(words, shift, out=scratch)
        else:
            torch.bitwise_left_shift(words, -shift, out=scratch)
        scratch &= mask
        out |= scratch
    return out
