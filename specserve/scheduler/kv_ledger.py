"""KVLedger: the scheduler's KV and table part.

A request's positions map to token slots: `req.kv_slots` on the host and the request's row of
the req_to_token table that the executor reads. The ledger is the one writer of both (every
grant writes the two together), locks cached prefixes for admission, and hands a request's KV to
the prefix cache exactly once when it finishes or is retracted.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from specserve.kv.pool import ReqToTokenPool, TokenSlotAllocator
from specserve.kv.radix_cache import RadixCache
from specserve.scheduler.req import Req


class KVLedger:
    """Token slots (the allocator and the prefix cache) and request slots (the table rows)."""

    def __init__(
        self,
        allocator: TokenSlotAllocator,
        req_to_token: ReqToTokenPool,
        tree: RadixCache,
        agree: Callable[[str, Any], None],
    ):
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.tree = tree
        self._agree = agree  # an event the other tensor-parallel ranks must reproduce

    @property
    def available(self) -> int:
        """Token slots a step could get: free ones and unlocked cache (evicted on demand)."""
        return self.allocator.available + self.tree.evictable_size

    @property
    def has_request_slot(self) -> bool:
        return self.req_to_token.available > 0

    def alloc(self, n: int) -> Optional[list[int]]:
        """n token slots, evicting unlocked cache if needed; None if even that is not enough."""
        if n <= self.allocator.available:  # free slots suffice: the cache is not asked to evict
            return self.allocator.alloc(n)
        return self.tree.alloc_evicting(self.allocator, n)

    def lock_prefix(self, ids: list[int]) -> tuple[list[int], Any]:
        """The cached slots of the longest cached prefix of `ids`, locked (unevictable) at `node`."""
        slots, node = self.tree.match_prefix(ids)
        self.tree.inc_lock_ref(node)
        return list(slots), node

    def unlock(self, node: Any) -> None:
        self.tree.dec_lock_ref(node)

    def bind(self, req: Req, prefix_slots: list[int], node: Any) -> None:
        """Admit req: a request slot, its locked cached prefix as its first positions."""
        req.req_pool_idx = self.req_to_token.alloc()
        req.kv_slots = []
        req.kv_len = req.cache_protected_len = len(prefix_slots)
        req.last_node = node
        self.append(req, prefix_slots)

    def append(self, req: Req, slots: list[int]) -> None:
        """Grant req the slots of its next positions (host list and table row together)."""
        self.req_to_token.write(req.row, len(req.kv_slots), slots)
        req.kv_slots.extend(slots)

    def release(self, req: Req) -> None:
        """Hand a request's KV to the prefix cache (or free it) and drop its locks, exactly once."""
        if req.req_pool_idx is None:
            return
        computed = req.kv_len
        self._agree("cache_finished_req", (req.rid, computed, req.cache_protected_len, len(req.output_ids)))
        self.allocator.free(req.kv_slots[computed:])  # allocated but never computed
        if self.tree.disabled:
            self.allocator.free(req.kv_slots[req.cache_protected_len : computed])
        else:
            cached = self.tree.insert(req.fill_ids[:computed], req.kv_slots[:computed])
            self.allocator.free(req.kv_slots[req.cache_protected_len : cached])
        self.tree.dec_lock_ref(req.last_node)
        self.req_to_token.free(req.req_pool_idx)
        req.req_pool_idx, req.kv_slots, req.last_node, req.cache_protected_len, req.kv_len = None, [], None, 0, 0
