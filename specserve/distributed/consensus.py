"""The rank consensus checker (SPECSERVE_ENABLE_RANK_CONSENSUS_CHECKER=1).

Tensor-parallel ranks schedule independently and must make identical choices. Every site where
they must agree records its chosen arguments and result as an event (`@consensus_site` on a
method of an object whose `consensus` attribute holds a checker). A background thread, on a
dedicated gloo group so it never interleaves with the engine's own collectives, periodically:

1. all-reduces (MIN) how many unchecked events each rank has: n;
2. hashes its next n events and all-reduces the 64-bit digest with MIN and with MAX;
3. if MIN != MAX, gathers every rank's events, logs a CRITICAL line starting
   `Found rank divergence for N event(s)!` with each rank's differing events, and exits the
   process non-zero.

Ranks that diverge usually break a collective soon after; before failing, the engine asks the
checker for one last check (`flush`) so that the report names the first divergent site rather
than the collective that happened to break.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
import time
from typing import Any, Callable, Optional

import torch

from specserve import envs

logger = logging.getLogger(__name__)

DIVERGENCE_EXIT_CODE = 3
CHECK_INTERVAL_S = 0.05
MAX_REPORTED_EVENTS = 8


class RankConsensusChecker:
    """Records agreement events on this rank and compares them with the other ranks'."""

    def __init__(self, group, interval_s: float = CHECK_INTERVAL_S,
                 on_divergence: Optional[Callable[[str], None]] = None, plant: Optional[str] = None):
        self.group = group
        self.rank = group.rank
        self.interval_s = interval_s
        self.on_divergence = on_divergence or _exit_on_divergence
        self.events: list[tuple[str, Any]] = []
        self.checked = 0
        self.checks = 0
        self.check_seconds = 0.0
        self.divergence: Optional[str] = None
        self._plant = plant  # test hook "SITE:RANK": perturb that site's events on that rank
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="rank-consensus", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, group) -> Optional["RankConsensusChecker"]:
        if group is None or not envs.env_flag(envs.RANK_CONSENSUS_CHECKER):
            return None
        return cls(group, plant=os.environ.get(envs.FAULT_DIVERGE_SITE) or None)

    # ------------------------------------------------------------ recording (engine thread)

    def record(self, site: str, value: Any) -> None:
        if self._plant is not None and self._plant == f"{site}:{self.rank}":
            value = (value, "planted-divergence")
        with self._lock:
            self.events.append((site, value))

    # ------------------------------------------------------------ checking (checker thread)

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            try:
                self.check_once()
            except Exception as exc:  # a peer is gone or the group broke: the engine reports that itself
                if not self._stop:
                    logger.error("rank consensus checker stopped on rank %d: %s", self.rank, exc)
                self._idle.set()
                return
            self._idle.set()

    def check_once(self) -> None:
        start = time.perf_counter()
        with self._lock:
            pending = len(self.events) - self.checked
        n = int(self.group.all_reduce_(torch.tensor([pending]), "consensus.count", op="min",
                                       group=self.group.monitor)[0])
        if n > 0:
            with self._lock:
                batch = self.events[self.checked:self.checked + n]
            digest = torch.tensor([_digest(batch)], dtype=torch.int64)
            low = self.group.all_reduce_(digest.clone(), "consensus.digest_min", op="min", group=self.group.monitor)
            high = self.group.all_reduce_(digest.clone(), "consensus.digest_max", op="max", group=self.group.monitor)
            if int(low[0]) != int(high[0]):
                everyone = self.group.all_gather_objects(batch, "consensus.events", group=self.group.monitor)
                self._report(everyone)
            self.checked += n
        self.checks += 1
        self.check_seconds += time.perf_counter() - start

    def _report(self, everyone: list[list]) -> None:
        length = max(len(events) for events in everyone)
        differing = [i for i in range(length)
                     if len({repr(events[i]) if i < len(events) else None for events in everyone}) > 1]
        lines = [f"Found rank divergence for {len(differing)} event(s)! (rank {self.rank} reporting; first at "
                 f"site '{everyone[0][differing[0]][0]}' after {self.checked + differing[0]} agreed events)"]
        for rank, events in enumerate(everyone):
            shown = [events[i] for i in differing[:MAX_REPORTED_EVENTS] if i < len(events)]
            lines.append(f"  rank {rank}: " + "; ".join(f"{site}{value!r}" for site, value in shown))
        self.divergence = "\n".join(lines)
        logger.critical("%s", self.divergence)
        self.on_divergence(self.divergence)

    def flush(self, timeout_s: float = 5.0) -> None:
        """Ask the thread for a check now and wait for it (before failing on a broken collective)."""
        if not self._thread.is_alive():
            return
        self._idle.clear()
        self._wake.set()
        self._idle.wait(timeout_s)

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(2 * self.interval_s + 1)

    @property
    def overhead(self) -> dict[str, float]:
        return {"checks": self.checks, "events": self.checked,
                "mean_check_ms": 1e3 * self.check_seconds / max(1, self.checks)}


def _digest(batch: list) -> int:
    raw = hashlib.sha256(repr(batch).encode()).digest()
    return int.from_bytes(raw[:8], "little", signed=True)


def _exit_on_divergence(report: str) -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(DIVERGENCE_EXIT_CODE)


def consensus_site(name: str, describe: Optional[Callable[..., Any]] = None):
    """Decorate a method whose choices ranks must agree on. The event is `describe(self, *args,
    result=result, **kwargs)` (default: the arguments and the result). The instance's `consensus`
    attribute holds the checker, or None (then this costs one attribute lookup)."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            result = fn(self, *args, **kwargs)
            checker = getattr(self, "consensus", None)
            if checker is not None:
                value = describe(self, *args, result=result, **kwargs) if describe else (args, result)
                checker.record(name, value)
            return result

        return wrapper

    return decorate
