"""The ops a model graph calls that have more than one implementation, behind one interface (as
SGLang's CustomOp and mini-sglang's attention backends do): residual add + RMSNorm, RoPE with the
K/V store, the gated MLP activation, paged attention and its metadata, and the drafter's block
attention. Linears dispatch on whether the backend packed them.

- `TorchOps`: stock torch. fp32 anywhere, any dtype on CUDA, torch.compile, and training (autograd).
- `CpuKernelOps`: specserve's C++ kernels (bf16 inference on CPU). Each op computes a row alone in
  one fixed order, so no token depends on the batch, the chunk or the verify window.

`select_backend` chooses one when a model is built; the graphs (models/llama.py, models/dspark.py)
call it and never test a dtype or a device themselves.

A backend knows ops, never a model: a model that has a fused native executor (models/native_layer.py,
models/dspark_native.py) builds it itself where `fuses_layers` says the backend runs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.kernels.linear import PackedLinear
from specserve.kernels.ops import add_rms_norm, gelu_tanh_mul, rope_store, silu_mul
from specserve.models.attention import AttentionMetadata, KernelAttentionMetadata, SdpaAttentionMetadata, block_attention
from specserve.models.heap import release_free_heap
from specserve.models.layers import RMSNorm, RotaryEmbedding, apply_rope

if TYPE_CHECKING:
    from specserve.models.packed_cache import PackedWeightCache


def cpu_kernels_apply(device: "str | torch.device", dtype: torch.dtype) -> bool:
    """The one dispatch predicate: bf16 inference on CPU runs specserve's kernels."""
    return torch.device(device).type == "cpu" and dtype == torch.bfloat16


@runtime_checkable
class _PacksForCpu(Protocol):
    """A module whose weights the CPU kernels read in a packed layout (the linears)."""

    def pack_for_cpu(self) -> None: ...


@runtime_checkable
class _KeepsPacked(Protocol):
    """A packing module whose packed form a cache can keep and give back (models/packed_cache.py)."""

    def packed_state(self) -> Optional[PackedLinear]: ...

    def use_packed(self, kernel: PackedLinear) -> None: ...


def packed_states(module: nn.Module) -> dict[str, PackedLinear]:
    """Every packed weight of a prepared module, by module name."""
    found = {}
    for name, part in module.named_modules():
        state = part.packed_state() if isinstance(part, _KeepsPacked) else None
        if state is not None:
            found[name] = state
    return found


