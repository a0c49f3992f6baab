"""Building blocks of the decoder: RMSNorm, RoPE and linear layers ready for tensor parallelism.

Column-parallel layers shard output features, row-parallel layers shard input features and
all-reduce their partial sums; with tp_size == 1 they are plain linears. Each layer takes the
full unsharded weight in `load()` and keeps only its own shard, so the loader stays TP-agnostic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from specserve.models.q4 import Q4Weight, int4_matmul


@dataclass(frozen=True)
class TPContext:
    """This process's place in a tensor-parallel group (size 1 means no parallelism).
    `group` is a specserve.distributed.group.TPGroup when size > 1."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            self.group.model_all_reduce_(x)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.group.model_all_gather(x) if self.size > 1 else [x]

    def shard(self, full: int) -> tuple[int, int]:
        if full % self.size:
            raise ValueError(f"tp_size: {full} is not divisible by tp_size={self.size}")
        part = full // self.size
        return self.rank * part, part

    def split(self, units: int) -> tuple[int, int]:
        """(first unit, units) of this rank when `units` (e.g. KV heads) are dealt out as evenly
        as possible: SmolLM2's 3 KV heads over 2 ranks give 2 and 1."""
        if units < self.size:
            raise ValueError(f"tp_size: {units} heads cannot be split over tp_size={self.size} ranks")
        base, extra = divmod(units, self.size)
        return self.rank * base + min(self.rank, extra), base + (self.rank < extra)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as the reference models do."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table indexed by absolute position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for one forward pass ([T, 1, D/2] each, in the model dtype as the reference models
        use them), looked up once and shared by all layers."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [T, heads, D]; q and k heads can go through in one call."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def cpu_weight_packing_available(dtype: torch.dtype) -> bool:
    """oneDNN can pre-pack bf16 weights on this CPU (AVX-512 BF16 / AMX)."""
    return (dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


# Above this many rows the oneDNN bf16 kernel beats the int4 one (measured here: equal at 16-32
# rows, bf16 25% faster at 64-1024 rows, int4 3x faster at 1 row), so prefill takes the bf16 path.
INT4_MAX_ROWS = 32


def matmul(x: torch.Tensor, weight: torch.Tensor, packed: Optional[torch.Tensor], bias: Optional[torch.Tensor] = None,
           int4: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """x W^T (+ b): through 4-bit GGUF weights, else the pre-packed oneDNN weight, else F.linear.

    Eager bf16 F.linear on CPU re-lays out the weight for oneDNN on every call; packing once at
    load time took the 30-layer decode matmuls from about 24 ms to 17 ms here (same results).
    """
    if int4 is not None and (packed is None or x.numel() <= INT4_MAX_ROWS * x.shape[-1]):
        y = int4_matmul(x, *int4)
        return y if bias is None else y + bias
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class _ParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.packed: Optional[torch.Tensor] = None
        self.int4: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._q4: Optional[Q4Weight] = None  # this rank's 4-bit weight, until pack_for_cpu packs it

    def pack_for_cpu(self) -> None:
        """Pack for CPU kernels after load(), bf16 only: 4-bit GGUF weights if loaded, and oneDNN bf16."""
        if self.weight.device.type != "cpu" or self.weight.dtype != torch.bfloat16:
            return
        if self._q4 is not None:
            self.int4, self._q4 = self._q4.pack(), None
        if cpu_weight_packing_available(self.weight.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T with W's output rows split across ranks; the output stays sharded. `ranges`
    gives each fused part's (start, rows) on this rank (default: an even split)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TPContext, dtype: torch.dtype,
                 ranges: Optional[list[tuple[int, int]]] = None):
        self.ranges = ranges or [tp.shard(n) for n in out_sizes]
        self.out_sizes = [part for _, part in self.ranges]
        super().__init__(in_features, sum(self.out_sizes), bias, tp, dtype)

    def load(self, weights: list[torch.Tensor], biases: Optional[list[torch.Tensor]] = None) -> None:
        """Take full weights of each fused part (e.g. q, k, v) and keep this rank's rows of each."""
        self.weight.data.copy_(torch.cat([self._rows(w, r) for w, r in zip(weights, self.ranges)]))
        if self.bias is not None and biases is not None:
            self.bias.data.copy_(torch.cat([self._rows(b, r) for b, r in zip(biases, self.ranges)]))

    def load_q4(self, parts: list[Q4Weight]) -> None:
        """Keep this rank's rows of each fused part's 4-bit weight (used if the layer is packed for CPU)."""
        self._q4 = Q4Weight.cat([self._rows(p, r) for p, r in zip(parts, self.ranges)])

    @staticmethod
    def _rows(w, rows: tuple[int, int]):
        start, part = rows
        return w[start:start + part] if isinstance(w, torch.Tensor) else w.rows(slice(start, start + part))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.weight, self.packed, self.bias, self.int4)


class RowParallelLinear(_ParallelLinear):
    """y = x W^T with W's input columns split across ranks; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext, dtype: torch.dtype,
                 cols: Optional[tuple[int, int]] = None):
        self.cols = cols or tp.shard(in_features)  # (start, count) of this rank's input columns
        super().__init__(self.cols[1], out_features, bias, tp, dtype)

    def load(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        start, part = self.cols
        self.weight.data.copy_(weight[:, start:start + part])
        if self.bias is not None and bias is not None:
            self.bias.data.copy_(bias)

    def load_q4(self, weight: Q4Weight) -> None:
        self._q4 = weight.cols(*self.cols)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Bias is added once, after the reduction, so it is not counted tp_size times.
        y = self.tp.all_reduce(matmul(x, self.weight, self.packed, None, self.int4))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split across ranks; lookups are all-reduced."""

    def __init__(self, vocab_size: int, dim: int, tp: TPContext, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.start, part = tp.shard(vocab_size)
        self.weight = nn.Parameter(torch.empty(part, dim, dtype=dtype), requires_grad=False)

    def load(self, weight: torch.Tensor) -> None:
        self.weight.data.copy_(weight[self.start:self.start + self.weight.shape[0]])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(_ParallelLinear):
    """LM head with vocabulary rows split across ranks; logits are gathered to full width in float32."""

    def __init__(self, vocab_size: int, dim: int, tp: TPContext, dtype: torch.dtype):
        _, part = tp.shard(vocab_size)
        super().__init__(dim, part, False, tp, dtype)
        self.start = tp.rank * part

    def load(self, weight: torch.Tensor) -> None:
        self.weight.data.copy_(weight[self.start:self.start + self.weight.shape[0]])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = matmul(hidden, self.weight, self.packed).float()
        if self.tp.size == 1:
            return logits
        return torch.cat(self.tp.all_gather(logits), dim=-1)
