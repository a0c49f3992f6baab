"""FutureMap: what the last launched step left for the next one, indexed by request slot.

With the overlap loop the scheduler launches step N+1 before it has processed step N's results,
so step N+1 cannot take its anchors and sequence lengths from the host. Every decode or verify
step reads them here, on the forward stream, and writes its own results back by value (never
by keeping a view of a persistent buffer). Both loops use it, so they compute the same thing.
"""

from __future__ import annotations

from typing import Any

import torch


class FutureMap:
    """Per request slot: the next anchor token, the committed length and the output length."""

    def __init__(self, max_reqs: int, device: str | torch.device = "cpu"):
        i64: dict[str, Any] = dict(dtype=torch.int64, device=device)
        self.tokens = torch.zeros(max_reqs, **i64)  # the last committed token: the next anchor
        self.seq_lens = torch.zeros(max_reqs, **i64)  # tokens whose KV is in the cache
        self.out_lens = torch.zeros(max_reqs, **i64)  # output tokens so far (sampling counters)

    def read(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Owned copies (advanced indexing copies) of anchors, prefix lengths and output lengths."""
        return self.tokens[rows], self.seq_lens[rows], self.out_lens[rows]

    def write(self, rows: torch.Tensor, tokens: torch.Tensor, seq_lens: torch.Tensor, out_lens: torch.Tensor) -> None:
        """Store values (index_copy_ copies; nothing here aliases the caller's tensors)."""
        self.tokens.index_copy_(0, rows, tokens.long())
        self.seq_lens.index_copy_(0, rows, seq_lens.long())
        self.out_lens.index_copy_(0, rows, out_lens.long())
