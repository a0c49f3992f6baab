"""NGRAM: model-free drafts by suffix match over the request's own tokens (prompt lookup)."""

from __future__ import annotations

import torch

from specserve.kv.pool import KVPool
from specserve.speculative.worker import CommittedRows, DraftInput, Drafts


class NgramDrafter:
    """Proposes the tokens that followed the latest earlier occurrence of the current suffix.

    Tries suffixes of max_ngram tokens down to min_ngram; with no match it repeats the last
    token, a cheap guess that costs nothing extra since the verify window has a fixed width.
    """

    def __init__(self, gamma: int, max_ngram: int = 4, min_ngram: int = 1, max_lookback: int = 2048):
        if gamma < 1:
            raise ValueError(f"speculative_dspark_block_size: must be >= 1, got {gamma}")
        self.gamma = gamma
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_lookback = max_lookback

    def propose(self, tokens: list[int]) -> list[int]:
        window = tokens[-self.max_lookback:]
        for n in range(min(self.max_ngram, len(window) - 1), self.min_ngram - 1, -1):
            suffix = window[-n:]
            # Latest earlier occurrence whose continuation is inside the window.
            for start in range(len(window) - n - 1, -1, -1):
                if window[start:start + n] == suffix:
                    follow = window[start + n:start + n + self.gamma]
                    return follow + [follow[-1]] * (self.gamma - len(follow))
        return [window[-1]] * self.gamma


class NgramWorker:
    """The NGRAM drafter behind the worker seam: it keeps each request slot's committed tokens
    (prompt and outputs, as the forward stream commits them) and drafts from them."""

    name = "NGRAM"
    reads_tokens = True
    capture_layer_ids: tuple[int, ...] = ()
    kv_pools: list[KVPool] = []

    def __init__(self, gamma: int):
        self.drafter = NgramDrafter(gamma)
        self.histories: dict[int, list[int]] = {}

    def draft(self, inp: DraftInput) -> Drafts:
        proposals = [self.drafter.propose(self.histories[row])[:inp.gamma] for row in inp.rows.tolist()]
        return Drafts(torch.tensor(proposals, dtype=torch.int64, device=inp.anchors.device))

    def commit_rows(self, rows: CommittedRows) -> None:
        return None  # NGRAM reads tokens, not hidden states

    def commit_tokens(self, row: int, tokens: list[int], restart: bool) -> None:
        if restart:
            self.histories[row] = list(tokens)
        else:
            self.histories[row].extend(tokens)
