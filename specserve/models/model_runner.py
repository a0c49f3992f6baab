"""ModelRunner: turns a ScheduleBatch into a forward pass over the paged KV cache and samples."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from specserve.kv.pool import KVPool, ReqToTokenPool
from specserve.models.attention import AttentionMetadata
from specserve.models.forward_batch import ForwardBatch
from specserve.models.llama import LlamaForCausalLM
from specserve.sampler import sample
from specserve.scheduler.batch import ScheduleBatch


class ModelRunner:
    """Owns the model and its K/V tensors; the scheduler owns which slots mean what."""

    def __init__(self, model: LlamaForCausalLM, kv: KVPool, req_to_token: ReqToTokenPool, device: str = "cpu"):
        self.model = model
        self.kv = kv
        self.req_to_token = req_to_token
        self.device = device

    def forward_batch(self, batch: ScheduleBatch) -> ForwardBatch:
        dev = self.device
        rows, offset = [], 0
        for n, wanted in zip(batch.extend_lens, batch.sample):
            offset += n
            if wanted:
                rows.append(offset - 1)
        meta = AttentionMetadata.build(self.req_to_token.table, [r.req_pool_idx for r in batch.reqs],
                                       batch.seq_lens, batch.extend_lens, dev, self.model.dtype)
        return ForwardBatch(
            input_ids=torch.tensor(batch.input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(batch.positions(), dtype=torch.int64, device=dev),
            out_cache_loc=torch.tensor(batch.out_cache_loc, dtype=torch.int64, device=dev),
            attn=meta,
            logit_rows=torch.tensor(rows, dtype=torch.int64, device=dev),
        )

    def logits(self, batch: ScheduleBatch) -> torch.Tensor:
        """float32 logits of the last new token of every request that samples this step."""
        return self.model(self.forward_batch(batch), self.kv)

    def run_batch(self, batch: ScheduleBatch) -> Sequence[Optional[int]]:
        wanted = [r for r, s in zip(batch.reqs, batch.sample) if s]
        if not wanted:
            self.logits(batch)  # a non-final prefill chunk: fill the KV cache only
            return [None] * batch.size
        logits = self.logits(batch)
        picked = iter(sample(logits.cpu(), [r.params for r in wanted], [r.seed for r in wanted],
                             [len(r.output_ids) for r in wanted]))
        return [next(picked) if s else None for s in batch.sample]
