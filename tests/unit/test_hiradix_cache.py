"""HiRadixCache: host-tier load-back, eviction under a short allocator, the file tier, write policies."""

import pytest
import torch

from specserve.kv.file_storage import PAGE_TOKENS, FileKVStorage, PageLayout, StorageFingerprint
from specserve.kv.hiradix_cache import HIT_THRESHOLD, HiRadixCache
from specserve.kv.host_pool import HostKVPool
from specserve.kv.pool import KVPool, TokenSlotAllocator
from specserve.runtime.stream import Stream


def one_rank(value, site):
    """agree_min on a single rank: the identity."""
    return value


FINGERPRINT = StorageFingerprint(model="tiny:0", drafter="none", kv_dtype="torch.float32", tp_size=1, tp_rank=0,
                                 kernel="test")


def make(dev_size, host_size, policy, storage_dir=None):
    """A tiny 2-layer device pool, its allocator, a host pool and a HiRadixCache over them (with a
    file tier in `storage_dir`)."""
    pool = KVPool(dev_size, 2, 1, 4, torch.float32)
    alloc = TokenSlotAllocator(dev_size)
    host = HostKVPool([pool], host_size, Stream("fwd"), Stream("copy"))
    storage = FileKVStorage(storage_dir, FINGERPRINT, PageLayout.of_pools([pool])) if storage_dir else None
    tree = HiRadixCache(alloc, host, policy, storage, one_rank)
    return pool, alloc, host, tree


def fill(pool, slots, tag):
    """K of the i-th slot = tag * 1000 + i on every layer, V its negation."""
    for layer in range(2):
        for i, s in enumerate(slots):
            pool.k[layer][s] = tag * 1000 + i
            pool.v[layer][s] = -(tag * 1000 + i)


def loaded_k(pool, slots, layer=0):
    return [int(pool.k[layer][s][0, 0]) for s in slots]


def check(tree, alloc):
    """Host integrity, and every device slot is either in the tree or free, exactly once."""
    tree.check_host_integrity()
    alloc.check_no_duplicates()
    in_tree = tree.all_slots()
    assert len(set(in_tree)) == len(in_tree), "a device slot is held twice by the tree"
    assert not set(in_tree) & set(alloc._free), "a device slot is both in the tree and free"
    assert len(in_tree) + alloc.available == alloc.size, (len(in_tree), alloc.available, alloc.size)


def insert_filled(pool, alloc, tree, key, tag):
    slots = alloc.alloc(len(key))
    fill(pool, slots, tag)
    tree.insert(key, slots)
    return slots


A = list(range(100, 120))


# ---------------------------------------------------------------- host tier


def test_evicted_node_loads_back_through_the_caches_own_allocator():
    pool, alloc, host, tree = make(32, 64, "write_through")
    slots = alloc.alloc(20)
    fill(pool, slots, 1)
    assert tree.insert(A, slots) == 0
    check(tree, alloc)
    assert tree.evict(20) == 20
    assert alloc.available == 32, "evicted device slots were not returned to the allocator"
    assert tree.stats.device_evicted_to_host == 20 and tree.stats.dropped_tokens == 0
    check(tree, alloc)

    slots, node = tree.match_prefix(A)
    assert len(slots) == 20 and tree.stats.host_hit_tokens == 20
    assert alloc.available == 12, "load-back did not take its slots from the cache's allocator"
    assert loaded_k(pool, slots) == [1000 + i for i in range(20)]
    assert [int(pool.v[1][s][0, 0]) for s in slots] == [-(1000 + i) for i in range(20)]
    check(tree, alloc)


def test_flush_drops_the_device_and_host_copies_but_not_a_held_prefix():
    pool, alloc, host, tree = make(64, 64, "write_through")
    insert_filled(pool, alloc, tree, A, 1)
    held_key = list(range(300, 310))
    insert_filled(pool, alloc, tree, held_key, 2)
    tree.evict(20)  # A now lives on the host only
    _, held = tree.match_prefix(held_key)
    tree.inc_lock_ref(held)
    tree.flush()
    check(tree, alloc)
    assert host.available == host.size - sum(len(n.host_value) for n in tree._all_nodes() if n.host_value)
    assert tree.match_prefix(A)[0] == [], "a flushed prefix still loads back from the host"
    assert len(tree.match_prefix(held_key)[0]) == 10
    tree.dec_lock_ref(held)


