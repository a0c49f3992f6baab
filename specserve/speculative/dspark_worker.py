"""DSPARK behind the worker seam: the block drafter, its draft K/V and what a step does with them.

One request's DSPARK verify step, top to bottom (the executor runs the parts that are not here):
1. `commit_rows` (the previous step): the target's hidden states at `target_layer_ids` of every
   committed row, i.e. the whole prompt at prefill, the row of a plain decode, and exactly rows
   S..S+commit_len-1 of a verify window, are projected into each draft layer's K/V at their
   absolute positions, in a pool indexed by the target's token slots (so the radix cache and
   the host tier keep draft context together with the target's);
2. `draft`: the anchor and g-1 mask slots attend to that context in one bidirectional pass; the
   Markov head picks d_1..d_g left to right (greedy, or sampled with counter-based uniforms) and
   the confidence head estimates each slot's survival for the compact-verify planner;
3. the executor verifies `[anchor, d_1..d_g]` with the target and accepts (speculative/accept.py);
   the committed rows come back to step 1.
Rejected rows are never injected: their draft K/V slots are overwritten by the next window.

Deferred injection (`max_pending_rows` > 0, with the adaptive policy): while no request drafts
with DSPARK, committed rows queue up (owned copies) and are injected in one batch before the next
DSPARK draft, or once `max_pending_rows` have queued: a step that does not draft then costs what
a plain decode step costs. Rows are injected in commit order, so a slot reused by a later request
ends with that request's row. Only the drafter reads the draft K/V, and it flushes first; the
host tier (HiCache) copies the pools behind the drafter's back, so the engine turns deferral off
with it.
"""

from __future__ import annotations

import torch

from specserve.kv.pool import KVPool
from specserve.models.dspark import DsparkDrafter
from specserve.names import Algorithm
from specserve.speculative.committed import CommittedRows
from specserve.speculative.worker import DraftContext, DraftInput, Drafts, WorkerDefaults

DEFERRED_ROWS = 1024  # committed rows the drafter may queue before injecting them (under the adaptive policy)


class DsparkWorker(WorkerDefaults):
    """The DSpark block drafter for requests that speculate with DSPARK."""

    name = Algorithm.DSPARK
    reads_tokens = False
    tokens_early = False

    def __init__(self, drafter: DsparkDrafter, kv: KVPool, req_to_token: torch.Tensor, max_pending_rows: int = 0):
        self.drafter = drafter
        self.kv = kv  # draft K/V, same token slots as the target's
        self.table = req_to_token  # [request slots, positions] -> token slot, for the context's slots
        self.max_pending_rows = max_pending_rows
        self.pending: list[CommittedRows] = []
        self.pending_rows = 0

    @property
    def capture_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.drafter.config.target_layer_ids)

    @property
    def kv_pools(self) -> list[KVPool]:
        return [self.kv]

    def draft(self, inp: DraftInput) -> Drafts:
        self.flush()
        # The host's bound on the context where the step gives one: reading the prefixes would wait.
        width = inp.context_bound()
        ctx_slots = self.table[inp.rows, : min(width, self.table.shape[1])]
        out = self.drafter.propose(
            inp.anchors, inp.prefix_lens, ctx_slots, self.kv, inp.params, inp.seeds, inp.out_lens, inp.needed
        )
        return _filled(Drafts(out.tokens, out.probs, out.confidence), inp.gamma)

    def commit_rows(self, rows: CommittedRows) -> None:
        if self.max_pending_rows <= 0:
            self.drafter.inject(rows.hidden, rows.positions, rows.slots, self.kv)
            return
        # Owned copies: a captured step's hidden states live in a buffer its next replay rewrites.
        self.pending.append(CommittedRows(rows.hidden.clone(), rows.positions.clone(), rows.slots.clone()))
        self.pending_rows += rows.hidden.shape[0]
        if self.pending_rows >= self.max_pending_rows:
            self.flush()

    def flush(self) -> None:
        """Inject every queued row, in commit order, as one batch."""
        if not self.pending:
            return
        hidden = torch.cat([r.hidden for r in self.pending])
        positions = torch.cat([r.positions for r in self.pending])
        slots = torch.cat([r.slots for r in self.pending])
        self.pending, self.pending_rows = [], 0
        self.drafter.inject(hidden, positions, slots, self.kv)


def _filled(drafts: Drafts, gamma: int) -> Drafts:
    """Windows of gamma drafts from the first k: the rest repeat the last draft, one-hot where the
    drafter sampled, with no confidence. No verify reads them (each window verifies at most k)."""
    k = drafts.tokens.shape[1]
    if k >= gamma:
        return drafts
    tail = drafts.tokens[:, -1:].expand(-1, gamma - k)
    probs = drafts.probs
    if probs is not None:
        probs = torch.cat([probs, torch.nn.functional.one_hot(tail, probs.shape[-1]).to(probs.dtype)], 1)
    confidence = drafts.confidence
    if confidence is not None:
        confidence = torch.cat([confidence, confidence.new_zeros(confidence.shape[0], gamma - k)], 1)
    return Drafts(torch.cat([drafts.tokens, tail], 1), probs, confidence)


def make_worker(ctx: DraftContext) -> DsparkWorker:
    """The drafter the builder loaded, over its own K/V at the target's token slots; the drafting
    block's K/V (models/dspark_native.py) for as many requests as the request table holds (the
    cost warm-up drafts for up to that many, at least 2). Committed rows are injected deferred
    under the adaptive policy, unless the host tier copies the pools too."""
    drafter, args = ctx.target.drafter, ctx.args
    dc = drafter.config
    block_rows = max(2, args.max_running_requests + 1) * dc.block_size
    kv = KVPool(ctx.size, dc.num_layers, dc.num_kv_heads, dc.head_dim, ctx.dtype, ctx.device, block_rows)
    defer = args.speculative_policy == "adaptive" and not args.enable_hierarchical_cache
    return DsparkWorker(drafter, kv, ctx.req_to_token, DEFERRED_ROWS if defer else 0)
