"""Suffix matching with continuation counts, over one token sequence or many (SuffixDecoding).

SuffixDecoding (arXiv 2411.04975; vLLM's `suffix` method via Arctic Inference) keeps a suffix
tree: from the node of the longest suffix of the context that occurred before, the children
counts say how often each token followed it, and a draft walks the most frequent child while the
path's probability stays above a floor. This index answers the same questions without the tree's
nodes (a node per token and depth costs hundreds of bytes in Python): the tokens are kept in one
array, with every position listed under the two tokens that end there. The occurrences of the
context's suffix are the listed positions whose tokens, read backwards, agree with it; the
longest agreement is the match, and the occurrences that reach it are the matched node's
subtree. Walking the subtree greedily (the most frequent next token, then keep only the
occurrences that continue with it) is walking the tree's most frequent path: the same draft, its
probability the share of occurrences that continue along it. Ties go to the token of the newest
occurrence (prompt lookup's rule).

Segments (a request's output) are appended whole and evicted oldest first; a position never
matches across a segment boundary (a separator sits between segments). Memory is about one list
slot and one int per token, plus an index entry per new bigram (`bench spec` reports the bytes per
million tokens: measure_bytes_per_token).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Sequence

SEPARATOR = -1  # between segments: never equal to a token, so no match or draft crosses it


@dataclass(frozen=True)
class SuffixDraft:
    """A walk from the longest matched suffix: `tokens` drafted, `probs[j]` the share of the
    matched occurrences that continue with tokens[: j + 1], `match_len` the suffix matched."""

    tokens: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    match_len: int = 0
    hits: int = 0  # the matched occurrences that continue along each drafted token, summed
    total: int = 0  # the occurrences matched: probs[j] = (continuing along tokens[: j + 1]) / total

    @property
    def score(self) -> Fraction:
        """The expected accepted drafts if each probability were the chance of acceptance (sum of
        probs), exactly: the device walk (suffix_device.py) compares the same counts."""
        return Fraction(self.hits, self.total) if self.total else Fraction(0)


class SuffixIndex:
    """Token segments with a bigram index of positions, for suffix matches and frequency-ordered
    drafts. `max_candidates`: the most recent occurrences of a bigram examined per lookup (a
    bound on the lookup's time: common bigrams occur thousands of times)."""

    def __init__(self, max_depth: int = 24, max_candidates: int = 64):
        self.max_depth, self.max_candidates = max_depth, max_candidates
        self.tokens: list[int] = []  # tokens[p - base] is absolute position p
        self.base = 0
        self.index: dict[tuple[int, int], list[int]] = {}  # bigram -> absolute end positions, ascending
        self.segments: deque[int] = deque()  # lengths of the segments held (separator included), oldest first
        self._open = 0  # absolute position where the open segment starts

    def __len__(self) -> int:
        """Tokens held (separators not counted)."""
        return len(self.tokens) - len(self.segments)

    # ------------------------------------------------------------ building

    def append_segment(self, tokens: Sequence[int]) -> None:
        """A new segment (e.g. a finished request's output), then a separator."""
        self.extend(tokens)
        self.extend([SEPARATOR])
        end = self.base + len(self.tokens)
        self.segments.append(end - self._open)
        self._open = end

    def extend(self, tokens: Sequence[int]) -> None:
        """More tokens at the end of the current (open) segment."""
        toks, index = self.tokens, self.index
        for tok in tokens:
            toks.append(tok)
            if len(toks) >= 2 and toks[-2] != SEPARATOR and tok != SEPARATOR:
                index.setdefault((toks[-2], tok), []).append(self.base + len(toks) - 1)

    def evict_oldest(self) -> int:
        """Drop the oldest closed segment; the tokens it held."""
        size = self.segments.popleft()
        removed, new_base = self.tokens[:size], self.base + size
        for a, b in zip(removed, removed[1:]):
            positions = self.index.get((a, b))
            if positions is None:
                continue
            del positions[: bisect.bisect_left(positions, new_base)]
            if not positions:
                del self.index[(a, b)]
        del self.tokens[:size]
        self.base = new_base
        return size - 1

    # ------------------------------------------------------------ lookups

    def draft(
        self, context: Sequence[int], max_tokens: int, min_prob: float = 0.0, spec_factor: Optional[float] = None
    ) -> SuffixDraft:
        """The most frequent continuation of the longest suffix of `context` seen here: at most
        max_tokens (and spec_factor x the match length) tokens, each kept while its path's share of
        the occurrences is at least min_prob. `context` may be this index's own open segment's
        tail: its last position is never a match (nothing follows it yet)."""
        if len(context) < 2 or max_tokens < 1:
            return SuffixDraft()
        match_len, ends = self._longest_match(context)
        if not ends:
            return SuffixDraft()
        limit = max_tokens if spec_factor is None else min(max_tokens, max(1, int(spec_factor * match_len)))
        return self._walk(ends, limit, min_prob, match_len)

    def _longest_match(self, context: Sequence[int]) -> tuple[int, list[int]]:
        """(the longest suffix of context, up to max_depth, that ends at some held position before
        the last; those positions)."""
        positions = self.index.get((context[-2], context[-1]))
        if not positions:
            return 0, []
        toks, base, last = self.tokens, self.base, self.base + len(self.tokens) - 1
        depth = min(self.max_depth, len(context))
        best, ends = 0, []
        for p in reversed(positions[-self.max_candidates - 1 :]):
            if p >= last:  # the context's own end, if it is this index's open segment
                continue
            n = 2
            while n < depth and p - n >= base and toks[p - n - base] == context[-n - 1]:
                n += 1
            if n > best:
                best, ends = n, [p]
            elif n == best:
                ends.append(p)
        return best, ends

    def _walk(self, ends: list[int], limit: int, min_prob: float, match_len: int) -> SuffixDraft:
        toks, base, total = self.tokens, self.base, len(ends)
        size = len(toks)
        drafted: list[int] = []
        probs: list[float] = []
        hits = 0
        live = ends
        for step in range(1, limit + 1):
            counts: dict[int, int] = {}  # in order of the newest occurrence continuing with each token
            for p in live:
                i = p - base + step
                if i < size and toks[i] != SEPARATOR:
                    counts[toks[i]] = counts.get(toks[i], 0) + 1
            if not counts:
                break
            tok = max(counts, key=counts.__getitem__)  # the first of the most frequent: the newest
            prob = counts[tok] / total
            if prob < min_prob:
                break
            drafted.append(tok)
            probs.append(prob)
            hits += counts[tok]
            live = [p for p in live if p - base + step < size and toks[p - base + step] == tok]
        return SuffixDraft(tuple(drafted), tuple(probs), match_len, hits, total)


def measure_bytes_per_token(tokens: int, seed: int = 0, vocab: int = 32000, segment: int = 256) -> float:
    """Bytes the Python heap grows by per token held (tracemalloc), for random outputs of `segment`
    tokens over `vocab` ids: nearly every bigram new, so each token adds an index entry (the worst
    case; repeated text shares entries)."""
    import random
    import tracemalloc

    rng = random.Random(seed)
    outputs = [[rng.randrange(vocab) for _ in range(segment)] for _ in range(max(1, tokens // segment))]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = SuffixIndex()
        for out in outputs:
            index.append_segment(out)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return grown / len(index)
