"""Orders the waiting queue: fcfs, lpm (longest prefix match) or shortest-prefill-first."""

from __future__ import annotations

from specserve.errors import ConfigError
from specserve.kv.radix_cache import RadixCache
from specserve.scheduler.req import Req

# Matching every waiting request against the tree costs time; past this many, lpm falls back to fcfs.
LPM_MAX_QUEUE = 128


def order_waiting(waiting: list[Req], policy: str, tree: RadixCache) -> list[Req]:
    by_arrival = sorted(waiting, key=lambda r: r.arrival)
    if policy == "fcfs" or tree.disabled and policy == "lpm":
        return by_arrival
    if policy == "lpm" and len(waiting) > LPM_MAX_QUEUE:
        return by_arrival
    cached = {id(r): len(tree.match_prefix(r.fill_ids[:-1])[0]) for r in by_arrival}
    if policy == "lpm":
        return sorted(by_arrival, key=lambda r: -cached[id(r)])
    if policy == "shortest-prefill-first":
        return sorted(by_arrival, key=lambda r: len(r.fill_ids) - cached[id(r)])
    raise ConfigError(f"schedule_policy: unknown policy {policy!r}")
