"""KV memory: request slots, token slots and the per-layer K/V tensors.

Token slot 0 is reserved as a scratch slot: padded rows of a batch write their K/V there and
padded attention columns read it, so no real slot is ever touched by padding.
"""

from __future__ import annotations

import math
import mmap
from array import array

import torch

from specserve.errors import ConfigError


class TokenSlotAllocator:
    """Free list over token slots 1..size (slot 0 is the scratch slot)."""

    def __init__(self, size: int):
        if size < 1:
            raise ConfigError(f"max_total_tokens: KV pool must hold at least 1 token, got {size}")
        self.size = size
        # 8 bytes a slot, where a list of ints costs 36 (hundreds of thousands of slots: megabytes).
        self._free = array("q", range(1, size + 1))

    @property
    def available(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n fresh slots, or None when fewer are free (the caller evicts or retracts)."""
        if n > len(self._free):
            return None
        taken = self._free[len(self._free) - n :].tolist()
        del self._free[len(self._free) - n :]
        return taken

    def free(self, slots: list[int]) -> None:
        self._free.extend(slots)

    def check_no_duplicates(self) -> None:
        if len(set(self._free)) != len(self._free):
            raise AssertionError("allocator: a token slot is on the free list twice (double free)")


class ReqToTokenPool:
    """Table request slot -> token slots of its KV, read by attention to gather K/V."""

    def __init__(self, max_reqs: int, max_context: int, device: str = "cpu", stream=None):
        shape = (max_reqs, max_context)
        # Rows are written only as far as their requests reach: on CPU only those pages become resident.
        self.table = (
            zeros_on_touch(shape, torch.int64) if device == "cpu" else torch.zeros(shape, dtype=torch.int64, device=device)
        )
        self.max_context = max_context
        self._free = list(range(max_reqs - 1, -1, -1))
        # The table is device state read by steps on the forward stream; with the overlap loop the
        # host schedules step N+1 while step N runs, so its writes go through that stream, in order.
        self.stream = stream

    @property
    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, idx: int) -> None:
        self._free.append(idx)

    def write(self, idx: int, start: int, slots: list[int]) -> None:
        if not slots:
            return
        values = torch.tensor(slots, dtype=torch.int64, device=self.table.device)
        if self.stream is None:
            self.table[idx, start : start + len(slots)] = values
        else:
            self.stream.submit(self._write, idx, start, values)

    def _write(self, idx: int, start: int, values: torch.Tensor) -> None:
        self.table[idx, start : start + values.shape[0]] = values


def zeros_on_touch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros over an anonymous mapping: the OS gives each page its memory when it is
    first written (reads of an untouched page see zeros), where torch.zeros writes every page now."""
    count = math.prod(shape)
    if count == 0:  # frombuffer needs at least one element
        return torch.zeros(shape, dtype=dtype)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # private: a read of an untouched page maps the zero page
    pages = mmap.mmap(-1, max(1, count * dtype.itemsize), flags=flags)  # the tensor keeps the mapping alive
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)


class KVPool:
    """Per-layer K and V tensors [size + 1 + block_rows, kv_heads, head_dim]; row 0 is the scratch
    slot. The last `block_rows` rows belong to no token slot: a DSpark drafter's block keeps its
    own K/V there while it drafts (`block_slots`), read by nothing else."""

    def __init__(
        self,
        size: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str = "cpu",
        block_rows: int = 0,
    ):
        shape = (size + 1 + block_rows, kv_heads, head_dim)
        # Zeroed, not empty: masked attention multiplies padded columns by 0 and 0 * NaN is NaN.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.size = size
        self.block_rows = block_rows

    def block_slots(self, n: int) -> torch.Tensor | None:
        """The first n rows past the token slots (None when the pool has fewer than n)."""
        if n > self.block_rows:
            return None
        return torch.arange(self.size + 1, self.size + 1 + n, device=self.k[0].device if self.k else "cpu")

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer][slots] = k
        self.v[layer][slots] = v
