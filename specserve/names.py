"""The engine's closed sets of names, as types: step modes, the built-in speculative algorithms
(the drafters themselves are declared in specserve/drafters/) and SUFFIX's draft scopes.

All are `str` enums, so a member equals its string (flags, JSON, metrics labels stay strings) while
the code compares and passes members, never literals."""

from __future__ import annotations

from enum import Enum


class _Name(str, Enum):
    """A name that is its string: prints, formats, compares and hashes as its value."""

    # str's own slots, not Python functions: a member prints and hashes as its string (the same dict
    # key), and a step that compares or looks members up calls nothing of this module.
    __str__ = str.__str__
    __hash__ = str.__hash__


class StepMode(_Name):
    """What one forward step does: EXTEND (a prefill or prefill chunk, after any cached prefix),
    DECODE (one row per request) or VERIFY (a window per request: anchor and drafts)."""

    EXTEND = "extend"
    DECODE = "decode"
    VERIFY = "verify"


class Algorithm(_Name):
    """A speculative algorithm; all but NONE are also the names of the draft workers."""

    NONE = "NONE"
    NGRAM = "NGRAM"
    DSPARK = "DSPARK"
    SUFFIX = "SUFFIX"
    STANDALONE = "STANDALONE"


class SuffixScope(_Name):
    """Whose tokens a SUFFIX draft may come from: GLOBAL, also the outputs of earlier requests (kept
    in an index every request reads); REQUEST, only the request's own prompt and output."""

    GLOBAL = "global"
    REQUEST = "request"
