"""Building blocks of the decoder: RMSNorm, RoPE and linear layers ready for tensor parallelism.

Column-parallel layers shard output features, row-parallel layers shard input features and
all-reduce their partial sums; with tp_size == 1 they are plain linears. Each layer takes the
full unsharded weight in `load()` and keeps only its own shard, so the loader stays TP-agnostic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from specserve.errors import ConfigError
from specserve.kernels.linear import PackedLinear, pack_bf16
from specserve.models.quant import Q8Weight, QuantSource, concat_rows


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

    def chain(self, partial: Callable[[Optional[torch.Tensor]], torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """Float32 sums over a dimension split across ranks, run as one chain in rank order: rank r
        continues rank r-1's sums (`partial(init)`, None on rank 0) and broadcasts them, so every rank
        ends with the sums the unsplit layer forms, bit for bit (an all-reduce would add the ranks'
        partial sums in another order than one rank's kernel). The ranks' shares run one after another."""
        carried: Optional[torch.Tensor] = None
        for src in range(self.size):
            if src == self.rank:
                carried = partial(carried).contiguous()
            elif carried is None:
                carried = torch.empty(shape, dtype=torch.float32)
            self.group.broadcast_(carried, "model.row_parallel_chain", src=src, on_model_group=True)
        assert carried is not None, "size >= 1: some rank ran its share"
        return carried

    def shard(self, full: int) -> tuple[int, int]:
        if full % self.size:
            raise ConfigError(f"tp_size: {full} is not divisible by tp_size={self.size}")
        part = full // self.size
        return self.rank * part, part

    def split(self, units: int) -> tuple[int, int]:
        """(first unit, units) of this rank when `units` (e.g. KV heads) are dealt out as evenly
        as possible: SmolLM2's 3 KV heads over 2 ranks give 2 and 1."""
        if units < self.size:
            raise ConfigError(f"tp_size: {units} heads cannot be split over tp_size={self.size} ranks")
        base, extra = divmod(units, self.size)
        return self.rank * base + min(self.rank, extra), base + (self.rank < extra)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as the reference models do."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Stock torch (training); the model graphs go through their backend's add_rms_norm."""
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Linear(nn.Linear):
    """nn.Linear that, once packed by the CPU kernel backend (bf16 inference), runs through the bf16
    kernel of specserve/kernels, whose per-row result does not depend on the row count (the drafter's)."""

    kernel: Optional[PackedLinear] = None
    q8_weights: bool = False  # packed as ggml Q8_0 codes rather than bf16 (DsparkDrafter.quantize_weights)

    def pack_for_cpu(self) -> None:
        if self.weight.numel() == 0:  # packed before, its weight released
            return
        if self.q8_weights and self.in_features % 32 == 0:
            self.kernel = Q8Weight.from_dense(self.weight).packed()
            self.weight = release(self.weight)
        else:
            self.kernel = pack_bf16(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            y = self.kernel(x)
            return y if self.bias is None else y + self.bias
        return super().forward(x)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table indexed by absolute position; frequency i
    divided by freq_factors[i] and the table multiplied by attention_factor when the model scales
    its RoPE.

    `lazy` tables start with one chunk of positions and grow by whole chunks as `cover` asks (up
    to max_positions): a 32k-context model with 256-wide heads would otherwise hold 64 MB of
    tables from the start. Lazy or not, every chunk is computed alone at full size, so a
    position's values do not depend on when (or whether lazily) its chunk was made."""

    CHUNK = 4096  # positions per chunk

    cos: torch.Tensor  # buffers [positions covered, head_dim / 2]
    sin: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        freq_factors: Optional[tuple[float, ...]] = None,
        lazy: bool = False,
        attention_factor: float = 1.0,
    ):
        super().__init__()
        self.attention_factor = attention_factor  # every cos and sin times this (YaRN's magnitude)
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if freq_factors is not None:  # RoPE scaling (models/rope_scaling.py)
            inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float64)
        self.inv_freq, self.max_positions = inv_freq, max_positions
        rows = min(max_positions, self.CHUNK) if lazy else max_positions
        cos, sin = self._table(0, rows)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _table(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows start..end-1, chunk by chunk (start a multiple of CHUNK): each chunk's cos and sin
        computed on their own, so its values are the same whichever call makes it."""
        cos, sin = [], []
        for a in range(start, end, self.CHUNK):
            angles = torch.outer(torch.arange(a, a + self.CHUNK, dtype=torch.float64), self.inv_freq)
            cos.append((angles.cos() * self.attention_factor).float()[: end - a])
            sin.append((angles.sin() * self.attention_factor).float()[: end - a])
        empty = torch.empty(0, self.inv_freq.numel())
        return torch.cat(cos) if cos else empty, torch.cat(sin) if sin else empty

    def cover(self, positions: int) -> None:
        """Grow the tables (by whole chunks, at most to max_positions) to hold positions 0..positions-1."""
        have = self.cos.shape[0]
        if positions <= have or have >= self.max_positions:
            return
        end = min(self.max_positions, -(-positions // self.CHUNK) * self.CHUNK)
        cos, sin = self._table(have, end)
        self.cos = torch.cat([self.cos, cos.to(self.cos.device)])
        self.sin = torch.cat([self.sin, sin.to(self.sin.device)])

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for one forward pass ([T, 1, D/2] each, in the model dtype as the reference models
        use them), looked up once and shared by all layers."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [T, heads, D]; q and k heads can go through in one call."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class _ParallelLinear(nn.Module):
    """A linear layer's weight and, in bf16 on CPU, its packed form for specserve's kernels.

    In bf16 on CPU every row count goes through one kernel family with a fixed per-row operation
    order (specserve/kernels), so a token's result never depends on the batch, the chunk or the
    verify window: the GGUF's own Q4/Q8 codes when loaded, else the bf16 weight. Other dtypes and
    devices use F.linear.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.kernel: Optional[PackedLinear] = None
        # this rank's GGUF codes, read from the file only when pack_for_cpu packs them
        self._quant: Optional[QuantSource] = None

    @property
    def has_codes(self) -> bool:
        """Whether GGUF codes were loaded (pack_for_cpu packs them, not the dense weight)."""
        return self._quant is not None

    def pack_for_cpu(self) -> None:
        """Pack for the CPU kernels after load() (the CPU kernel backend calls it). A layer packed
        from GGUF codes drops its dequantized weight: the kernels compute from the codes, read from
        the file here and dropped once packed (one weight's unpacked codes at a time)."""
        if self._quant is not None:
            self.use_packed(self._quant().packed())
        else:
            self.kernel = pack_bf16(self.weight)

    def packed_state(self) -> Optional[PackedLinear]:  # what models/packed_cache.py keeps
        return self.kernel

    def use_packed(self, kernel: PackedLinear) -> None:
        """Take a packed weight (packed here or mapped from the cache) as packing leaves the layer."""
        if self._quant is not None:  # from codes: the dense stand-in goes
            self.weight = release(self.weight)
        self.kernel, self._quant = kernel, None

    def matmul(self, x: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """x W^T (no bias) in out_dtype (default: x's dtype)."""
        if self.kernel is not None:
            return self.kernel(x, out_dtype or x.dtype)
        y = F.linear(x, self.weight)
        return y if out_dtype is None else y.to(out_dtype)


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T with W's output rows split across ranks; the output stays sharded. `ranges`
    gives each fused part's (start, rows) on this rank (default: an even split)."""

    def __init__(
        self,
        in_features: int,
        out_sizes: list[int],
        bias: bool,
        tp: TPContext,
        dtype: torch.dtype,
        ranges: Optional[list[tuple[int, int]]] = None,
    ):
        self.ranges = ranges or [tp.shard(n) for n in out_sizes]
        self.out_sizes = [part for _, part in self.ranges]
        super().__init__(in_features, sum(self.out_sizes), bias, tp, dtype)

    def load(self, weights: list[torch.Tensor], biases: Optional[list[torch.Tensor]] = None) -> None:
        """Take full weights of each fused part (e.g. q, k, v) and keep this rank's rows of each."""
        self.weight.data.copy_(torch.cat([self._rows(w, r) for w, r in zip(weights, self.ranges)]))
        if biases is not None:
            self.load_bias(biases)

    def load_bias(self, biases: list[torch.Tensor]) -> None:
        """This rank's rows of each fused part's bias (a layer with codes may skip load())."""
        if self.bias is not None:
            self.bias.data.copy_(torch.cat([self._rows(b, r) for b, r in zip(biases, self.ranges)]))

    def load_quantized(self, parts: list[QuantSource]) -> None:
        """Read this rank's rows of each fused part's GGUF codes when the layer is packed for CPU;
        parts of different GGUF types share the layout that holds them all (quant.concat_rows)."""
        self._quant = lambda: concat_rows([self._rows(p(), r) for p, r in zip(parts, self.ranges)])

    @staticmethod
    def _rows(w, rows: tuple[int, int]):
        start, part = rows
        return w[start : start + part] if isinstance(w, torch.Tensor) else w.rows(slice(start, start + part))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias


class RowParallelLinear(_ParallelLinear):
    """y = x W^T with W's input columns split across ranks; partial sums are all-reduced."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPContext,
        dtype: torch.dtype,
        cols: Optional[tuple[int, int]] = None,
    ):
        self.cols = cols or tp.shard(in_features)  # (start, count) of this rank's input columns
        super().__init__(self.cols[1], out_features, bias, tp, dtype)

    def load(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        start, part = self.cols
        self.weight.data.copy_(weight[:, start : start + part])
        if self.bias is not None and bias is not None:
            self.bias.data.copy_(bias)

    def load_quantized(self, weight: QuantSource) -> None:
        """Read this rank's input columns of the GGUF codes when the layer is packed for CPU."""
        self._quant = lambda: weight().cols(*self.cols)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Bias is added once, after the reduction, so it is not counted tp_size times.
        y = self._chained(x) if self.kernel is not None and self.tp.size > 1 else self.tp.all_reduce(self.matmul(x))
        return y if self.bias is None else y + self.bias

    def _chained(self, x: torch.Tensor) -> torch.Tensor:
        """specserve's kernels under TP: the shards' sums as one chain (TPContext.chain), rounded to
        bf16 once as the kernel rounds its own output, so TP N computes what TP 1 computes."""
        flat = x.reshape(-1, x.shape[-1])
        kernel = self.kernel
        assert kernel is not None, "forward() chains only with a kernel"
        sums = self.tp.chain(
            lambda init: kernel(flat, torch.float32) if init is None else kernel.continue_sums(flat, init),
            (flat.shape[0], kernel.n),
        )
        return round_to_bf16_like_kernels(sums).view(*x.shape[:-1], kernel.n)


def release(weight: torch.Tensor) -> nn.Parameter:
    """An empty stand-in (same dtype and device) for a weight whose packed form replaces it."""
    return nn.Parameter(weight.new_empty(0), requires_grad=False)


def round_to_bf16_like_kernels(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bf16 as the kernels store it (csrc/simd.h f32_to_bf16): round to nearest even,
    with float32 subnormals flushed to signed zero first."""
    return torch.where(x.abs() < torch.finfo(torch.float32).tiny, x * 0.0, x).to(torch.bfloat16)
