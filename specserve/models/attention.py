"""Paged attention over the token-slot table, one metadata type per implementation.

One batch may mix requests with different numbers of new tokens (prefill after a cached
prefix, decode, or a speculative verify window).

- `KernelAttentionMetadata` (bf16 on CPU): every query row goes through specserve's kernel, which
  reads its request's K/V in place and computes the row alone in one fixed order
  (specserve/kernels/csrc/attention.h), so a token's output is the same in a prefill, an extend, a
  decode batch or a verify window.
- `SdpaAttentionMetadata` (fp32, CUDA): queries are padded to [bs, max_q], keys gathered to
  [bs, max_kv], and a mask gives each request causal access to its own prefix and new rows.

The backend (models/backend.py) builds one or the other and runs the matching attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from specserve.kernels.attention import paged_attention as kernel_paged_attention
from specserve.runtime.host_waits import device_code
from specserve.runtime.stream import staged


@dataclass
class KernelAttentionMetadata:
    """Per flat query row: its table row and how many positions it sees (0 for padding rows); the
    table is read in place. Shared by every layer of one pass."""

    table: torch.Tensor
    row_req: torch.Tensor  # [T]
    row_len: torch.Tensor  # [T]

    @classmethod
    def build(
        cls, table: torch.Tensor, rows: list[int], seq_lens: list[int], extend_lens: list[int], device: str
    ) -> "KernelAttentionMetadata":
        row_req = staged([r for r, e in zip(rows, extend_lens) for _ in range(e)], torch.int64, device)
        row_len = staged([p + 1 for s, e in zip(seq_lens, extend_lens) for p in range(s - e, s)], torch.int64, device)
        return cls(table, row_req, row_len)

    @classmethod
    def for_windows(
        cls, table: torch.Tensor, rows: torch.Tensor, prefix_lens: torch.Tensor, valid: torch.Tensor, width: int
    ) -> "KernelAttentionMetadata":
        q_pos = prefix_lens.unsqueeze(1) + torch.arange(width, device=rows.device).unsqueeze(0)
        row_len = (q_pos + 1).masked_fill(~valid.unsqueeze(1), 0).reshape(-1)
        return cls(table, rows.repeat_interleave(width), row_len)

    def attend(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        scale: float,
        window: int = 0,
        sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """q: [T, H, D] flat new-token queries -> [T, H, D]; K/V already written to the pool. With a
        sliding `window`, each row sees only its last `window` positions; `sinks` (float32 [H]) join
        each head's softmax with no value (gpt-oss)."""
        return kernel_paged_attention(q, k_pool, v_pool, self.table, self.row_req, self.row_len, scale, window, sinks)


