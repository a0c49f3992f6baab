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
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional, Protocol

import torch
from torch import nn

from specserve.kernels.build import load
from specserve.kernels.dispatch import path_id
from specserve.kernels.linear import PackedLinear, concat_columns
from specserve.kv.pool import KVPool
from specserve.models.backend import OpBackend
from specserve.models.layers import Linear, RMSNorm, RotaryEmbedding
from specserve.runtime.host_waits import device_code

logger = logging.getLogger(__name__)


# The drafter's parts this pass reads, as structural types: models/dspark.py builds the pass and
# imports this module, so this module names no drafter class (an import either way is a cycle).
class DraftLayerParts(Protocol):
    """What a draft layer (dspark.DraftLayer) shows the native pass."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear


class _MaskId(Protocol):
    @property
    def mask_token_id(self) -> int: ...


class DrafterParts(Protocol):
    """What a drafter (dspark.DsparkDrafter) shows the native pass (read-only, so covariant)."""

    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def block_size(self) -> int: ...
    @property
    def reduced_vocab(self) -> bool: ...
    @property
    def config(self) -> _MaskId: ...
    @property
    def layers(self) -> nn.ModuleList: ...
    @property
    def embed(self) -> Optional[Callable[[torch.Tensor], torch.Tensor]]: ...
    @property
    def rope(self) -> RotaryEmbedding: ...
    @property
    def ops(self) -> OpBackend: ...
    @property
    def norm(self) -> RMSNorm: ...
    @property
    def markov_w1(self) -> nn.Embedding: ...
    @property
    def markov_w2(self) -> Linear: ...
    @property
    def draft_to_target(self) -> torch.Tensor: ...


def _native_layer(layer: DraftLayerParts) -> Optional[Any]:
    """The csrc DecoderLayer of one draft layer (its QKV and gate/up fused), or None when its
    linears do not fuse (not all packed, or not whole 16-column blocks)."""
    kernels = [lin.kernel for lin in (layer.q_proj, layer.k_proj, layer.v_proj, layer.gate_proj, layer.up_proj)]
    o, down = layer.o_proj.kernel, layer.down_proj.kernel
    if o is None or down is None or any(k is None for k in kernels):
        return None
    qkv = concat_columns([k for k in kernels[:3] if k is not None])
    gate_up = concat_columns([k for k in kernels[3:] if k is not None])
    if qkv is None or gate_up is None:
        return None
    norms = [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(), None, None, None, None]
    eps = {layer.input_layernorm.eps, layer.post_attention_layernorm.eps}
    if len(eps) != 1:
        return None
    return load().DecoderLayer(
        qkv.native(), None, o.native(), gate_up.native(), down.native(), None, norms, layer.num_heads, layer.num_kv_heads,
        layer.head_dim, layer.head_dim**-0.5, 0, False, eps.pop(),
    )  # fmt: skip


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
    def build(cls, drafter: DrafterParts) -> Optional["NativeDraftBlock"]:
        """From a drafter packed for the CPU kernels in bf16 (after ops.prepare), else None."""
        if drafter.dtype != torch.bfloat16:
            return None
        draft_layers: Iterable[Any] = drafter.layers  # DraftLayer modules: DraftLayerParts
        layers = [_native_layer(layer) for layer in draft_layers]
        if any(layer is None for layer in layers):
            return None
        return cls(layers, drafter.markov_w2.kernel)

    def hidden(
        self, drafter: DrafterParts, anchors: torch.Tensor, prefix_lens: torch.Tensor, ctx_slots: torch.Tensor, kv: KVPool
    ) -> Optional[torch.Tensor]:
        """DsparkDrafter.block_hidden through the native layers, or None when the pool has too few
        block rows for this batch."""
        bs, g = anchors.shape[0], drafter.block_size
        rows = kv.block_slots(bs * g)
        if drafter.embed is None:
            return None  # not attached: the per-op pass says so
        if rows is None:
            if not self.warned:  # drafts then come from the per-op pass, whose numerics differ
                logger.warning(
                    "DSpark drafting op by op: %d requests need %d block rows, the pool has %d", bs, bs * g, kv.block_rows
                )
                self.warned = True
            return None
        with device_code():  # a CPU kernel's own inputs (this path exists on CPU alone)
            return self._hidden(drafter, anchors, prefix_lens, ctx_slots, kv, rows)

    def _hidden(
        self,
        drafter: DrafterParts,
        anchors: torch.Tensor,
        prefix_lens: torch.Tensor,
        ctx_slots: torch.Tensor,
        kv: KVPool,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        bs, g = anchors.shape[0], drafter.block_size
        ids = torch.full((bs, g), drafter.config.mask_token_id, dtype=torch.int64)
        ids[:, 0] = anchors
        assert drafter.embed is not None, "hidden() returns None before attach"
        residual = drafter.embed(ids.reshape(-1)).to(drafter.dtype).contiguous().clone()
        positions = (prefix_lens.long().unsqueeze(1) + torch.arange(g)).reshape(-1)
        width = ctx_slots.shape[1]
        table = torch.zeros(bs, width + g, dtype=torch.int64)
        table[:, :width] = ctx_slots
        table.scatter_(1, positions.view(bs, g), rows.view(bs, g))  # the block's rows after each context
        row_req = torch.arange(bs).repeat_interleave(g)
        step = load().LayerStep(positions, rows, table, row_req, block_row_lens(prefix_lens, g), kv.k[0].shape[0], path_id())
        out = None
        for i, layer in enumerate(self.layers):
            out = layer.forward(out, residual, step, kv.k[i], kv.v[i], drafter.rope.cos, drafter.rope.sin)
        return drafter.ops.add_rms_norm(out, residual, drafter.norm).view(bs, g, -1)

    def markov_greedy(
        self, drafter: DrafterParts, anchors: torch.Tensor, base_logits: torch.Tensor
    ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """markov_decode's greedy picks [bs, g] and the W1 rows they came from [bs, g, rank], or
        None where the head is not packed or the base logits are not float32."""
        if self.markov_w2 is None or base_logits.dtype != torch.float32:
            return None
        to_target = drafter.draft_to_target if drafter.reduced_vocab else None
        w1 = drafter.markov_w1.weight.detach()
        ids = anchors.long().contiguous()
        return load().markov_greedy(base_logits.contiguous(), w1, self.markov_w2, ids, to_target, path_id())
