"""Run the real model directly over a private KV pool (for logits-level comparisons)."""

from __future__ import annotations

import torch

from specserve.kv.pool import KVPool, ReqToTokenPool
from specserve.models.attention import AttentionMetadata
from specserve.models.forward_batch import ForwardBatch


def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    """float32 logits of every position of one prompt, computed in a single extend pass."""
    cfg = model.config
    n = len(ids)
    kv = KVPool(n, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype)
    table = ReqToTokenPool(1, n)
    slots = list(range(1, n + 1))
    table.write(0, 0, slots)
    meta = AttentionMetadata.build(table.table, [0], [n], [n], dtype=model.dtype)
    fb = ForwardBatch(torch.tensor(ids), torch.arange(n), torch.tensor(slots), meta, torch.arange(n))
    return model(fb, kv)
