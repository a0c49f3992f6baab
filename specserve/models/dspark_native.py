"""The DSpark drafter's drafting pass on the CPU kernels in a few native calls, where the per-op
pass (DsparkDrafter.block_hidden and markov_decode on CpuKernelOps) dispatches about forty ops.

The block: each draft layer runs as one csrc DecoderLayer call (the target's native layer) over
the block's rows. The block's own K/V go to pool rows past the token slots (`KVPool.block_slots`),
and the pass's table lists, per request, its context slots and then those rows, with every block
row seeing all S + g positions: DraftLayer.forward's bidirectional block attention, through the
paged attention kernel. Its numerics are the kernels' (RoPE in float32, the kernel's softmax),
not the per-op pass's (bf16 RoPE, SDPA): drafts can differ where two tokens nearly tie.

The greedy Markov head runs as one call (csrc/markov.cpp) that computes what markov_decode's
loop computes, bit for bit.

This module knows no drafter class (models/dspark.py imports it): each draft layer builds its own
C++ twin (DraftLayer.native, as the target's layers do for models/native_layer.py), and the drafter
hands each call what it reads: its embedded block, its RoPE tables, its Markov head's W1 rows.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch

from specserve.kernels.build import load
from specserve.kernels.dispatch import path_id
from specserve.kernels.linear import PackedLinear
from specserve.kv.pool import KVPool
from specserve.models.layers import RotaryEmbedding

logger = logging.getLogger(__name__)


def block_row_lens(prefix_lens: torch.Tensor, g: int) -> torch.Tensor:
    """Positions each block row sees: its request's S context positions and the whole block."""
    return (prefix_lens.long() + g).repeat_interleave(g)


class NativeDraftBlock:
    """A drafter's layers as native calls, and its greedy Markov head as one (`build`)."""

    def __init__(self, layers: list[Any], markov_w2: Optional[PackedLinear]):
        self.layers = layers
        self.markov_w2 = None if markov_w2 is None else markov_w2.native()
        self.warned = False

    @classmethod
    def build(cls, layers: Sequence[Optional[Any]], markov_w2: Optional[PackedLinear]) -> Optional["NativeDraftBlock"]:
        """From the draft layers' C++ twins (DraftLayer.native: None where a layer's linears do not
        fuse, and then no layer runs natively) and the Markov head's packed W2."""
        if any(layer is None for layer in layers):
            return None
        return cls(list(layers), markov_w2)

    def block_rows(self, kv: KVPool, bs: int, g: int) -> Optional[torch.Tensor]:
        """The pool rows the blocks of bs requests use, or None (warning once) when the pool has too few."""
        rows = kv.block_slots(bs * g)
        if rows is None and not self.warned:  # drafts then come from the per-op pass, whose numerics differ
            logger.warning(
                "DSpark drafting op by op: %d requests need %d block rows, the pool has %d", bs, bs * g, kv.block_rows
            )
            self.warned = True
        return rows

    def layers_out(
        self,
        residual: torch.Tensor,
        prefix_lens: torch.Tensor,
        ctx_slots: torch.Tensor,
        kv: KVPool,
        rows: torch.Tensor,
        rope: RotaryEmbedding,
    ) -> torch.Tensor:
        """Every draft layer over the blocks' embedded rows `residual` [bs * g, H] (request r's block
        at positions S_r..S_r+g-1, its K/V in `rows`, each row seeing its context slots and the whole
        block): the last layer's output, `residual` updated in place as the per-op layers update theirs."""
        bs = prefix_lens.shape[0]
        g = residual.shape[0] // bs
        positions = (prefix_lens.long().unsqueeze(1) + torch.arange(g)).reshape(-1)
        width = ctx_slots.shape[1]
        table = torch.zeros(bs, width + g, dtype=torch.int64)
        table[:, :width] = ctx_slots
        table.scatter_(1, positions.view(bs, g), rows.view(bs, g))  # the block's rows after each context
        row_req = torch.arange(bs).repeat_interleave(g)
        step = load().LayerStep(positions, rows, table, row_req, block_row_lens(prefix_lens, g), kv.k[0].shape[0], path_id())
        out = None
        for i, layer in enumerate(self.layers):
            out = layer.forward(out, residual, step, kv.k[i], kv.v[i], rope.cos, rope.sin)
        assert out is not None, "a drafter has layers"
        return out

    def markov_greedy(
        self, anchors: torch.Tensor, base_logits: torch.Tensor, markov_w1: torch.Tensor, to_target: Optional[torch.Tensor]
    ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """markov_decode's greedy picks [bs, g] (mapped to target ids by `to_target`, a reduced draft
        vocabulary's) and the W1 rows they came from [bs, g, rank], or None where the head is not
        packed or the base logits are not float32."""
        if self.markov_w2 is None or base_logits.dtype != torch.float32:
            return None
        ids = anchors.long().contiguous()
        return load().markov_greedy(base_logits.contiguous(), markov_w1, self.markov_w2, ids, to_target, path_id())
