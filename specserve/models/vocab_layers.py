"""The layers split by vocabulary row across TP ranks: the token embedding and the LM head (each
rank holds its rows; a GGUF's codes are packed for the CPU kernels, a tied head's shared with the
embedding)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from specserve.kernels.linear import PackedLinear
from specserve.models.layers import TPContext, _ParallelLinear, release
from specserve.models.quant import QuantSource


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split across ranks; lookups are all-reduced. On the CPU
    kernels a GGUF-quantized table is read from its codes (`table`: its own packed codes, or the
    tied LM head's), so no dequantized copy stays in memory."""

    def __init__(self, vocab_size: int, dim: int, tp: TPContext, dtype: torch.dtype, scale: float = 1.0):
        super().__init__()
        self.tp = tp
        self.start, part = tp.shard(vocab_size)
        self.weight = nn.Parameter(torch.empty(part, dim, dtype=dtype), requires_grad=False)
        self.scale = scale  # gemma3 scales its embeddings by sqrt(hidden), in the model dtype
        self.table: Optional[PackedLinear] = None
        self._quant: Optional[QuantSource] = None

    def load(self, weight: torch.Tensor) -> None:
        self.weight.data.copy_(weight[self.start : self.start + self.weight.shape[0]])

    def load_quantized(self, weight: QuantSource) -> None:
        """This rank's rows of the GGUF codes, read when packed for CPU (then looked up in them)."""
        rows = slice(self.start, self.start + self.weight.shape[0])  # now: the weight is released before packing
        self._quant = lambda: weight().rows(rows)

    @property
    def has_codes(self) -> bool:
        """Whether GGUF codes were loaded (pack_for_cpu reads rows from them)."""
        return self._quant is not None

    def pack_for_cpu(self) -> None:
        if self._quant is not None:
            self.use_packed(self._quant().packed())

    def packed_state(self) -> Optional[PackedLinear]:  # what models/packed_cache.py keeps
        return self.table

    def use_packed(self, kernel: PackedLinear) -> None:  # packed here or mapped from the cache
        self.read_from(kernel)
        self._quant = None

    def read_from(self, table: PackedLinear) -> None:
        """Look rows up in a packed weight of this rank's rows (e.g. the tied head's) from now on."""
        self.table, self.weight = table, release(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._scaled(self._rows(ids))
        local = ids - self.start
        outside = (local < 0) | (local >= self._part)
        out = self._rows(local.masked_fill(outside, 0))
        return self._scaled(self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0)))

    @property
    def _part(self) -> int:
        return self.table.n if self.table is not None else self.weight.shape[0]

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            return F.embedding(ids, self.weight)
        if self.weight.dtype == torch.bfloat16:  # one kernel call, where dense_rows costs a dozen ops
            return self.table.bf16_rows(ids.reshape(-1)).view(*ids.shape, self.table.k)
        return self.table.dense_rows(ids.reshape(-1)).to(self.weight.dtype).view(*ids.shape, self.table.k)

    def _scaled(self, rows: torch.Tensor) -> torch.Tensor:
        return rows if self.scale == 1.0 else rows * torch.tensor(self.scale, dtype=rows.dtype)


class ParallelLMHead(_ParallelLinear):
    """LM head with vocabulary rows split across ranks; logits are gathered to full width in float32."""

    def __init__(self, vocab_size: int, dim: int, tp: TPContext, dtype: torch.dtype):
        _, part = tp.shard(vocab_size)
        super().__init__(dim, part, False, tp, dtype)
        self.start = tp.rank * part

    def load(self, weight: torch.Tensor) -> None:
        self.weight.data.copy_(weight[self.start : self.start + self.weight.shape[0]])

    def load_quantized(self, weight: QuantSource) -> None:
        """This rank's vocabulary rows of the GGUF output (or tied embedding) codes, read when packed for CPU."""
        rows = slice(self.start, self.start + self.weight.shape[0])  # now: the weight is released before packing
        self._quant = lambda: weight().rows(rows)

    def rows(self, index: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Rows `index` of this rank's head weight [len(index), H] in `dtype` (default: the model's;
        from the packed codes once the dequantized weight is dropped, where float32 is exact)."""
        if self.weight.numel() or self.kernel is None:
            return self.weight.detach()[index].to(dtype or self.weight.dtype)
        return self.kernel.dense_rows(index).to(dtype or self.weight.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.matmul(hidden, torch.float32)
        if self.tp.size == 1:
            return logits
        return torch.cat(self.tp.all_gather(logits), dim=-1)
