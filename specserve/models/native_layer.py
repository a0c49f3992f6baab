"""The decoder layers as C++ calls (kernels/csrc/decoder_layer.cpp), for the CPU kernels at TP size
1: the kernels the per-op path (models/llama.py on CpuKernelOps) calls, in its order and on the same
values, so tokens and K/V are bitwise the per-op path's, without Python dispatching about ten calls
per layer. A pass's rows are checked once for every layer (`LayerStep`), and its layers run in one
call (one per run of layers between the outputs the DSpark drafter captures)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence, cast

import torch

from specserve.kernels.build import load
from specserve.kernels.dispatch import path_id
from specserve.kernels.linear import PackedLinear
from specserve.kv.pool import KVPool
from specserve.models.attention import KernelAttentionMetadata
from specserve.models.layers import RotaryEmbedding

if TYPE_CHECKING:
    from specserve.models.forward_batch import ForwardBatch


class NativeTwin(Protocol):
    """A layer that builds its own C++ twin (LlamaDecoderLayer.native): this module runs the twins
    and knows no model class, so the models import it and never the other way round."""

    def native(self) -> Any: ...


def native_linear(kernel: Optional[PackedLinear]) -> Any:
    """The kernels' view of a layer's packed weight (PackedLinear.native)."""
    assert kernel is not None, "native layers are built from packed linears"
    return kernel.native()


class NativeLayers:
    """A model's decoder layers as C++ calls; `run` runs one pass through them."""

    def __init__(self, layers: list[Any]):
        self.layers = layers

    @classmethod
    def build(cls, decoder_layers: Sequence[Any]) -> "NativeLayers":
        """From the decoder layers (NativeTwin: LlamaDecoderLayer) of a model packed for the CPU kernels."""
        return cls([cast(NativeTwin, layer).native() for layer in decoder_layers])

    @staticmethod
    def applies(fb: "ForwardBatch") -> bool:
        """Whether a pass can run natively (the kernels' attention metadata)."""
        return isinstance(fb.attn, KernelAttentionMetadata)

    def step(self, fb: "ForwardBatch", kv: KVPool) -> Any:
        """The pass's rows, checked once for every layer."""
        meta = fb.attn
        assert isinstance(meta, KernelAttentionMetadata), "applies(fb) first"
        return load().LayerStep(
            fb.positions.contiguous(), fb.out_cache_loc.contiguous(), meta.table, meta.row_req.contiguous(),
            meta.row_len.contiguous(), kv.k[0].shape[0], path_id(),
        )  # fmt: skip

    def forward(
        self, fb: "ForwardBatch", kv: KVPool, residual: torch.Tensor, rope: RotaryEmbedding, rope_local: RotaryEmbedding
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Every layer on the pass in one C++ call: the last layer's MLP output (residual updated in
        place, as LlamaDecoderLayer.forward), and `out + residual` after each layer in
        `fb.capture_layer_ids`, in layer order, side by side in one [rows, captured x H] tensor
        (None without captured layers)."""
        capture = sorted({i for i in fb.capture_layer_ids if 0 <= i < len(self.layers)})
        captured = residual.new_empty(residual.shape[0], len(capture) * residual.shape[1]) if capture else None
        out = load().forward_layers(
            self.layers, None, residual, self.step(fb, kv), kv.k, kv.v,
            rope.cos, rope.sin, rope_local.cos, rope_local.sin, capture, captured,
        )  # fmt: skip
        return out, captured
