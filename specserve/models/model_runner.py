"""ModelRunner: turns a ScheduleBatch into a forward pass over the paged KV cache and samples."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from specserve.kv.pool import KVPool, ReqToTokenPool
from specserve.models.attention import AttentionMetadata
from specserve.models.forward_batch import ForwardBatch
from specserve.models.llama import LlamaForCausalLM
from specserve.sampler import counter_uniform, filtered_probs, sample
from specserve.sampling_params import SamplingParams
from specserve.scheduler.batch import ScheduleBatch
from specserve.spec.dspark_verify import DsparkVerifyEpilogue


class ModelRunner:
    """Owns the model and its K/V tensors; the scheduler owns which slots mean what."""

    def __init__(self, model: LlamaForCausalLM, kv: KVPool, req_to_token: ReqToTokenPool, device: str = "cpu",
                 max_bs: int = 64):
        self.model = model
        self.kv = kv
        self.req_to_token = req_to_token
        self.device = device
        self.max_bs = max_bs
        self.epilogue: Optional[DsparkVerifyEpilogue] = None  # made at the first verify step

    def forward_batch(self, batch: ScheduleBatch) -> ForwardBatch:
        dev = self.device
        rows, offset = [], 0
        for n, wanted in zip(batch.extend_lens, batch.sample):
            offset += n
            if batch.mode == "verify":
                rows.extend(range(offset - n, offset))  # every window row is checked
            elif wanted:
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

    def run_batch(self, batch: ScheduleBatch) -> Sequence[Optional[int] | list[int]]:
        if batch.mode == "verify":
            return self.verify(batch)
        wanted = [r for r, s in zip(batch.reqs, batch.sample) if s]
        if not wanted:
            self.logits(batch)  # a non-final prefill chunk: fill the KV cache only
            return [None] * batch.size
        logits = self.logits(batch)
        picked = iter(sample(logits.cpu(), [r.params for r in wanted], [r.seed for r in wanted],
                             [len(r.output_ids) for r in wanted]))
        return [next(picked) if s else None for s in batch.sample]

    def verify(self, batch: ScheduleBatch) -> list[list[int]]:
        """Run the verify windows, accept into the epilogue's buffers, return each request's
        committed tokens (accepted drafts, then the bonus) from owned copies of them."""
        bs, width = batch.size, batch.extend_lens[0]
        if self.epilogue is None or self.epilogue.num_verify_tokens != width:
            self.epilogue = DsparkVerifyEpilogue(self.max_bs, width, self.device)
        logits = self.logits(batch)
        ids = torch.tensor(batch.input_ids, dtype=torch.int64, device=self.device).view(bs, width)
        prefix = torch.tensor(batch.prefix_lens, dtype=torch.int64, device=self.device)
        params = [r.params for r in batch.reqs]
        if all(p.is_greedy for p in params):
            self.epilogue.accept_greedy(bs, ids, logits, prefix)
        else:
            target = verify_target_probs(logits.view(bs, width, -1), params)
            drafts = torch.nn.functional.one_hot(ids[:, 1:], target.shape[-1]).float()  # a deterministic drafter
            uniforms = torch.tensor([[counter_uniform(r.seed, (len(r.output_ids) << 6) + j) for j in range(width)]
                                     for r in batch.reqs], dtype=torch.float64)
            self.epilogue.accept_sampling(bs, ids, target, drafts, uniforms, prefix)
        out = self.epilogue.read_accept(bs)
        commit, tokens = out.commit_lens.tolist(), out.out_tokens.tolist()
        return [row[:n] for row, n in zip(tokens, commit)]


def verify_target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[bs, W, V] target distribution per window row: one-hot argmax for greedy requests."""
    bs, width, vocab = logits.shape
    probs = torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    if sampled:
        rows = logits[sampled].reshape(-1, vocab)
        repeated = [params[i] for i in sampled for _ in range(width)]
        probs[sampled] = filtered_probs(rows, repeated).view(len(sampled), width, vocab)
    return probs
