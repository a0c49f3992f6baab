"""STANDALONE: a smaller model with the target's vocabulary drafts k tokens autoregressively.

The draft model keeps its own K/V in a pool indexed by the target's token slots (so one allocator
serves both and a request's draft K/V sit at the slots of its own positions), but unlike DSPARK's
it is written lazily and per request: a request's draft K/V are caught up only when it drafts
with STANDALONE, from the last position its own drafting left valid to its anchor, in one extend
pass with the other drafting requests. Then k-1 decode steps of the draft model give d_2..d_k.

Which positions hold valid draft K/V (`fed`, kept as STANDALONE's state in the request's
RequestTokens): after every commit, it is a prefix of the request's committed positions (those
before its anchor) whose draft K/V this request wrote at the slot the position now holds:
- a restart (a new prefill, or a retracted request back) empties it: the slots may be new, and a
  slot shared through the prefix cache may hold another request's draft K/V or none;
- drafting extends it with the catch-up, the anchor and the drafts fed back, all at the window's
  slots;
- a commit keeps the part that matches the committed tokens before the new anchor: the accepted
  drafts kept their window slots; a rejected draft and everything after it go.
A step in which the request drafted with another drafter (or none) leaves `fed` as it was, which
is still a prefix of its committed positions. Rank agreement needs nothing here: every rank
drafts the same way and the executor uses rank 0's windows.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

import torch

from specserve.kv.pool import KVPool
from specserve.models.forward_batch import ForwardBatch
from specserve.models.llama import LlamaForCausalLM
from specserve.names import Algorithm
from specserve.sampler import counter_uniform, draft_counter, filtered_probs, inverse_cdf
from specserve.speculative.committed import RequestTokens
from specserve.speculative.worker import DraftInput, Drafts, WorkerDefaults


class DecodeSteps(Protocol):
    """One-row-per-request steps of the draft model over persistent buffers (the engine's captured
    step: a CUDA graph on CUDA); its logits are valid until the next call."""

    max_bs: int  # larger batches run eagerly

    def run(self, rows: torch.Tensor, prefix: torch.Tensor, ids: torch.Tensor, kv_bound: int, accept: bool = ...): ...


class StandaloneWorker(WorkerDefaults):
    """A draft model behind the worker seam (see the module docstring)."""

    name = Algorithm.STANDALONE
    reads_tokens = True
    tokens_early = True  # drafts from host state

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv: KVPool,
        req_to_token: torch.Tensor,
        target_vocab: int,
        decode_steps: Optional[DecodeSteps] = None,
    ):
        self.model = model
        self.kv = kv  # the draft model's K/V, at the target's token slots
        self.table = req_to_token
        self.target_vocab = target_vocab  # drafts and their distributions are over the target's ids
        self.decode_steps = decode_steps  # None: decode steps run eagerly
        # Per request (its RequestTokens' state): the tokens whose draft K/V are valid, positions 0.. (docstring)

    # Its pool is private: valid per request (`fed`), so the prefix cache neither shares nor keeps it
    # (kv_pools: none, WorkerDefaults').

    # ------------------------------------------------------------ drafting

    @torch.inference_mode()
    def draft(self, inp: DraftInput) -> Drafts:
        rows, prefix = inp.rows.tolist(), inp.prefix_lens.tolist()
        anchors = inp.anchors.tolist()
        k = min(inp.needed or inp.gamma, inp.gamma)
        fed: list[list[int]] = [r.state(self.name, list) for r in inp.requests]
        logits = self._catch_up(rows, prefix, anchors, inp.requests, fed)
        tokens = torch.empty(len(rows), inp.gamma, dtype=torch.int64, device=inp.anchors.device)
        sampled = [i for i, p in enumerate(inp.params) if not p.is_greedy]
        probs = torch.zeros(len(rows), inp.gamma, self.target_vocab) if sampled else None
        counters = inp.out_lens.tolist()
        for j in range(k):
            pick = self._pick(logits, j, sampled, inp, counters, probs)
            tokens[:, j] = pick
            if j + 1 < k:  # the last draft is never fed: nothing reads its K/V
                logits = self._decode(inp.rows, inp.prefix_lens + 1 + j, pick)
                for valid, tok in zip(fed, pick.tolist()):
                    valid.append(tok)
        if k < inp.gamma:  # windows verify at most k: the rest repeat the last draft, one-hot
            tokens[:, k:] = tokens[:, k - 1 : k]
            if probs is not None:
                probs[:, k:] = torch.nn.functional.one_hot(tokens[:, k:].cpu(), self.target_vocab).float()
        return Drafts(tokens, probs)

    def _catch_up(
        self,
        rows: list[int],
        prefix: list[int],
        anchors: list[int],
        requests: Sequence[RequestTokens],
        valid: list[list[int]],
    ) -> torch.Tensor:
        """One extend pass writing each request's draft K/V from its first invalid position through
        its anchor (valid[i]: request i's tokens with valid draft K/V); the logits at the anchors [n, V]."""
        starts, ids, slots = [], [], []
        for row, p, anchor, request, fed in zip(rows, prefix, anchors, requests, valid):
            seq = request.tokens[:p] + [anchor]
            start = min(len(fed), p)  # the anchor always runs: its logits give d_1
            del fed[start:]
            fed.extend(seq[start:])
            starts.append(start)
            ids.extend(seq[start:])
            slots.extend(self.table[row, start : p + 1].tolist())
        lens = [p + 1 - s for p, s in zip(prefix, starts)]
        device = self.table.device
        fb = ForwardBatch.for_requests(
            self.table, rows, starts, lens, torch.tensor(ids, device=device), slots, False, None, self.model.ops, ()
        )
        return self.model(fb, self.kv)

    def _decode(self, rows: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The draft model over one token per request at `positions`: logits [n, V]."""
        if self.decode_steps is not None and rows.shape[0] <= self.decode_steps.max_bs:
            bound = int(positions.max()) + 1
            return self.decode_steps.run(rows, positions, ids.view(-1, 1), bound, accept=False).logits
        fb = ForwardBatch.for_requests(
            self.table,
            rows.tolist(),
            positions.tolist(),
            [1] * rows.shape[0],
            ids,
            self.table[rows, positions].tolist(),
            False,
            None,
            self.model.ops,
            (),
        )
        return self.model(fb, self.kv)

    def _pick(
        self,
        logits: torch.Tensor,
        j: int,
        sampled: list[int],
        inp: DraftInput,
        counters: list[int],
        probs: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """Draft j of every request: the argmax over the target's ids, or for a sampling request a
        draw from its own filtered distribution (kept in probs, which rejection sampling needs)."""
        logits = logits[:, : self.target_vocab].float()
        pick = logits.argmax(-1)
        if probs is None:
            return pick
        q = filtered_probs(logits[sampled].cpu(), [inp.params[i] for i in sampled])
        u = [counter_uniform(inp.seeds[i], draft_counter(counters[i], j, inp.params[i].seeded_sampling)) for i in sampled]
        picked = inverse_cdf(q, torch.tensor(u, dtype=torch.float64))
        probs[:, j] = torch.nn.functional.one_hot(pick.cpu(), self.target_vocab).float()
        width = q.shape[1]
        probs[sampled, j] = 0.0
        probs[sampled, j, :width] = q
        pick[torch.tensor(sampled, device=pick.device)] = picked.to(pick.device)
        return pick

    # ------------------------------------------------------------ commit

    def commit_tokens(self, request: RequestTokens, tokens: list[int]) -> None:
        """Drop the draft K/V that the commit made invalid (a draft the target rejected, and the new
        anchor's position, which is always run)."""
        history = request.tokens
        anchor = len(history) - len(tokens) - 1  # fed before it already matched: only this step's part is compared
        fed: list[int] = request.state(self.name, list)
        limit = min(len(fed), len(history) - 1)  # positions before the new anchor are committed
        keep = next((i for i in range(min(anchor, limit), limit) if fed[i] != history[i]), limit)
        del fed[keep:]

    def flush(self) -> None:
        return None  # draft K/V are written when drafting
