"""Paged attention through the CPU kernel: K/V read in place from the pool (see csrc/attention.h)."""

from __future__ import annotations

from typing import Optional

import torch

from specserve.kernels.build import load
from specserve.kernels.dispatch import path_id


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    row_req: torch.Tensor,
    row_len: torch.Tensor,
    scale: float,
    window: int = 0,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """q [T, H, D] bf16; row t attends to positions 0..row_len[t]-1 of table row row_req[t], or with a
    sliding `window` > 0 to the last `window` of them; `sinks` (float32 [H]): a logit per head that
    joins every softmax with no value (gpt-oss)."""
    return load().paged_attention(q.contiguous(), k_pool, v_pool, table, row_req, row_len, scale, window, path_id(), sinks)
