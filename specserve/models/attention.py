"""Paged attention over the token-slot table.

One batch may mix requests with different numbers of new tokens (prefill after a cached
prefix, decode, or a speculative verify window). In bf16 on CPU every query row goes through
specserve's kernel, which reads its request's K/V in place and computes the row alone in one
fixed order (specserve/kernels/csrc/attention.h): a token's output is the same in a prefill, an
extend, a decode batch or a verify window. Elsewhere (fp32, CUDA) queries are padded to
[bs, max_q], keys gathered to [bs, max_kv], and a boolean mask gives each request causal access to
its own prefix and new rows for SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.kernels.attention import paged_attention as kernel_paged_attention


def uses_kernel(device, dtype: torch.dtype) -> bool:
    """bf16 on CPU runs specserve's attention kernel."""
    return torch.device(device).type == "cpu" and dtype == torch.bfloat16


@dataclass
class AttentionMetadata:
    """Index tensors shared by every layer of one forward pass."""

    bs: int
    max_q: int
    # The kernel's (bf16 on CPU): the table, read in place, and per flat query row its table row and
    # how many positions it sees (0 for padding rows).
    table: torch.Tensor | None = None
    row_req: torch.Tensor | None = None  # [T]
    row_len: torch.Tensor | None = None  # [T]
    # SDPA's (other dtypes and devices):
    # [bs, max_q] rows of the flat token tensor (T = zero pad row); None when every request has max_q rows
    q_gather: torch.Tensor | None = None
    out_scatter: torch.Tensor | None = None  # [T] row of the padded [bs*max_q] output for each flat token
    kv_slots: torch.Tensor | None = None  # [bs, max_kv] token slots (0 = scratch) to gather K/V from
    mask: torch.Tensor | None = None  # [bs, 1, max_q, max_kv] additive (0 or -inf); None when nothing is masked

    @classmethod
    def build(cls, req_to_token: torch.Tensor, req_pool_indices: list[int], seq_lens: list[int],
              extend_lens: list[int], device: str = "cpu", dtype: torch.dtype = torch.float32) -> "AttentionMetadata":
        bs = len(seq_lens)
        max_q, max_kv = max(extend_lens), max(seq_lens)
        rows = torch.tensor(req_pool_indices, dtype=torch.int64, device=device)
        seq = torch.tensor(seq_lens, dtype=torch.int64, device=device)
        ext = torch.tensor(extend_lens, dtype=torch.int64, device=device)
        if uses_kernel(device, dtype):  # per flat row: its request's table row and how far it sees
            row_req = torch.tensor([r for r, e in zip(req_pool_indices, extend_lens) for _ in range(e)], device=device)
            row_len = torch.tensor([p + 1 for s, e in zip(seq_lens, extend_lens) for p in range(s - e, s)], device=device)
            return cls(bs, max_q, req_to_token, row_req, row_len)
        cols = torch.arange(max_kv, device=device)
        kv_valid = cols.unsqueeze(0) < seq.unsqueeze(1)
        kv_slots = req_to_token[rows, :max_kv].masked_fill(~kv_valid, 0)
        # Query row i of request b sits at absolute position prefix_b + i and sees columns <= it.
        q_pos = (seq - ext).unsqueeze(1) + torch.arange(max_q, device=device).unsqueeze(0)
        mask = (cols.view(1, 1, -1) <= q_pos.unsqueeze(-1)) & kv_valid.unsqueeze(1)
        q_valid = torch.arange(max_q, device=device).unsqueeze(0) < ext.unsqueeze(1)
        # Padded query rows attend to column 0 only, so their softmax stays finite.
        mask = mask & q_valid.unsqueeze(-1) | (~q_valid.unsqueeze(-1) & (cols.view(1, 1, -1) == 0))
        q_gather = out_scatter = None
        if max_q > 1:
            total = int(ext.sum())
            starts = torch.cumsum(ext, 0) - ext
            flat = starts.unsqueeze(1) + torch.arange(max_q, device=device).unsqueeze(0)
            q_gather = torch.where(q_valid, flat, torch.full_like(flat, total))
            out_scatter = (torch.arange(bs, device=device).unsqueeze(1) * max_q
                           + torch.arange(max_q, device=device).unsqueeze(0))[q_valid]
        # Additive, in the model dtype, made once per pass: SDPA would convert a boolean mask in every layer.
        additive = None
        if max_q > 1 or min(seq_lens) != max_kv:
            additive = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf")).unsqueeze(1)
        return cls(bs, max_q, q_gather=q_gather, out_scatter=out_scatter, kv_slots=kv_slots, mask=additive)

    @classmethod
    def for_windows(cls, req_to_token: torch.Tensor, rows: torch.Tensor, prefix_lens: torch.Tensor,
                    valid: torch.Tensor, width: int, kv_len: int, dtype: torch.dtype) -> "AttentionMetadata":
        """Every request computes a full window of `width` rows after its prefix (decode: 1).

        Built from device tensors with shapes fixed by (bs, width, kv_len) and no host reads, so
        a CUDA graph can capture it. Rows with `valid` False are padding: they see column 0 only."""
        bs, device = rows.shape[0], rows.device
        q_pos = prefix_lens.unsqueeze(1) + torch.arange(width, device=device).unsqueeze(0)
        if uses_kernel(device, dtype):
            row_len = (q_pos + 1).masked_fill(~valid.unsqueeze(1), 0).reshape(-1)
            return cls(bs, width, req_to_token, rows.repeat_interleave(width), row_len)
        cols = torch.arange(kv_len, device=device)
        kv_valid = (cols.unsqueeze(0) < (prefix_lens + width).unsqueeze(1)) & valid.unsqueeze(1)
        kv_slots = req_to_token[rows, :kv_len].masked_fill(~kv_valid, 0)
        mask = (cols.view(1, 1, -1) <= q_pos.unsqueeze(-1)) & kv_valid.unsqueeze(1)
        mask = mask | ((~valid).view(bs, 1, 1) & (cols.view(1, 1, -1) == 0))
        additive = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf")).unsqueeze(1)
        return cls(bs, width, kv_slots=kv_slots, mask=additive)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """q: [T, H, D] flat new-token queries -> [T, H, D]; K/V already written to the pool."""
    if meta.kv_slots is None:
        return kernel_paged_attention(q, k_pool, v_pool, meta.table, meta.row_req, meta.row_len, scale)
    heads, dim = q.shape[1], q.shape[2]
    if meta.q_gather is None:
        qp = q.view(meta.bs, meta.max_q, heads, dim)
    else:
        qp = torch.cat([q, q.new_zeros(1, heads, dim)])[meta.q_gather]
    k = k_pool[meta.kv_slots]  # [bs, max_kv, KVH, D]
    v = v_pool[meta.kv_slots]
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=meta.mask, scale=scale, enable_gqa=True,
    )  # [bs, H, max_q, D]
    out = out.transpose(1, 2)
    if meta.out_scatter is None:
        return out.reshape(-1, heads, dim)
    return out.reshape(-1, heads, dim)[meta.out_scatter]
