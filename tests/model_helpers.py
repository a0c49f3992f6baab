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


def windowed_logits(model, prompts: list[list[int]], window: int) -> list[torch.Tensor]:
    """Prefill all but the last `window` tokens of each prompt, then run every request's last
    `window` tokens as one batched multi-token step (the shape of a speculative verify) and
    return the logits of all window rows per request."""
    cfg = model.config
    total = sum(len(p) for p in prompts)
    kv = KVPool(total, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype)
    table = ReqToTokenPool(len(prompts), max(len(p) for p in prompts))
    next_slot, slots = 1, []
    for r, p in enumerate(prompts):
        own = list(range(next_slot, next_slot + len(p)))
        next_slot += len(p)
        table.write(r, 0, own)
        slots.append(own)
    rows = list(range(len(prompts)))

    def run(starts: list[int], ends: list[int], all_rows: bool) -> torch.Tensor:
        ids = [t for p, s, e in zip(prompts, starts, ends) for t in p[s:e]]
        pos = [i for s, e in zip(starts, ends) for i in range(s, e)]
        loc = [x for sl, s, e in zip(slots, starts, ends) for x in sl[s:e]]
        ext = [e - s for s, e in zip(starts, ends)]
        meta = AttentionMetadata.build(table.table, rows, ends, ext, dtype=model.dtype)
        logit_rows = torch.arange(len(ids)) if all_rows else torch.tensor([sum(ext[:i + 1]) - 1 for i in range(len(ext))])
        fb = ForwardBatch(torch.tensor(ids), torch.tensor(pos), torch.tensor(loc), meta, logit_rows)
        return model(fb, kv)

    cut = [len(p) - window for p in prompts]
    run([0] * len(prompts), cut, all_rows=False)
    logits = run(cut, [len(p) for p in prompts], all_rows=True)
    return list(logits.split(window))
