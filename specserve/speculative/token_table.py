"""TokenTable: every request slot's tokens by position, on the device, and prompt lookup over it.

A drafter that drafts from a request's own tokens (NGRAM) needs step N's committed tokens before
step N+1 is launched; in the overlap loop the host learns them only later. So the tokens live on
the device as well, written where a step commits them (CommitPath, on the forward stream), and
NGRAM's lookup runs there as fixed-shape tensor work: nothing is read back, so a launch never
waits (vLLM's `ngram_gpu` for its async scheduling follows the same plan).

Row r, column p holds the token at position p of the request in slot r: the prompt (and any
output before a retraction) from the prefill, then each committed token at its position. The last
committed token (the next anchor, whose K/V is not yet in the cache) sits at column S, the prefix
length. The extra last column is scratch: fixed-shape writes of rows that commit fewer tokens
than the window's width land there.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specserve.runtime.staging import staged


class TokenTable:
    """Tokens per (request slot, position) on the device; see the module docstring."""

    def __init__(self, slots: int, positions: int, device: torch.device | str = "cpu"):
        self.tokens = torch.zeros(slots, positions + 2, dtype=torch.int64, device=device)
        self.scratch = positions + 1

    @staticmethod
    def like(req_to_token: torch.Tensor) -> "TokenTable":
        """Shaped after the request-to-token table [slots, positions] (positions 0..positions)."""
        return TokenTable(req_to_token.shape[0], req_to_token.shape[1], req_to_token.device)

    def write_sequence(self, row: int, tokens: Sequence[int]) -> None:
        """Slot `row` now holds a request whose tokens are `tokens` (a prefill's: host values)."""
        self.tokens[row, : len(tokens)] = staged(list(tokens), torch.int64, self.tokens.device)

    def write(self, rows: torch.Tensor, tokens: torch.Tensor, lens: torch.Tensor, last: torch.Tensor) -> None:
        """Per request row: its first `lens` tokens of `tokens` [n, W] at positions ending at `last`
        (the new anchor's position, the sequence length after the commit); the rest to scratch."""
        width = tokens.shape[1]
        col = torch.arange(width, device=tokens.device).unsqueeze(0)
        positions = (last - lens).unsqueeze(1) + 1 + col
        positions = torch.where(col < lens.unsqueeze(1), positions, torch.full_like(positions, self.scratch))
        self.tokens[rows.unsqueeze(1).expand(-1, width), positions] = tokens

    def propose(
        self, rows: torch.Tensor, prefix: torch.Tensor, width: int, gamma: int, min_ngram: int, max_ngram: int
    ) -> torch.Tensor:
        """NGRAM's drafts [n, gamma] (TokenHistory.match's, computed on the device): the tokens that
        followed the latest earlier occurrence of the longest suffix of max_ngram..min_ngram tokens
        ending at the anchor (column `prefix`), the last of them repeated past the anchor; with no
        match the anchor, repeated. `width` > every prefix: the columns looked at."""
        width = min(width, self.scratch)
        seq = self.tokens[rows, :width]  # [n, C]
        n_rows, dev = seq.shape[0], seq.device
        starts = torch.arange(width, device=dev).unsqueeze(0)
        found = torch.full((n_rows,), -1, dtype=torch.int64, device=dev)
        follow_at = prefix.clone()  # where the proposal starts; the anchor itself when nothing matches
        for n in range(max_ngram, min_ngram - 1, -1):
            if n >= width:
                continue
            suffix = seq.gather(1, (prefix.unsqueeze(1) - n + 1 + torch.arange(n, device=dev)).clamp(min=0))
            windows = seq.unfold(1, n, 1)  # [n_rows, C - n + 1, n]: the n-gram starting at each column
            hit = (windows == suffix.unsqueeze(1)).all(-1)
            # An earlier occurrence with a token after it, at or before the anchor: start + n <= S.
            hit &= starts[:, : hit.shape[1]] <= (prefix - n).unsqueeze(1)
            latest = torch.where(hit, starts[:, : hit.shape[1]], -1).amax(1)
            take = (found < 0) & (latest >= 0) & (prefix >= n)
            found = torch.where(take, latest, found)
            follow_at = torch.where(take, latest + n, follow_at)
        columns = (follow_at.unsqueeze(1) + torch.arange(gamma, device=dev)).minimum(prefix.unsqueeze(1))
        return seq.gather(1, columns)
