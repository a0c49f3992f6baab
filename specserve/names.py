"""The engine's closed sets of names, as types: step modes and speculative algorithms (drafters).

Both are `str` enums, so a member equals its string (flags, JSON, metrics labels stay strings) while
the code compares and passes members, never literals."""

from __future__ import annotations

from enum import Enum


class StepMode(str, Enum):
    """What one forward step does: EXTEND (a prefill or prefill chunk, after any cached prefix),
    DECODE (one row per request) or VERIFY (a window per request: anchor and drafts)."""

    EXTEND = "extend"
    DECODE = "decode"
    VERIFY = "verify"

    def __str__(self) -> str:
        return self.value

    def __hash__(self) -> int:  # the string's hash: a member and its string are the same dict key
        return str.__hash__(self)


class Algorithm(str, Enum):
    """A speculative algorithm; NGRAM and DSPARK are also the names of the draft workers."""

    NONE = "NONE"
    NGRAM = "NGRAM"
    DSPARK = "DSPARK"

    def __str__(self) -> str:
        return self.value

    def __hash__(self) -> int:  # the string's hash: a member and its string are the same dict key
        return str.__hash__(self)


DRAFTERS = (Algorithm.DSPARK, Algorithm.NGRAM)  # the algorithms that draft