@dataclass
class SdpaAttentionMetadata:
    """Padded queries, gathered keys and an additive mask for torch's SDPA."""

    bs: int
    max_q: int
    kv_slots: torch.Tensor  # [bs, max_kv] token slots (0 = scratch) to gather K/V from
    # [bs, max_q] rows of the flat token tensor (T = zero pad row); None when every request has max_q rows
    q_gather: Optional[torch.Tensor] = None
    out_scatter: Optional[torch.Tensor] = None  # [T] row of the padded [bs*max_q] output for each flat token
    mask: Optional[torch.Tensor] = None  # [bs, 1, max_q, max_kv] additive (0 or -inf); None when nothing is masked
    # For sliding-window layers: the boolean mask, each query row's position and whether it is a
    # real row (padding rows keep their column 0); masks per window, made on first use.
    allowed: Optional[torch.Tensor] = None  # [bs, max_q, max_kv]
    q_pos: Optional[torch.Tensor] = None  # [bs, max_q]
    q_real: Optional[torch.Tensor] = None  # [bs, max_q]
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        table: torch.Tensor,
        rows: list[int],
        seq_lens: list[int],
        extend_lens: list[int],
        device: str,
        dtype: torch.dtype,
    ) -> "SdpaAttentionMetadata":
        bs = len(seq_lens)
        max_q, max_kv = max(extend_lens), max(seq_lens)
        seq = staged(seq_lens, torch.int64, device)
        ext = staged(extend_lens, torch.int64, device)
        cols = torch.arange(max_kv, device=device)
        kv_valid = cols.unsqueeze(0) < seq.unsqueeze(1)
        kv_slots = table[staged(rows, torch.int64, device), :max_kv].masked_fill(~kv_valid, 0)
        # Query row i of request b sits at absolute position prefix_b + i and sees columns <= it.
        q_pos = (seq - ext).unsqueeze(1) + torch.arange(max_q, device=device).unsqueeze(0)
        mask = (cols.view(1, 1, -1) <= q_pos.unsqueeze(-1)) & kv_valid.unsqueeze(1)
        q_valid = torch.arange(max_q, device=device).unsqueeze(0) < ext.unsqueeze(1)
        # Padded query rows attend to column 0 only, so their softmax stays finite.
        mask = mask & q_valid.unsqueeze(-1) | (~q_valid.unsqueeze(-1) & (cols.view(1, 1, -1) == 0))
        q_gather = out_scatter = None
        if max_q > 1:
            starts = torch.cumsum(ext, 0) - ext
            flat = starts.unsqueeze(1) + torch.arange(max_q, device=device).unsqueeze(0)
            # From the host lists, not the device tensors: reading those would wait for the device.
            q_gather = torch.where(q_valid, flat, torch.full_like(flat, sum(extend_lens)))
            scatter = [b * max_q + i for b, n in enumerate(extend_lens) for i in range(n)]
            out_scatter = staged(scatter, torch.int64, device)
        additive = _additive(mask, dtype) if max_q > 1 or min(seq_lens) != max_kv else None
        return cls(bs, max_q, kv_slots, q_gather, out_scatter, additive, mask, q_pos, q_valid)

    @classmethod
    def for_windows(
        cls,
        table: torch.Tensor,
        rows: torch.Tensor,
        prefix_lens: torch.Tensor,
        valid: torch.Tensor,
        width: int,
        kv_len: int,
        dtype: torch.dtype,
    ) -> "SdpaAttentionMetadata":
        """Built from device tensors with shapes fixed by (bs, width, kv_len) and no host reads, so
        a CUDA graph can capture it. Rows with `valid` False are padding: they see column 0 only."""
        bs, device = rows.shape[0], rows.device
        q_pos = prefix_lens.unsqueeze(1) + torch.arange(width, device=device).unsqueeze(0)
        cols = torch.arange(kv_len, device=device)
        kv_valid = (cols.unsqueeze(0) < (prefix_lens + width).unsqueeze(1)) & valid.unsqueeze(1)
        kv_slots = table[rows, :kv_len].masked_fill(~kv_valid, 0)
        mask = (cols.view(1, 1, -1) <= q_pos.unsqueeze(-1)) & kv_valid.unsqueeze(1)
        mask = mask | ((~valid).view(bs, 1, 1) & (cols.view(1, 1, -1) == 0))
        real = valid.unsqueeze(1).expand(bs, width)
        return cls(bs, width, kv_slots, mask=_additive(mask, dtype), allowed=mask, q_pos=q_pos, q_real=real)

    def attend(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        scale: float,
        window: int = 0,
        sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """q: [T, H, D] flat new-token queries -> [T, H, D]; K/V already written to the pool. With a
        sliding `window`, a query at position p sees the keys at positions above p - window;
        `sinks` (float32 [H]) join each head's softmax with no value (gpt-oss)."""
        heads, dim = q.shape[1], q.shape[2]
        mask = self._window_mask(window, q.dtype) if window and self.kv_slots.shape[1] > window else self.mask
        if self.q_gather is None:
            qp = q.view(self.bs, self.max_q, heads, dim)
        else:
            qp = torch.cat([q, q.new_zeros(1, heads, dim)])[self.q_gather]
        k = k_pool[self.kv_slots]  # [bs, max_kv, KVH, D]
        v = v_pool[self.kv_slots]
        if sinks is not None:
            out = _attention_with_sinks(qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale, sinks)
        else:
            out = F.scaled_dot_product_attention(
                qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True
            )  # [bs, H, max_q, D]
        out = out.transpose(1, 2).reshape(-1, heads, dim)
        return out if self.out_scatter is None else out[self.out_scatter]

    def _window_mask(self, window: int, dtype: torch.dtype) -> torch.Tensor:
        if window not in self.window_masks:
            assert self.allowed is not None and self.q_pos is not None and self.q_real is not None, "built with them"
            cols = torch.arange(self.allowed.shape[-1], device=self.allowed.device).view(1, 1, -1)
            recent = cols > self.q_pos.unsqueeze(-1) - window
            self.window_masks[window] = _additive(self.allowed & (recent | ~self.q_real.unsqueeze(-1)), dtype)
        return self.window_masks[window]


def _attention_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float, sinks: torch.Tensor
) -> torch.Tensor:
    """SDPA with a sink logit per head (q [bs, H, Q, D], k/v [bs, KVH, K, D]): the softmax runs over
    the scores and the sink, whose weight then goes nowhere (SDPA has no such column)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return probs @ v


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive, in the model dtype, made once per pass: SDPA would convert a boolean mask in every layer."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf")).unsqueeze(1)


AttentionMetadata = KernelAttentionMetadata | SdpaAttentionMetadata


def block_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The drafter's block queries [bs, g, H, D] over keys/values [bs, C + g, KVH, D] -> [bs, g, H, D],
    bidirectional inside the block. With bs = 1 and a mask [1, 1, C + g], the masked columns are
    dropped instead, so the computation's shape is the request's own: batching another request
    next to it cannot change its result. That is the CPU kernels' way to batch invariance, and a
    CPU kernel reading its own mask is no host wait (on CUDA the masked attention runs instead)."""
    if mask is not None and q.shape[0] == 1 and mask.numel() == mask.shape[-1] and q.device.type == "cpu":  # not 2-D
        with device_code():
            keep = mask.reshape(-1) == 0
            keys, values, mask = keys[:, keep], values[:, keep], None
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(1, 2)
