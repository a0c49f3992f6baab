"""RadixCache: token-level prefix sharing of KV slots, with lock refs and LRU eviction.

Every node holds a run of token ids (its key) and the token slots of their KV (its value).
A running request locks the path to its matched prefix so eviction cannot take it; only
unlocked leaves are evicted, least recently used first.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Optional

from specserve.distributed.consensus import RankConsensusChecker, consensus_site
from specserve.kv.pool import TokenSlotAllocator


class TreeNode:
    """One edge of the radix tree: key tokens and their KV slots."""

    _ids = itertools.count()

    def __init__(self, parent: Optional["TreeNode"] = None, key: tuple[int, ...] = (), value: list[int] | None = None):
        self.parent = parent
        self.children: dict[int, TreeNode] = {}
        self.key = key
        self.value = value or []
        self.lock_ref = 0
        self.last_access = 0
        self.id = next(TreeNode._ids)
        # HiCache (kv/hiradix_cache.py): host slots of a copy, whether every rank finished writing it,
        # and matches so far. A node with host_value and an empty value lives on the host only.
        self.host_value: Optional[list[int]] = None
        self.backup_confirmed = False
        self.hits = 0

    def __lt__(self, other: "TreeNode") -> bool:
        return (self.last_access, self.id) < (other.last_access, other.id)

    def up(self) -> "TreeNode":
        """The parent of a node that is not the root."""
        assert self.parent is not None, "the root has no parent"
        return self.parent


class RadixCache:
    """Prefix cache over token slots. `free_slots` returns evicted slots to the allocator."""

    def __init__(
        self,
        free_slots: Callable[[list[int]], None],
        disabled: bool = False,
        consensus: Optional[RankConsensusChecker] = None,
    ):
        self.free_slots = free_slots
        self.disabled = disabled
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = itertools.count(1)
        self.total_size = 0  # tokens held by the tree
        self.evictable_size = 0  # tokens in nodes with lock_ref == 0
        self.consensus = consensus  # under tensor parallelism: inserts and evictions are compared across ranks

    # ------------------------------------------------------------ lookup and insert

    def match_prefix(self, key: list[int]) -> tuple[list[int], TreeNode]:
        """Slots of the longest cached prefix of key, and the node where it ends (splitting one if needed)."""
        if self.disabled or not key:
            return [], self.root
        node, slots, pos = self.root, [], 0
        now = next(self._clock)
        node.last_access = now
        while pos < len(key) and key[pos] in node.children:
            child = node.children[key[pos]]
            if not child.value:  # on the host only (HiCache): the device match ends here
                break
            n = _common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            slots.extend(child.value)
            pos += n
            child.last_access = now
            node = child
        return slots, node

    @consensus_site("radix_insert", lambda self, key, value, result: (len(key), result))
    def insert(self, key: list[int], value: list[int]) -> int:
        """Insert key -> value. Returns how many leading tokens were already cached (their value slots are the "
        "caller's to free)."""
        if self.disabled:
            return 0
        node, pos = self.root, 0
        now = next(self._clock)
        while pos < len(key) and key[pos] in node.children:
            child = node.children[key[pos]]
            child.last_access = now
            n = _common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            pos += n
            node = child
        if pos < len(key):
            leaf = TreeNode(node, tuple(key[pos:]), list(value[pos:]))
            leaf.last_access = now
            node.children[key[pos]] = leaf
            self.total_size += len(leaf.key)
            self.evictable_size += len(leaf.key)
        return pos

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split child's edge after n tokens; returns the new upper node."""
        upper = TreeNode(child.parent, child.key[:n], child.value[:n])
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        child.up().children[child.key[0]] = upper
        child.key, child.value = child.key[n:], child.value[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    # ------------------------------------------------------------ locks and eviction

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
            node.lock_ref += 1
            node = node.up()

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise AssertionError("radix cache: lock_ref would go negative (unbalanced unlock)")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
            node = node.up()

    def alloc_evicting(self, allocator: TokenSlotAllocator, n: int) -> Optional[list[int]]:
        """n slots from `allocator`, evicting unlocked cache first when it is short; None if even
        that cannot free enough."""
        short = n - allocator.available
        if short > 0:
            self.evict(short)
        return allocator.alloc(n)

    @consensus_site("radix_evict", lambda self, num_tokens, result: (num_tokens, result))
    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens slots from unlocked leaves, LRU first. Returns slots freed."""
        if self.disabled or num_tokens <= 0:
            return 0
        heap = [n for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            self.free_slots(leaf.value)
            freed += len(leaf.value)
            self.total_size -= len(leaf.key)
            self.evictable_size -= len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def flush(self) -> int:
        """Drop every cached prefix no request holds (they stay, locked, until their requests end).
        Returns the device slots freed."""
        return self.evict(self.evictable_size)

    def _leaves(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                yield node
            stack.extend(node.children.values())

    def all_slots(self) -> list[int]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.extend(node.value)
            stack.extend(node.children.values())
        return out

    def reset(self) -> None:
        """Drop everything (the caller guarantees no request holds a lock)."""
        self.free_slots(self.all_slots())
        self.root = TreeNode()
        self.root.lock_ref = 1
        self.total_size = self.evictable_size = 0


def _common_len(node_key: tuple[int, ...], key: list[int], pos: int) -> int:
    n = 0
    limit = min(len(node_key), len(key) - pos)
    while n < limit and node_key[n] == key[pos + n]:
        n += 1
    return n