def test_short_allocator_load_back_evicts_other_leaves_but_never_the_matched_path():
    pool, alloc, host, tree = make(40, 64, "write_through")
    prefix = list(range(1, 11))
    b_key = prefix + list(range(200, 210))
    c_key = list(range(300, 312))
    b_slots = alloc.alloc(20)
    fill(pool, b_slots, 2)
    tree.insert(prefix, b_slots[:10])
    tree.insert(b_key, b_slots)
    insert_filled(pool, alloc, tree, c_key, 3)
    tree._confirm_backups()
    _, c_locked = tree.match_prefix(c_key)
    tree.inc_lock_ref(c_locked)
    assert tree.evict(10) == 10  # only B's suffix is unlocked: it goes host-only
    tree.dec_lock_ref(c_locked)
    check(tree, alloc)

    tree.match_prefix(prefix)  # the prefix is now the most recent, C the least recent
    hold = alloc.alloc(alloc.available)
    slots, node = tree.match_prefix(b_key)
    assert len(slots) == 20
    assert loaded_k(pool, slots) == [2000 + i for i in range(20)]
    c_node = tree.root.children[300]
    assert c_node.value == [] and c_node.host_value is not None, "C should have been evicted to the host"
    assert tree.root.children[1].value == b_slots[:10], "the matched prefix lost its device slots"
    alloc.free(hold)
    check(tree, alloc)


# ---------------------------------------------------------------- file tier


def test_file_tier_pages_load_into_a_new_instance(tmp_path):
    key = list(range(5000, 5000 + 2 * PAGE_TOKENS + 5))
    pool, alloc, host, tree = make(300, 300, "write_through", str(tmp_path))
    insert_filled(pool, alloc, tree, key, 4)
    assert tree.stats.storage_pages_written == 2  # full pages only: the 5-token tail is not written

    pool2, alloc2, host2, tree2 = make(300, 300, "write_through", str(tmp_path))
    slots, node = tree2.match_prefix(key)
    assert len(slots) == 2 * PAGE_TOKENS
    assert tree2.stats.storage_hit_tokens == 2 * PAGE_TOKENS
    assert loaded_k(pool2, slots) == [4000 + i for i in range(2 * PAGE_TOKENS)]
    check(tree2, alloc2)


# ---------------------------------------------------------------- write policies


@pytest.mark.parametrize("policy", ["write_through_selective", "write_back"])
def test_other_write_policies_keep_a_host_copy_and_load_it_back(policy):
    pool, alloc, host, tree = make(32, 64, policy)
    insert_filled(pool, alloc, tree, A, 5)
    assert tree.stats.backups == 0, f"{policy} backed up at insert"
    for _ in range(HIT_THRESHOLD):
        tree.match_prefix(A)
    assert tree.evict(20) == 20
    assert tree.stats.device_evicted_to_host == 20 and tree.stats.dropped_tokens == 0
    slots, node = tree.match_prefix(A)
    assert len(slots) == 20 and tree.stats.host_hit_tokens == 20
    assert loaded_k(pool, slots) == [5000 + i for i in range(20)]
    check(tree, alloc)


def test_unknown_write_policy_is_rejected():
    with pytest.raises(ValueError, match="bogus"):
        make(4, 4, "bogus")


# ---------------------------------------------------------------- write_back hazard


def load_host_only_node_with_full_host_pool():
    """write_back, host pool full of host-only A, device full of D and E: matching A must evict a
    device leaf, whose write_back backup wants host room, which host eviction must not take from A."""
    pool, alloc, host, tree = make(20, 10, "write_back")
    a_key = list(range(100, 110))
    insert_filled(pool, alloc, tree, a_key, 1)
    tree.evict(10)
    assert tree.root.children[100].value == [] and host.available == 0
    insert_filled(pool, alloc, tree, list(range(200, 210)), 2)
    insert_filled(pool, alloc, tree, list(range(300, 310)), 3)
    assert alloc.available == 0
    a_node = tree.root.children[100]
    slots, node = tree.match_prefix(a_key)
    assert len(slots) == 10 and node is a_node
    return pool, alloc, tree, slots


def assert_loaded_its_own_kv(pool, alloc, tree, slots):
    assert loaded_k(pool, slots) == [1000 + i for i in range(10)], "loaded another node's KV"
    assert tree.root.children.get(100) is not None, "the loaded node was dropped from the tree"
    check(tree, alloc)


def test_write_back_load_with_full_host_pool_never_drops_the_nodes_being_loaded():
    pool, alloc, tree, slots = load_host_only_node_with_full_host_pool()
    assert_loaded_its_own_kv(pool, alloc, tree, slots)


def test_without_the_loading_guard_the_write_back_hazard_test_fails(monkeypatch):
    """Mutation check: with `_loading` always empty, host eviction may drop the node being loaded."""
    monkeypatch.setattr(HiRadixCache, "_loading", property(lambda self: (), lambda self, value: None),
                        raising=False)
    pool, alloc, tree, slots = load_host_only_node_with_full_host_pool()
    with pytest.raises(AssertionError):
        assert_loaded_its_own_kv(pool, alloc, tree, slots)
