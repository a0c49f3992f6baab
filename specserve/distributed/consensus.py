"""The rank consensus checker (SPECSERVE_ENABLE_RANK_CONSENSUS_CHECKER=1).

Tensor-parallel ranks schedule independently and must make identical choices. Every site where
they must agree records its chosen arguments and result as an event (`@consensus_site` on a
method of an object whose `consensus` attribute holds a checker). A background thread, on a
dedicated gloo group so it never interleaves with the engine's own collectives, periodically runs
a round (every rank's thread runs the same rounds, in step):

1. all-reduces (MIN) how many unchecked events each rank has: n (and the most, and whether
   every rank has asked to stop);
2. hashes its next n events (canonical JSON) and all-reduces the 64-bit digest with MIN and MAX;
3. if MIN != MAX, gathers every rank's events (as JSON), logs a CRITICAL line starting
   `Found rank divergence for N event(s)!` with each rank's differing events, and exits the
   process non-zero. Once every rank has asked to stop, the last round also reports ranks that
   recorded different numbers of events, and the thread ends.

Ranks that diverge usually break a collective soon after; before failing, the engine asks the
checker for one last check (`flush`) so that the report names the first divergent site rather
than the collective that happened to break. The checker keeps the unchecked events and a short
tail of checked ones, with counters for the totals (`figures`). A checker thread that dies for
any reason is fatal: the engine's next step raises ConsensusCheckerDied (see Engine.step).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
import os
import threading
import time
from typing import Any, Callable, Optional

import torch

from specserve import envs
from specserve.distributed import wire
from specserve.errors import ConfigError

logger = logging.getLogger(__name__)

DIVERGENCE_EXIT_CODE = 3
CHECK_INTERVAL_S = 0.05
MAX_REPORTED_EVENTS = 8
CHECKED_HISTORY = 64  # checked events kept for a report's context; totals are counters
# Test hook "RANK:ROUND": that rank's checker thread raises at that round (a checker death).
FAULT_KILL_CHECKER = "SPECSERVE_FAULT_KILL_CONSENSUS_CHECKER"


class ConsensusCheckerDied(RuntimeError):
    """The consensus checker's thread ended on an error: divergences would go unseen."""


