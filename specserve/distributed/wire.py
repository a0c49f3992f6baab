"""What crosses between ranks as bytes: JSON only, never pickle.

A peer's payload is data, not code: decoding it can fail (MalformedPayload, naming the site and
the rank) but never runs anything. Tuples travel as lists and tensors as nested lists, so every
rank compares and reports the decoded form.
"""

from __future__ import annotations

import json
from typing import Any

import torch


class MalformedPayload(RuntimeError):
    """A payload from another rank is not what the site expects (bad JSON or a bad structure)."""


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"cannot send a {type(value).__name__} to other ranks (JSON values, tuples and tensors only)")


def encode(obj: Any) -> bytes:
    """Canonical JSON bytes of `obj` (sorted keys: equal values give equal bytes on every rank)."""
    return json.dumps(obj, default=_jsonable, sort_keys=True, separators=(",", ":")).encode()


def decode(data: bytes, site: str, rank: int) -> Any:
    """The value a peer sent, or MalformedPayload."""
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise MalformedPayload(
            f"malformed payload at site '{site}' on rank {rank}: not JSON ({exc}); first bytes {data[:32]!r}"
        ) from None


def expect(ok: bool, site: str, what: str) -> None:
    """A structural check on a decoded payload."""
    if not ok:
        raise MalformedPayload(f"malformed payload at site '{site}': {what}")
