"""NGRAM drafter: model-free drafts by suffix match over the request's own tokens (prompt lookup)."""

from __future__ import annotations


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
