"""The registry of drafters: each is one declaration (specserve/drafters/declaration.py) in a module
of this package, registered by its module's name in BUILT_IN. The flag checks, the builder, the
warm-up, the cost model and the adaptive policy read declarations; none of them names a drafter.

`register(drafter)` adds one at run time (a plugin, or a test's drafter)."""

from __future__ import annotations

import importlib
from typing import Optional

from specserve.drafters.declaration import Cost, Drafter, DraftModel, Hints

__all__ = [
    "Cost",
    "DraftModel",
    "Drafter",
    "Hints",
    "register",
    "unregister",
    "get",
    "of",
    "names",
    "lookup_names",
    "known",
    "MODELS",
    "LOOKUPS",
]

BUILT_IN = ("dspark", "ngram", "suffix", "standalone")  # modules of this package, one per drafter

_REGISTERED: dict[str, Drafter] = {}
# The drafters that run a model of their own, and the lookups: live sets, read as attributes on a
# step's hot paths (the cost model's features, the policy's search).
MODELS: set[str] = set()
LOOKUPS: set[str] = set()


def register(drafter: Drafter) -> Drafter:
    """Make a drafter known to the engine (its name a --speculative-algorithm value); idempotent."""
    if _REGISTERED.get(drafter.name, drafter) != drafter:
        raise ValueError(f"drafter {drafter.name!r} is registered already, with another declaration")
    _REGISTERED[drafter.name] = drafter
    (MODELS if drafter.cost is Cost.MODEL else LOOKUPS).add(drafter.name)
    return drafter


def unregister(name: str) -> None:
    """Forget a drafter registered at run time (a plugin unloaded; a test's drafter after its test)."""
    _REGISTERED.pop(name, None)
    MODELS.discard(name)
    LOOKUPS.discard(name)


def get(name: str) -> Drafter:
    return _REGISTERED[name]


def of(name: Optional[str]) -> Optional[Drafter]:
    """The declaration of a --speculative-algorithm value; None for NONE, unset or unknown."""
    return _REGISTERED.get(name) if name is not None else None


def known(name: object) -> bool:
    return isinstance(name, str) and name in _REGISTERED


def names() -> tuple[str, ...]:
    """Every drafter, in registration order."""
    return tuple(_REGISTERED)


def lookup_names() -> tuple[str, ...]:
    """The drafters that run no model: any target's default."""
    return tuple(n for n in _REGISTERED if n in LOOKUPS)


for _module in BUILT_IN:
    register(importlib.import_module(f"specserve.drafters.{_module}").DRAFTER)
