"""The KV bookkeeping invariant, checked by tests and by the engine's debug paths."""

from __future__ import annotations

from typing import Sequence

from specserve.kv.pool import TokenSlotAllocator
from specserve.kv.radix_cache import RadixCache
from specserve.scheduler.req import Req


def check_kv_integrity(allocator: TokenSlotAllocator, tree: RadixCache, live: Sequence[Req]) -> None:
    """free + cached + in use == total, no slot counted twice, the scratch slot 0 never handed
    out, and every lock released when no request is live. Raises AssertionError naming the gap."""
    allocator.check_no_duplicates()
    owned = [s for r in live for s in r.kv_slots[r.cache_protected_len :]]
    cached = tree.all_slots()
    total = allocator.available + len(cached) + len(owned)
    if total != allocator.size:
        raise AssertionError(
            f"KV integrity: free {allocator.available} + cached {len(cached)} + "
            f"in use {len(owned)} = {total} != pool size {allocator.size}"
        )
    everything = set(allocator._free) | set(cached) | set(owned)
    if len(everything) != allocator.size or 0 in everything:
        raise AssertionError("KV integrity: a token slot is both free and in use, or the scratch slot leaked")
    if len(cached) != tree.total_size:
        raise AssertionError(f"KV integrity: tree size {tree.total_size} != slots in tree {len(cached)}")
    if not live and tree.evictable_size != tree.total_size:
        raise AssertionError("KV integrity: idle but some cache is still locked")
