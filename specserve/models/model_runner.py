"""ModelRunner: turns a ScheduleBatch into a forward pass over the paged KV cache and samples."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from specserve.kv.pool import KVPool, ReqToTokenPool
from specserve.models.attention import AttentionMetadata
from specserve.models.dspark import DraftOut, DsparkDrafter
from specserve.models.forward_batch import ForwardBatch
from specserve.models.llama import LlamaForCausalLM
from specserve.sampler import counter_uniform, filtered_probs, sample
from specserve.sampling_params import SamplingParams
from specserve.scheduler.batch import ScheduleBatch, VerifyOutcome
from specserve.spec.dspark_verify import AcceptOuts, DsparkVerifyEpilogue
from specserve.spec.planner import VerifyPlanner


@dataclass
class DsparkParts:
    """What DSPARK adds to a runner: the drafter, its paged K/V (same token slots as the target's)
    and, in compact mode, the verify planner."""

    drafter: DsparkDrafter
    kv: KVPool
    planner: Optional[VerifyPlanner] = None  # None: static verify


class ModelRunner:
    """Owns the model and its K/V tensors; the scheduler owns which slots mean what."""

    def __init__(self, model: LlamaForCausalLM, kv: KVPool, req_to_token: ReqToTokenPool, device: str = "cpu",
                 max_bs: int = 64, dspark: Optional[DsparkParts] = None):
        self.model = model
        self.kv = kv
        self.req_to_token = req_to_token
        self.device = device
        self.max_bs = max_bs
        self.dspark = dspark
        self.epilogue: Optional[DsparkVerifyEpilogue] = None  # made at the first verify step
        self.last_draft: Optional[DraftOut] = None  # for metrics and tests; owned tensors

    @property
    def capture_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.dspark.drafter.config.target_layer_ids) if self.dspark else ()

    def forward_batch(self, batch: ScheduleBatch, input_ids: Optional[torch.Tensor] = None,
                      extend_lens: Optional[Sequence[int]] = None) -> ForwardBatch:
        """Tensors for one pass. A compact verify passes its packed ids and per-request row counts."""
        dev = self.device
        extend_lens = list(extend_lens or batch.extend_lens)
        rows, offset = [], 0
        for n, wanted in zip(extend_lens, batch.sample):
            offset += n
            if batch.mode == "verify":
                rows.extend(range(offset - n, offset))  # every verified row is checked
            elif wanted:
                rows.append(offset - 1)
        seq_lens = [p + n for p, n in zip(batch.prefix_lens, extend_lens)]
        positions = [p + i for p, n in zip(batch.prefix_lens, extend_lens) for i in range(n)]
        slots = batch.out_cache_loc
        if extend_lens != list(batch.extend_lens):  # the first n slots of each window
            starts = _starts(batch.extend_lens)
            slots = [s for st, n in zip(starts, extend_lens) for s in batch.out_cache_loc[st:st + n]]
        meta = AttentionMetadata.build(self.req_to_token.table, [r.req_pool_idx for r in batch.reqs],
                                       seq_lens, extend_lens, dev, self.model.dtype)
        if input_ids is None:
            input_ids = torch.tensor(batch.input_ids, dtype=torch.int64, device=dev)
        return ForwardBatch(
            input_ids=input_ids,
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            out_cache_loc=torch.tensor(slots, dtype=torch.int64, device=dev),
            attn=meta,
            logit_rows=torch.tensor(rows, dtype=torch.int64, device=dev),
            capture_layer_ids=self.capture_layer_ids,
        )

    def logits(self, batch: ScheduleBatch) -> torch.Tensor:
        """float32 logits of the last new token of every request that samples this step."""
        fb = self.forward_batch(batch)
        logits = self.model(fb, self.kv)
        if self.dspark is not None:  # every computed row of a prefill or decode is committed
            self.dspark.drafter.inject(fb.captured_hidden, fb.positions, fb.out_cache_loc, self.dspark.kv)
        return logits

    @torch.inference_mode()
    def run_batch(self, batch: ScheduleBatch) -> Sequence[Optional[int] | VerifyOutcome]:
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

    # ------------------------------------------------------------ speculative verify

    def verify(self, batch: ScheduleBatch) -> list[VerifyOutcome]:
        """Draft (DSPARK), verify the windows, accept into the epilogue's buffers, inject the
        committed rows into the draft KV, and return each request's committed tokens (accepted
        drafts, then the bonus), all read from owned copies of the accept results."""
        bs, width = batch.size, batch.extend_lens[0]
        if self.epilogue is None or self.epilogue.num_verify_tokens != width:
            self.epilogue = DsparkVerifyEpilogue(self.max_bs, width, self.device)
        ids = torch.tensor(batch.input_ids, dtype=torch.int64, device=self.device).view(bs, width)
        prefix = torch.tensor(batch.prefix_lens, dtype=torch.int64, device=self.device)
        draft = self._draft(batch, ids, prefix)
        verify_lens = self._plan(draft, bs)
        logits, fb = self._verify_forward(batch, ids, verify_lens)
        self._accept(batch, ids, logits, prefix, draft, verify_lens)
        out = self.epilogue.read_accept(bs)  # owned: nothing below reads the *_buf tensors
        if self.dspark is not None:
            self._inject_committed(batch, fb, out, prefix, verify_lens)
        commit, tokens, trimmed = out.commit_lens.tolist(), out.out_tokens.tolist(), out.cap_trim_lens.tolist()
        return [VerifyOutcome(row[:n], cap) for row, n, cap in zip(tokens, commit, trimmed)]

    def _draft(self, batch: ScheduleBatch, ids: torch.Tensor, prefix: torch.Tensor) -> Optional[DraftOut]:
        """DSPARK: fill ids[:, 1:] with the drafter's block (NGRAM drafts came with the batch)."""
        if self.dspark is None:
            self.last_draft = None
            return None
        pool_rows = torch.tensor([r.req_pool_idx for r in batch.reqs], dtype=torch.int64, device=self.device)
        ctx_slots = self.req_to_token.table[pool_rows, :max(batch.prefix_lens)]
        draft = self.dspark.drafter.propose(ids[:, 0], prefix, ctx_slots, self.dspark.kv,
                                            [r.params for r in batch.reqs], [r.seed for r in batch.reqs],
                                            [len(r.output_ids) for r in batch.reqs])
        ids[:, 1:] = draft.tokens
        self.last_draft = draft
        return draft

    def _plan(self, draft: Optional[DraftOut], bs: int) -> Optional[list[int]]:
        if draft is None or self.dspark.planner is None:
            return None
        return self.dspark.planner.verify_lens(draft.confidence)

    def _verify_forward(self, batch: ScheduleBatch, ids: torch.Tensor,
                        verify_lens: Optional[list[int]]) -> tuple[torch.Tensor, ForwardBatch]:
        """Target logits in the strided [bs * W, V] layout. Compact mode packs the verified rows
        for the forward and scatters them back; uncomputed rows are zero (the cap never reads them)."""
        bs, width = ids.shape
        if verify_lens is None:
            fb = self.forward_batch(batch, ids.reshape(-1))
            return self.model(fb, self.kv), fb
        lens = torch.tensor(verify_lens, device=self.device)
        keep = torch.arange(width, device=self.device).unsqueeze(0) < lens.unsqueeze(1)
        fb = self.forward_batch(batch, ids[keep], verify_lens)
        packed = self.model(fb, self.kv)
        logits = packed.new_zeros(bs * width, packed.shape[-1])
        logits[keep.reshape(-1)] = packed
        return logits, fb

    def _accept(self, batch: ScheduleBatch, ids: torch.Tensor, logits: torch.Tensor, prefix: torch.Tensor,
                draft: Optional[DraftOut], verify_lens: Optional[list[int]]) -> None:
        bs, width = ids.shape
        lens = None if verify_lens is None else torch.tensor(verify_lens, dtype=torch.int64, device=self.device)
        params = [r.params for r in batch.reqs]
        if all(p.is_greedy for p in params):
            self.epilogue.accept_greedy(bs, ids, logits, prefix, lens)
            return
        target = verify_target_probs(logits.view(bs, width, -1), params)
        if draft is not None and draft.probs is not None:
            q = draft.probs
        else:  # a deterministic drafter (NGRAM): q is one-hot on its proposal
            q = torch.nn.functional.one_hot(ids[:, 1:], target.shape[-1]).float()
        uniforms = torch.tensor([[counter_uniform(r.seed, (len(r.output_ids) << 6) + j) for j in range(width)]
                                 for r in batch.reqs], dtype=torch.float64)
        self.epilogue.accept_sampling(bs, ids, target, q, uniforms, prefix, lens)

    def _inject_committed(self, batch: ScheduleBatch, fb: ForwardBatch, out: AcceptOuts, prefix: torch.Tensor,
                          verify_lens: Optional[list[int]]) -> None:
        """Draft K/V for exactly the committed rows: positions S..S+commit_len-1 of each window.

        Reads the owned `out.commit_lens` and the batch's own `prefix`, never an accept buffer:
        the seed's synchronous-loop bug was an injection reading a view the next step rewrote."""
        bs, width = out.out_tokens.shape
        col = torch.arange(width, device=self.device).unsqueeze(0)
        committed = col < out.commit_lens.unsqueeze(1)  # [bs, W]
        lens = verify_lens or [width] * bs
        packed_row = torch.tensor(_starts(lens), device=self.device).unsqueeze(1) + col
        window_slots = torch.tensor(batch.out_cache_loc, dtype=torch.int64, device=self.device).view(bs, width)
        self.dspark.drafter.inject(fb.captured_hidden[packed_row[committed]], (prefix.unsqueeze(1) + col)[committed],
                                   window_slots[committed], self.dspark.kv)


def _starts(lens: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for n in lens:
        out.append(acc)
        acc += n
    return out


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
