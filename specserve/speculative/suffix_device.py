"""SUFFIX's drafts computed on the device: the suffix index's walk (speculative/suffix_index.py) as
fixed-shape tensor work, so drafting never reads the last step's tokens back.

The request's own tokens are its TokenTable row (written as steps commit, on the forward stream);
the outputs of earlier requests are `DeviceSegments`, the global index's tokens mirrored on the
device. For each request the walk finds the bigram ending at its anchor among the searched tokens
(the newest `max_candidates + 1` occurrences, as the index's lookup), extends each occurrence's
match backwards against the context, keeps the longest, and walks the most frequent continuation
(ties to the newest occurrence) while its share of the matched occurrences stays at least
`min_prob`: over the same tokens, the host index's draft token for token, its score as exact
counts (`hits / total`). The device segments hold the earlier outputs of the commits two launches
back (see DeviceSegments), so a greedy request's draft from them can differ from the host walk's
at the same launch of the normal loop, alike in both loops and on every rank.

Cost: a walk compares every searched token per request, so a step's global walk is O(requests x
held tokens) (`--speculative-suffix-cache-tokens` bounds the held tokens); the host index finds the
occurrences through a bigram table instead. A device bigram index would make it O(candidates).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from specserve.runtime.stream import staged
from specserve.speculative.lagged import LaggedFeed
from specserve.speculative.suffix_index import SEPARATOR


@dataclass
class DeviceDraft:
    """Per request: `tokens` [n, gamma] (the first `drafted` are the walk's), `hits` the matched
    occurrences' continuations summed over the drafted tokens and `total` the occurrences matched
    (the score is hits / total), `match_len` the suffix matched."""

    tokens: torch.Tensor
    drafted: torch.Tensor
    hits: torch.Tensor
    total: torch.Tensor
    match_len: torch.Tensor

    def beats(self, other: "DeviceDraft") -> torch.Tensor:
        """Where this draft's score is higher than other's (exactly: cross-multiplied counts)."""
        return self.hits * other.total.clamp(min=1) > other.hits * self.total.clamp(min=1)

    def choose(self, other: "DeviceDraft", take_other: torch.Tensor) -> "DeviceDraft":
        """Per request this draft, or other's where take_other."""
        fields = ("drafted", "hits", "total", "match_len")
        picked = {f: torch.where(take_other, getattr(other, f), getattr(self, f)) for f in fields}
        return DeviceDraft(torch.where(take_other.unsqueeze(1), other.tokens, self.tokens), **picked)

    def filled(self, anchors: torch.Tensor) -> torch.Tensor:
        """[n, gamma]: the drafted tokens, then the last of them (the anchor when none) repeated."""
        gamma = self.tokens.shape[1]
        col = torch.arange(gamma, device=self.tokens.device).unsqueeze(0)
        last = self.tokens.gather(1, (self.drafted - 1).clamp(min=0).unsqueeze(1))
        last = torch.where(self.drafted.unsqueeze(1) > 0, last, anchors.unsqueeze(1))
        return torch.where(col < self.drafted.unsqueeze(1), self.tokens, last)


@dataclass(frozen=True)
class WalkLimits:
    """The SUFFIX flags the walk obeys (SuffixConfig's, less the global budget and scope)."""

    max_depth: int
    spec_factor: float
    min_prob: float
    max_candidates: int = 64


def walk(
    searched: torch.Tensor, visible: torch.Tensor, own: torch.Tensor, anchor_at: torch.Tensor, gamma: int, limits: WalkLimits
) -> DeviceDraft:
    """The walk of SuffixIndex.draft for n requests at once.

    searched [n, C]: the tokens searched per request (its own row, or the global tokens expanded),
    of which the first `visible` [n] are held; own [n, W]: each request's tokens, its anchor at
    column anchor_at [n] (the context is the columns up to it)."""
    n, width = searched.shape
    dev = searched.device
    last = own.gather(1, anchor_at.unsqueeze(1))  # the context's last token and the one before it
    before = own.gather(1, (anchor_at - 1).clamp(min=0).unsqueeze(1))
    # Column c ends the bigram where c >= 1; compared as slices, so an expanded `searched` (the
    # global tokens) is never copied per request, and the columns are int32 (the [n, C] temporaries
    # are the walk's largest: C is up to the global index's budget).
    col = torch.arange(1, width, dtype=torch.int32, device=dev).unsqueeze(0)
    hit = (searched[:, 1:] == last) & (searched[:, :-1] == before) & (col < visible.unsqueeze(1))
    # The newest max_candidates + 1 occurrences, newest first; the context's own end is never one.
    k = min(limits.max_candidates + 1, width - 1)
    ends = torch.where(hit, col, -1).topk(k, dim=1).values.long() if k > 0 else torch.full((n, 1), -1, device=dev)
    valid = (ends >= 0) & (ends < (visible - 1).unsqueeze(1)) & (anchor_at >= 1).unsqueeze(1)
    match = _match_lengths(searched, ends, own, anchor_at, limits.max_depth)
    match = torch.where(valid, match, 0)
    best = match.amax(1)
    live = valid & (match == best.unsqueeze(1))
    total = live.sum(1)
    limit = (limits.spec_factor * best.double()).floor().long().clamp(min=1).clamp(max=gamma)
    return _walk_counts(searched, visible, ends, live, total, limit, best, gamma, limits.min_prob)


def _match_lengths(
    searched: torch.Tensor, ends: torch.Tensor, own: torch.Tensor, anchor_at: torch.Tensor, max_depth: int
) -> torch.Tensor:
    """Per candidate end: the suffix of the context it matches (2, its bigram, and one more per
    earlier token that agrees, up to min(max_depth, the context's length))."""
    n, k = ends.shape
    back = torch.arange(2, max(max_depth, 2), device=ends.device)  # [D]: how far before the end
    at = ends.unsqueeze(2) - back  # [n, K, D]
    theirs = searched.gather(1, at.clamp(min=0).reshape(n, -1)).reshape(at.shape)
    mine = own.gather(1, (anchor_at.unsqueeze(1) - back).clamp(min=0))  # [n, D]
    depth = torch.minimum(anchor_at + 1, torch.full_like(anchor_at, max_depth))
    agree = (theirs == mine.unsqueeze(1)) & (at >= 0) & (back < depth.unsqueeze(1)).unsqueeze(1)
    return 2 + agree.long().cumprod(2).sum(2)


def _walk_counts(
    searched: torch.Tensor,
    visible: torch.Tensor,
    ends: torch.Tensor,
    live: torch.Tensor,
    total: torch.Tensor,
    limit: torch.Tensor,
    match: torch.Tensor,
    gamma: int,
    min_prob: float,
) -> DeviceDraft:
    """Walk the matched occurrences: at each step the most frequent next token among those still
    live (ties: the newest occurrence's), kept while its share of `total` is at least min_prob."""
    n, width = searched.shape
    tokens = torch.zeros(n, gamma, dtype=torch.int64, device=searched.device)
    drafted, hits = torch.zeros_like(total), torch.zeros_like(total)
    going = total > 0
    for step in range(1, gamma + 1):
        at = ends + step
        nxt = searched.gather(1, at.clamp(min=0, max=width - 1))
        ok = live & (at < visible.unsqueeze(1)) & (nxt != SEPARATOR)
        count = ((nxt.unsqueeze(2) == nxt.unsqueeze(1)) & ok.unsqueeze(1)).sum(2)
        count = torch.where(ok, count, 0)
        top = count.argmax(1, keepdim=True)  # the first of the most frequent: the newest occurrence
        c, tok = count.gather(1, top).squeeze(1), nxt.gather(1, top).squeeze(1)
        going = going & (step <= limit) & (c > 0) & ~(c.double() / total.clamp(min=1).double() < min_prob)
        tokens[:, step - 1] = tok
        drafted += going.long()
        hits += torch.where(going, c, 0)
        live = ok & (nxt == tok.unsqueeze(1))
    return DeviceDraft(tokens, drafted, hits, total, torch.where(total > 0, match, 0))


class DeviceSegments:
    """The global index's tokens on the device, as the host index holds them (segments, each closed
    by a separator, evicted oldest first).

    The host tells it what changed (`change`: 'append' tokens, 'evict' positions, 'clear') tagged
    with the launch whose commit changed the host index; a draft for launch k applies the changes
    of launches up to k - 2 (speculative/lagged.py), so both loops, every tensor-parallel rank and
    a threaded stream draft from the same tokens, whenever the host parties ran."""

    def __init__(self, device: torch.device | str, capacity: int = 4096):
        self.buffer = torch.full((capacity,), SEPARATOR, dtype=torch.int64, device=device)
        self.start = self.end = 0  # the held tokens: buffer[start:end]
        self._changes: LaggedFeed[tuple[str, Sequence[int] | int]] = LaggedFeed("suffix segments")

    def change(self, launch: int, what: str, arg: Sequence[int] | int = 0) -> None:
        """Host side: the host index changed at the commit of `launch`."""
        self._changes.put(launch, (what, arg))

    def held(self, launch: Optional[int]) -> torch.Tensor:
        """Forward side: the tokens a draft for `launch` searches (None: every change told)."""
        for what, arg in self._changes.due(launch):
            if what == "append":
                assert not isinstance(arg, int)
                self._append([*arg, SEPARATOR])
            elif what == "evict":
                assert isinstance(arg, int)
                self.start += arg
            else:
                self.start = self.end = 0
        return self.buffer[self.start : self.end]

    def _append(self, tokens: list[int]) -> None:
        held = self.end - self.start
        if self.end + len(tokens) > self.buffer.shape[0]:  # compact, growing when half full
            size = max(self.buffer.shape[0], 2 * (held + len(tokens)))
            fresh = torch.full((size,), SEPARATOR, dtype=torch.int64, device=self.buffer.device)
            fresh[:held] = self.buffer[self.start : self.end]
            self.buffer, self.start, self.end = fresh, 0, held
        self.buffer[self.end : self.end + len(tokens)] = staged(tokens, torch.int64, self.buffer.device)
        self.end += len(tokens)
