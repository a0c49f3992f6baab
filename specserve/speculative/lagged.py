"""LaggedFeed: host-side news of a step's commit, handed to the forward stream two launches later.

Whatever the host learns from step j's results (the tokens it committed, the drafts accepted) it
learns before launching step j + 2 in either loop: the overlap loop resolves step j after
launching step j + 1, the synchronous loop before. Planning or drafting for launch k from the news
of launches up to k - 2 therefore needs no wait on the device, and gives the same result in both
loops, on every tensor-parallel rank and with a threaded stream, whenever the host parties ran.

News is put by the host (`put`, tagged with the committing step's launch count) and taken on the
forward stream (`due(k)`: everything tagged up to k - 2, in launch order, then in the order put).
News that comes later than a launch that should have seen it is refused: it would mean a loop
that runs more than one step ahead, and the ranks' states would then depend on timing.
"""

from __future__ import annotations

import threading
from typing import Generic, Optional, TypeVar

from specserve.errors import InternalError

LAG = 2  # launches between a commit and the first plan or draft that sees it
T = TypeVar("T")


class LaggedFeed(Generic[T]):
    """Items tagged by launch, released LAG launches later (see the module docstring)."""

    def __init__(self, what: str):
        self.what = what  # named in the error
        self._pending: list[tuple[int, int, T]] = []  # (launch, order put, item)
        self._order = 0
        self._released_through: Optional[int] = None
        self._lock = threading.Lock()  # put on the host thread, taken on a threaded forward stream

    def put(self, launch: int, item: T) -> None:
        with self._lock:
            if self._released_through is not None and launch <= self._released_through:
                raise InternalError(
                    f"{self.what}: launch {launch}'s change arrived after launch "
                    f"{self._released_through + LAG}'s draft (the host must learn step k before launching k + {LAG})"
                )
            self._pending.append((launch, self._order, item))
            self._order += 1

    def due(self, launch: Optional[int]) -> list[T]:
        """The items launch `launch` sees (None: every item put, for a tool's call), oldest first."""
        with self._lock:
            if launch is None:
                taken, self._pending = self._pending, []
            else:
                through = launch - LAG
                taken = [p for p in self._pending if p[0] <= through]
                self._pending = [p for p in self._pending if p[0] > through]
                self._released_through = max(self._released_through or 0, through)
        return [item for _, _, item in sorted(taken, key=lambda p: (p[0], p[1]))]

    def __len__(self) -> int:
        return len(self._pending)