class RankConsensusChecker:
    """Records agreement events on this rank and compares them with the other ranks'."""

    def __init__(
        self,
        group,
        interval_s: float = CHECK_INTERVAL_S,
        on_divergence: Optional[Callable[[str], None]] = None,
        plant: Optional[str] = None,
        kill_at_round: Optional[int] = None,
    ):
        self.group = group
        self.rank = group.rank
        self.interval_s = interval_s
        self.on_divergence = on_divergence or _exit_on_divergence
        self.events: list[tuple[str, Any]] = []  # recorded, not yet checked
        self.history: collections.deque = collections.deque(maxlen=CHECKED_HISTORY)  # the last checked
        self.recorded = self.checked = self.checks = self.divergences = 0
        self.check_seconds = 0.0
        self.divergence: Optional[str] = None
        self.error: Optional[str] = None  # why the thread died
        self.alive_at_stop: Optional[bool] = None
        self._plant = plant  # test hook "SITE:RANK": perturb that site's events on that rank
        self._kill_at_round = kill_at_round
        self._rounds_started = 0
        self._lock = threading.Lock()
        self._progress = threading.Condition()
        self._wake = threading.Event()
        self._stop_requested = self._abandoned = False
        self._thread = threading.Thread(target=self._run, name="rank-consensus", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, group) -> Optional["RankConsensusChecker"]:
        if group is None or not envs.env_flag(envs.RANK_CONSENSUS_CHECKER):
            return None
        return cls(
            group,
            plant=os.environ.get(envs.FAULT_DIVERGE_SITE) or None,
            kill_at_round=_kill_round(os.environ.get(FAULT_KILL_CHECKER, ""), group.rank),
        )

    # ------------------------------------------------------------ recording (engine thread)

    def record(self, site: str, value: Any) -> None:
        if self._plant is not None and self._plant == f"{site}:{self.rank}":
            value = (value, "planted-divergence")
        with self._lock:
            self.events.append((site, value))
            self.recorded += 1

    # ------------------------------------------------------------ checking (checker thread)

    def _run(self) -> None:
        try:
            last = False
            while not last:
                self._wake.wait(self.interval_s)
                self._wake.clear()
                last = self.check_once()
        except BaseException as exc:  # any end but the agreed last round is a death
            self._die(exc)
        finally:
            with self._progress:
                self._progress.notify_all()

    def check_once(self) -> bool:
        """One round (collectives on the consensus group). True when every rank has asked to stop:
        that was the last round."""
        start = time.perf_counter()
        with self._progress:
            self._rounds_started += 1
        if self._kill_at_round is not None and self._rounds_started >= self._kill_at_round:
            raise RuntimeError(f"fault injection: the checker's loop raises at round {self._rounds_started}")
        stopping = self._stop_requested  # read first: every event recorded before the request is counted
        with self._lock:
            pending = len(self.events)
        # Under min: the fewest pending events, the most, and 0 only once every rank asked to stop
        # (one rank still recording keeps it at -1, so no rank's thread ends before its own stop).
        counts = torch.tensor([pending, -pending, 0 if stopping else -1], dtype=torch.int64)
        self.group.all_reduce_(counts, "consensus.count", op="min", group=self.group.monitor)
        n, most, last = int(counts[0]), -int(counts[1]), int(counts[2]) == 0
        if n > 0:
            with self._lock:
                batch = self.events[:n]
            if not self._agreed(batch):
                self._report(self._gather(batch))
            self._retire(n)
        if last and most != n:  # every rank stopped recording, and some recorded more than others
            with self._lock:
                rest = list(self.events)
            self._report(self._gather(rest))
        self.check_seconds += time.perf_counter() - start
        with self._progress:
            self.checks += 1
            self._progress.notify_all()
        return last

    def _agreed(self, batch: list) -> bool:
        digest = torch.tensor([_digest(batch)], dtype=torch.int64)
        low = self.group.all_reduce_(digest.clone(), "consensus.digest_min", op="min", group=self.group.monitor)
        high = self.group.all_reduce_(digest.clone(), "consensus.digest_max", op="max", group=self.group.monitor)
        return int(low[0]) == int(high[0])

    def _gather(self, events: list) -> list[list]:
        return self.group.all_gather_json(events, "consensus.events", group=self.group.monitor)

    def _retire(self, n: int) -> None:
        with self._lock:
            self.history.extend(self.events[:n])
            del self.events[:n]
            self.checked += n

    def _report(self, everyone: list[list]) -> None:
        length = max(len(events) for events in everyone)
        differing = [
            i for i in range(length) if len({repr(events[i]) if i < len(events) else None for events in everyone}) > 1
        ]
        first = next(events[differing[0]] for events in everyone if differing[0] < len(events))
        lines = [
            f"Found rank divergence for {len(differing)} event(s)! (rank {self.rank} reporting; first at "
            f"site '{first[0]}' after {self.checked + differing[0]} agreed events)"
        ]
        for rank, events in enumerate(everyone):
            shown = [events[i] if i < len(events) else "(none)" for i in differing[:MAX_REPORTED_EVENTS]]
            lines.append(f"  rank {rank}: " + "; ".join(e if isinstance(e, str) else f"{e[0]}{e[1]!r}" for e in shown))
        if self.history:
            site, value = self.history[-1]
            lines.append(f"  last agreed event: {site}{value!r}")
        self.divergence = "\n".join(lines)
        self.divergences += 1
        logger.critical("%s", self.divergence)
        self.on_divergence(self.divergence)

    def _die(self, exc: BaseException) -> None:
        if self._abandoned:  # the engine is already failing and tore the groups down
            return
        error = f"rank consensus checker died on rank {self.rank}: {type(exc).__name__}: {exc}"
        # Log before publishing the error: whoever sees `alive` turn False may read the log at once.
        logger.critical("%s; the engine fails at its next step", error, exc_info=exc)
        self.error = error

    # ------------------------------------------------------------ control (engine thread)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def raise_if_dead(self) -> None:
        """Fail the engine loudly once the checker thread has died."""
        if self.error is not None:
            raise ConsensusCheckerDied(self.error)

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait for a round that starts after this call (before failing on a broken collective)."""
        with self._progress:
            target = self._rounds_started + 1
            self._wake.set()
            self._progress.wait_for(lambda: self.checks >= target or not self._thread.is_alive(), timeout_s)

    def stop(self, timeout_s: Optional[float] = None) -> None:
        """Stop recording: the rounds go on until every rank has asked, then a last one checks
        everything and the thread ends (so every rank calls this)."""
        self.alive_at_stop = self.alive
        self._stop_requested = True
        self._wake.set()
        self._thread.join(timeout_s if timeout_s is not None else self.group.cfg.timeout_s + 5)
        if self._thread.is_alive():
            logger.error(
                "rank consensus checker on rank %d: no last round within the timeout (a rank never stopped)", self.rank
            )

    def abandon(self) -> None:
        """The engine is failing for another reason: let the thread end without a death report."""
        self._abandoned = self._stop_requested = True
        self._wake.set()

    def figures(self) -> dict[str, Any]:
        """Measured totals: rounds, events recorded and checked, divergences, and whether the thread
        was alive when the engine stopped it (now, before that)."""
        return {
            "checks": self.checks,
            "events_recorded": self.recorded,
            "events_checked": self.checked,
            "divergences": self.divergences,
            "error": self.error,
            "alive": self.alive if self.alive_at_stop is None else self.alive_at_stop,
            "mean_check_ms": round(1e3 * self.check_seconds / max(1, self.checks), 3),
        }


def _kill_round(spec: str, rank: int) -> Optional[int]:
    """FAULT_KILL_CHECKER's round for this rank ("RANK:ROUND"), else None."""
    if not spec.strip():
        return None
    who, _, when = spec.partition(":")
    if not (who.strip().isdigit() and when.strip().isdigit()):
        raise ConfigError(f"{FAULT_KILL_CHECKER} must be RANK:ROUND, got {spec!r}")
    return int(when) if int(who) == rank else None


def _digest(batch: list) -> int:
    raw = hashlib.sha256(wire.encode(batch)).digest()
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