class OpBackend:
    """One implementation of the model graph's ops. `prepare` readies a loaded module's weights."""

    name = "abstract"
    # Whether prepare() packs loaded GGUF codes for its linears (so their dense weights go unread).
    packs_codes = False
    # Whether a prepared model runs its layers as its own fused native calls where it has them (C++
    # twins of its graph: the same kernels in the same order); False: op by op through this backend.
    fuses_layers = False

    def prepare(self, module: nn.Module, cache: Optional[PackedWeightCache] = None) -> None:
        """Ready `module`'s weights (after they are loaded) for this backend's linears; `cache`
        holds packed weights between starts where the backend packs (models/packed_cache.py)."""

    def add_rms_norm(self, x: Optional[torch.Tensor], residual: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """residual += x in place (when x is given, rounded to the dtype as a plain add), then
        RMSNorm(residual). The residual stream stays apart from each block's output, so the add
        folds into the next norm."""
        raise NotImplementedError

    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return self.add_rms_norm(None, x, norm)

    def rope_store(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        heads: int,
        kv_heads: int,
        rope: RotaryEmbedding,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
    ) -> torch.Tensor:
        """Rotate q and k of qkv [T, (heads + 2 kv_heads) * D] at `positions`, store rotated k and v
        at `slots` of the pools; q [T, heads, D]."""
        raise NotImplementedError

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up = [gate | up] along the last dimension."""
        raise NotImplementedError

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up (gemma3), in the model dtype as the reference computes it: elementwise,
        so every row's result is its own on every backend."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def attention_metadata(
        self, table: torch.Tensor, rows: list[int], seq_lens: list[int], extend_lens: list[int], device: "str | torch.device"
    ) -> AttentionMetadata:
        """For requests at table rows `rows` adding `extend_lens` tokens to reach `seq_lens`."""
        raise NotImplementedError

    def window_metadata(
        self,
        table: torch.Tensor,
        rows: torch.Tensor,
        prefix_lens: torch.Tensor,
        valid: torch.Tensor,
        width: int,
        kv_len: int,
    ) -> AttentionMetadata:
        """Every request computes a full window of `width` rows after its prefix (device tensors
        only, no host reads: a CUDA graph can capture it)."""
        raise NotImplementedError

    def block_attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """The drafter's attention (see attention.block_attention)."""
        return block_attention(q, keys, values, mask)


class TorchOps(OpBackend):
    """Stock torch ops in the model's dtype (the reference models' numerics)."""

    name = "torch"

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def add_rms_norm(self, x: Optional[torch.Tensor], residual: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        if x is not None:
            residual.add_(x)
        return F.rms_norm(residual, norm.weight.shape, norm.weight, norm.eps)

    def rope_store(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        heads: int,
        kv_heads: int,
        rope: RotaryEmbedding,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
    ) -> torch.Tensor:
        qkv = qkv.view(qkv.shape[0], heads + 2 * kv_heads, -1)
        cos, sin = rope.cos_sin(positions, qkv.dtype)
        qk = apply_rope(qkv[:, : heads + kv_heads], cos, sin)  # q and k rotated together
        k_pool[slots] = qk[:, heads:]
        v_pool[slots] = qkv[:, heads + kv_heads :]
        return qk[:, :heads]

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def attention_metadata(
        self, table: torch.Tensor, rows: list[int], seq_lens: list[int], extend_lens: list[int], device: "str | torch.device"
    ) -> AttentionMetadata:
        return SdpaAttentionMetadata.build(table, rows, seq_lens, extend_lens, str(device), self.dtype)

    def window_metadata(
        self,
        table: torch.Tensor,
        rows: torch.Tensor,
        prefix_lens: torch.Tensor,
        valid: torch.Tensor,
        width: int,
        kv_len: int,
    ) -> AttentionMetadata:
        return SdpaAttentionMetadata.for_windows(table, rows, prefix_lens, valid, width, kv_len, self.dtype)


# Packing hands the heap's free pages back once the weights packed since the last time reach
# 1/RELEASE_SHARE of all packed so far (at least RELEASE_MIN_BYTES), not after every weight: each
# malloc_trim walks a heap that holds the packed weights, so trimming after each of a 30B mixture's
# 18,000 expert linears cost most of its 9-minute load. What the freed temporaries can hold between
# two trims stays a small share of the model (and a few MiB on a small one).
RELEASE_SHARE = 64
RELEASE_MIN_BYTES = 4 << 20


class CpuKernelOps(OpBackend):
    """specserve's bf16 CPU kernels: Q4/Q8/bf16 linears, the fused small ops and paged attention.
    With `int8_activations`, the linears over quantized weights quantize their input rows to int8
    and compute integer dot products (kernels/csrc/linear_int8.h). A model at TP size 1 runs each
    decoder layer as one native call (models/native_layer.py) unless `per_op_layers`."""

    name = "cpu-kernels"
    packs_codes = True

    def __init__(self, int8_activations: bool = False, per_op_layers: bool = False):
        self.int8_activations = int8_activations
        self.per_op_layers = per_op_layers  # run the decoder layers op by op (the native layers' reference)
        self.fuses_layers = not per_op_layers

    def prepare(self, module: nn.Module, cache: Optional[PackedWeightCache] = None) -> None:
        cached = cache.load() if cache is not None else None
        unreleased = packed_total = 0  # bytes packed since the heap's free pages last went back, and in all
        for name, part in module.named_modules():
            packed_here = False
            if cached is not None and name in cached and isinstance(part, _KeepsPacked):
                part.use_packed(cached[name])  # mapped from the cache: the file's codes go unread
            elif isinstance(part, _PacksForCpu):  # hasattr(part, "pack_for_cpu")
                part.pack_for_cpu()
                packed_here = True
            kernel = getattr(part, "kernel", None)
            if not isinstance(kernel, PackedLinear):
                continue
            kernel.quantize_activations(self.int8_activations or getattr(part, "int8_activations", False))
            if packed_here:
                unreleased, packed_total = unreleased + kernel.nbytes(), packed_total + kernel.nbytes()
                if unreleased >= max(RELEASE_MIN_BYTES, packed_total // RELEASE_SHARE):  # parsed codes, temporaries
                    release_free_heap()
                    unreleased = 0
        release_free_heap()
        if cache is not None and cached is None:
            cache.save_later(packed_states(module))  # the engine builder starts it (engine/builder.py)

    def add_rms_norm(self, x: Optional[torch.Tensor], residual: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        if x is not None:
            return add_rms_norm(x, residual, norm.weight, norm.eps)
        flat = residual.reshape(-1, residual.shape[-1]).contiguous()
        return add_rms_norm(flat, None, norm.weight, norm.eps).view(residual.shape)

    def rope_store(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        heads: int,
        kv_heads: int,
        rope: RotaryEmbedding,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
    ) -> torch.Tensor:
        return rope_store(qkv, rope.cos, rope.sin, positions, slots, heads, kv_heads, k_pool, v_pool)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        flat = gate_up.reshape(-1, gate_up.shape[-1])
        return silu_mul(flat).view(*gate_up.shape[:-1], -1)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        flat = gate_up.reshape(-1, gate_up.shape[-1])
        return gelu_tanh_mul(flat).view(*gate_up.shape[:-1], -1)

    def attention_metadata(
        self, table: torch.Tensor, rows: list[int], seq_lens: list[int], extend_lens: list[int], device: "str | torch.device"
    ) -> AttentionMetadata:
        return KernelAttentionMetadata.build(table, rows, seq_lens, extend_lens, str(device))

    def window_metadata(
        self,
        table: torch.Tensor,
        rows: torch.Tensor,
        prefix_lens: torch.Tensor,
        valid: torch.Tensor,
        width: int,
        kv_len: int,
    ) -> AttentionMetadata:
        return KernelAttentionMetadata.for_windows(table, rows, prefix_lens, valid, width)

    def block_attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Optional[torch.Tensor]
    ) -> torch.Tensor:
        # Each request alone, over its own columns only.
        return torch.cat(
            [
                block_attention(q[b : b + 1], keys[b : b + 1], values[b : b + 1], None if mask is None else mask[b])
                for b in range(q.shape[0])
            ]
        )


def select_backend(
    device: "str | torch.device",
    dtype: torch.dtype,
    stock_ops: bool = False,
    int8_activations: bool = False,
    per_op_layers: bool = False,
) -> OpBackend:
    """The backend a model built on `device` in `dtype` runs (`stock_ops`: torch.compile, which
    traces stock ops only; `int8_activations`, `per_op_layers`: see CpuKernelOps)."""
    if cpu_kernels_apply(device, dtype) and not stock_ops:
        return CpuKernelOps(int8_activations, per_op_layers)
    return TorchOps(dtype)
