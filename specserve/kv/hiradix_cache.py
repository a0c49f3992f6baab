"""HiRadixCache: the radix prefix cache with a host tier (and an optional file tier) under it.

A tree node's KV lives on the device (`value`: token slots), on the host (`host_value`: host
slots), or both. Device eviction of a node that has a confirmed host copy frees its device
slots but keeps the node (host-only); a later prefix match that reaches it loads it back into
fresh device slots instead of recomputing. Write policies decide when a node is backed up:

- write_through: every inserted node at once;
- write_through_selective: a node once it has been matched HIT_THRESHOLD times;
- write_back: only when it is evicted from the device.

A node's device slots are released only after its backup completed on every rank (local wait,
then an all-reduce MIN of completed backups under tensor parallelism). Loading back allocates
device slots from the cache's own allocator, evicting unlocked device leaves when it is short;
the matched path stays locked meanwhile, so that eviction never takes the prefix being extended.

With a file tier, every full page of inserted tokens is written to storage, and a prefix match
that ends in the tree tries the next pages from files; all ranks must hit a page (all-reduce
MIN) before any uses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from specserve.distributed.consensus import RankConsensusChecker
from specserve.errors import ConfigError
from specserve.kv.file_storage import PAGE_TOKENS, FileKVStorage
from specserve.kv.host_pool import HostKVPool
from specserve.kv.pool import TokenSlotAllocator
from specserve.kv.radix_cache import RadixCache, TreeNode, _common_len
from specserve.runtime.stream import Event

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HIT_THRESHOLD = 2


@dataclass
class HiCacheStats:
    backups: int = 0  # nodes backed up
    backed_up_tokens: int = 0
    host_hit_tokens: int = 0  # tokens loaded back from the host
    storage_hit_tokens: int = 0  # tokens loaded from files
    storage_pages_written: int = 0
    device_evicted_to_host: int = 0  # tokens whose device slots were freed, host copy kept
    dropped_tokens: int = 0  # tokens evicted with no copy left
    extra: dict = field(default_factory=dict)


class HiRadixCache(RadixCache):
    """RadixCache with a host tier (and optionally a file tier); see the module docstring."""

    def __init__(
        self,
        allocator: TokenSlotAllocator,
        host: HostKVPool,
        write_policy: str,
        storage: Optional[FileKVStorage],
        agree_min: Callable[[int, str], int],
        consensus: Optional[RankConsensusChecker] = None,
    ):
        """`allocator` holds the device token slots this tree frees on eviction and allocates for
        load-back; `agree_min(value, site)` is an all-reduce MIN across ranks (identity on one rank)."""
        if write_policy not in WRITE_POLICIES:
            raise ConfigError(f"hicache_write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        super().__init__(allocator.free, consensus=consensus)
        self.allocator = allocator
        self.host = host
        self.write_policy = write_policy
        self.storage = storage
        self.agree_min = agree_min
        self.stats = HiCacheStats()
        self._pending: list[tuple[TreeNode, Event]] = []  # backups not yet confirmed
        self._loading: tuple[TreeNode, ...] = ()  # host-only nodes being loaded back: never dropped

    # ------------------------------------------------------------ backups

    def _backup(self, node: TreeNode) -> bool:
        if node.host_value is not None or not node.value:
            return node.host_value is not None
        slots = self.host.alloc(len(node.value))
        if slots is None:
            self._evict_host(len(node.value) - self.host.available, keep=node)
            slots = self.host.alloc(len(node.value))
            if slots is None:
                return False
        node.host_value = slots
        node.backup_confirmed = False
        self._pending.append((node, self.host.backup(node.value, slots)))
        self.stats.backups += 1
        self.stats.backed_up_tokens += len(slots)
        self._agree_event("hicache_backup", (len(node.key), len(slots)))
        return True

    def _confirm_backups(self) -> None:
        """Wait for issued backups; every rank must have completed as many before any is relied on."""
        if not self._pending:
            return
        for _, event in self._pending:
            event.synchronize()
        done = self.agree_min(len(self._pending), "hicache.backups_done")
        for node, _ in self._pending[:done]:
            node.backup_confirmed = True
        self._pending = self._pending[done:]

    def _agree_event(self, site: str, value) -> None:
        if self.consensus is not None:
            self.consensus.record(site, value)

    # ------------------------------------------------------------ insert and match

    def insert(self, key: list[int], value: list[int]) -> int:
        self._drop_host_only_on_path(key)
        cached = super().insert(key, value)
        if self.storage is not None:
            self._write_pages(key, value)
        if self.write_policy == "write_through":
            node, pos = self.root, 0
            while pos < len(key) and key[pos] in node.children:
                node = node.children[key[pos]]
                pos += len(node.key)
                self._backup(node)
        return cached

    def _drop_host_only_on_path(self, key: list[int]) -> None:
        """A request that recomputed tokens of a host-only node (no device room to load it then)
        replaces that node: drop it and its subtree, freeing their host slots."""
        node, pos = self.root, 0
        while pos < len(key) and key[pos] in node.children:
            child = node.children[key[pos]]
            if not child.value:
                self._drop_subtree(child)
                return
            n = _common_len(child.key, key, pos)
            if n < len(child.key):
                return
            node, pos = child, pos + n

    def _drop_subtree(self, node: TreeNode) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.host_value is not None:
                self.host.release(n.host_value)
                self.stats.dropped_tokens += len(n.host_value)
            if n.value:  # only host-only subtrees are dropped; keep the device accounting exact anyway
                self.free_slots(n.value)
                self.total_size -= len(n.key)
                self.evictable_size -= len(n.key) if n.lock_ref == 0 else 0
        del node.up().children[node.key[0]]
        self._pending = [(n, e) for n, e in self._pending if n is not node]

    def match_prefix(self, key: list[int]) -> tuple[list[int], TreeNode]:
        slots, node = super().match_prefix(key)
        if self.disabled or not key:
            return slots, node
        slots, node = self._load_host_chain(key, slots, node)
        if self.storage is not None and len(slots) < len(key):
            slots, node = self._load_pages(key, slots, node)
        if self.write_policy == "write_through_selective":
            self._count_hits(node)
        return slots, node

    def _load_host_chain(self, key: list[int], slots: list[int], node: TreeNode) -> tuple[list[int], TreeNode]:
        pos = len(slots)
        chain = []
        walk = node
        while pos < len(key) and key[pos] in walk.children:
            child = walk.children[key[pos]]
            if child.value or child.host_value is None:
                break
            n = _common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            chain.append(child)
            pos += n
            walk = child
        if not chain:
            return slots, node
        need = sum(len(c.key) for c in chain)
        device = self._alloc_device(need, node, chain)
        if device is None:
            return slots, node
        offset = 0
        for c in chain:
            c.value = device[offset : offset + len(c.key)]
            offset += len(c.key)
            assert c.host_value is not None, "the chain holds host-only nodes"
            self.host.load(c.host_value, c.value)
            self.total_size += len(c.key)
            self.evictable_size += len(c.key)
            c.last_access = next(self._clock)
        self.stats.host_hit_tokens += need
        self._agree_event("hicache_load", (len(slots), need))
        return slots + device, chain[-1]

    def _alloc_device(self, n: int, matched: TreeNode, loading: Sequence[TreeNode] = ()) -> Optional[list[int]]:
        """n device slots for loading KV below `matched`, evicting device leaves when the allocator
        is short, or None. Meanwhile `matched` and its ancestors are locked and the host-only nodes
        in `loading` are exempt from host eviction (which a write_back backup during the device
        eviction may trigger), so making room never takes the prefix or the nodes being loaded."""
        self.inc_lock_ref(matched)
        self._loading = tuple(loading)
        try:
            return self.alloc_evicting(self.allocator, n)
        finally:
            self._loading = ()
            self.dec_lock_ref(matched)

    def _count_hits(self, node: TreeNode) -> None:
        while node is not self.root:
            node.hits += 1
            if node.hits >= HIT_THRESHOLD:
                self._backup(node)
            node = node.up()

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        host = child.host_value
        upper = super()._split(child, n)
        upper.backup_confirmed = child.backup_confirmed
        upper.hits = child.hits
        if host is not None:
            upper.host_value, child.host_value = host[:n], host[n:]
        for pending_node, event in self._pending:
            if pending_node is child:  # both halves wait for the same copy
                self._pending.append((upper, event))
                break
        return upper

    # ------------------------------------------------------------ eviction

    def evict(self, num_tokens: int) -> int:
        """Free device slots, LRU first: keep a node on the host when it has (or, under
        write_back, gets) a copy there, else drop it."""
        if num_tokens <= 0:
            return 0
        if self.write_policy == "write_back":
            self._backup_candidates(num_tokens)
        self._confirm_backups()
        freed = 0
        while freed < num_tokens:
            candidates = [n for n in self._device_leaves() if n.lock_ref == 0]
            if not candidates:
                break
            leaf = min(candidates)
            freed += len(leaf.value)
            self.free_slots(leaf.value)
            self.total_size -= len(leaf.key)
            self.evictable_size -= len(leaf.key)
            if leaf.host_value is not None and leaf.backup_confirmed:
                leaf.value = []
                self.stats.device_evicted_to_host += len(leaf.key)
            else:
                leaf.value = []
                self._drop_subtree(leaf)
        self._agree_event("radix_evict", (num_tokens, freed))
        return freed

    def flush(self) -> int:
        """Drop every cached prefix no request holds, from the device and the host tier (a file tier
        is storage shared across restarts and is kept)."""
        freed = self.evict(self.evictable_size)
        self._evict_host(self.host.size)
        return freed

    def _backup_candidates(self, num_tokens: int) -> None:
        """write_back: copy the nodes about to be evicted to the host first."""
        leaves = sorted(n for n in self._device_leaves() if n.lock_ref == 0)
        total = 0
        for leaf in leaves:
            if total >= num_tokens:
                break
            self._backup(leaf)
            total += len(leaf.value)

    def _device_leaves(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root and node.value and not any(c.value for c in node.children.values()):
                out.append(node)
        return out

    def _evict_host(self, n: int, keep: Optional[TreeNode] = None) -> None:
        """Free host slots: host-only leaves first (dropped), then host copies of device nodes.
        Never `keep`, nor a node being loaded back (`self._loading`)."""
        while n > 0:
            host_only = [
                x
                for x in self._all_nodes()
                if not x.value and x.host_value is not None and not x.children and x is not keep and x not in self._loading
            ]
            if host_only:
                victim = min(host_only)
                assert victim.host_value is not None, "host_only: nodes with a host copy"
                n -= len(victim.host_value)
                self._drop_subtree(victim)
                continue
            copies = [
                x for x in self._all_nodes() if x.value and x.host_value is not None and x is not keep and x.backup_confirmed
            ]
            if not copies:
                return
            victim = min(copies)
            assert victim.host_value is not None, "copies: nodes with a host copy"
            self.host.release(victim.host_value)
            n -= len(victim.host_value)
            victim.host_value = None

    def _all_nodes(self) -> list[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    # ------------------------------------------------------------ file tier

    def _write_pages(self, key: list[int], value: list[int]) -> None:
        assert self.storage is not None, "called with the file tier on"
        for i, page in enumerate(FileKVStorage.page_keys(key)):
            if not self.storage.has(page):
                start = i * PAGE_TOKENS
                if self.storage.save(page, self.host.rows(value[start : start + PAGE_TOKENS])):
                    self.stats.storage_pages_written += 1

    def _load_pages(self, key: list[int], slots: list[int], node: TreeNode) -> tuple[list[int], TreeNode]:
        assert self.storage is not None, "called with the file tier on"
        pages = FileKVStorage.page_keys(key)
        matched = len(slots)
        while True:
            index = matched // PAGE_TOKENS
            end = (index + 1) * PAGE_TOKENS
            if index >= len(pages) or end > len(key):
                break
            rows = self.storage.load(pages[index])
            if self.agree_min(int(rows is not None), "hicache.storage_hit") == 0:
                break  # some rank misses this page: nobody uses it
            assert rows is not None, "this rank has the page (else the agreed minimum is 0)"
            skip = matched - index * PAGE_TOKENS  # tokens of this page already in the tree
            device = self._alloc_device(end - matched, node)
            if device is None:
                break
            self.host.write_rows(device, {name: [t[skip:] for t in ts] for name, ts in rows.items()})
            super().insert(key[:end], slots + device)
            slots = slots + device
            self.stats.storage_hit_tokens += len(device)
            self._agree_event("hicache_storage_load", (matched, len(device)))
            slots, node = super().match_prefix(key[:end])
            matched = end
        return slots, node

    # ------------------------------------------------------------ integrity

    def check_host_integrity(self) -> None:
        """host free + host slots in the tree == host size, no slot twice, no slot 0."""
        in_tree = [s for n in self._all_nodes() if n.host_value is not None for s in n.host_value]
        free = self.host.slots._free
        if len(free) + len(in_tree) != self.host.size:
            raise AssertionError(
                f"HiCache integrity: host free {len(free)} + in tree {len(in_tree)} != host size {self.host.size}"
            )
        everything = set(free) | set(in_tree)
        if len(everything) != self.host.size or 0 in everything:
            raise AssertionError("HiCache integrity: a host slot is both free and in use, or used twice")
