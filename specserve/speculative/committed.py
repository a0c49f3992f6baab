"""What the drafters learn from commits: each request slot's tokens on the host (RequestTokens)
and on the device (TokenTable, every slot's tokens by position, and prompt lookup over it), and
the target rows a step committed (CommittedRows, for a drafter that reads hidden states).

RequestTokens is the one host record of a slot's current request that the drafters share: its
committed tokens, appended once per commit by `Speculation`, and each drafter's own state of the
request keyed by the drafter's name (NGRAM's n-gram index, SUFFIX's suffix index, STANDALONE's
valid draft K/V), which goes with the request when the slot's next request starts. A drafter reads
the tokens as a view and brings its state up to date when it next drafts or hints, so a step that
does not ask a drafter anything does not run it.

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

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeVar

import torch

from specserve.runtime.stream import staged

S = TypeVar("S")


@dataclass
class RequestTokens:
    """One slot's current request as the speculation has been told it (see the module docstring)."""

    tokens: list[int]  # its prompt, then its output; the latest committed token (the next anchor) last
    prompt_len: int
    drafters: dict[str, Any] = field(default_factory=dict)  # each drafter's state of this request

    def state(self, drafter: str, make: Callable[[], S]) -> S:
        """`drafter`'s state of this request, made on first use."""
        found = self.drafters.get(drafter)
        if found is None:
            found = self.drafters[drafter] = make()
        return found

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@dataclass
class CommittedRows:
    """Target rows whose K/V this step committed: their captured hidden states (at the layers
    the drafters asked for), absolute positions and token slots."""

    hidden: torch.Tensor  # [N, len(capture_layer_ids) * H]
    positions: torch.Tensor  # [N]
    slots: torch.Tensor  # [N]


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
