"""RadixCache: match / insert / split, lock refs, LRU eviction, size accounting, disabled mode, reset."""

import random

import pytest

from specserve.kv.radix_cache import RadixCache


class FreeLog:
    """Collects the slots the tree hands back."""

    def __init__(self):
        self.freed: list[int] = []

    def __call__(self, slots):
        self.freed.extend(slots)


def make_tree(disabled=False):
    log = FreeLog()
    return RadixCache(log, disabled=disabled), log


def check_sizes(tree: RadixCache):
    """total_size == slots in tree; evictable_size == tokens in unlocked nodes; structure sane."""
    slots = tree.all_slots()
    assert tree.total_size == len(slots)
    assert len(set(slots)) == len(slots), "a slot is held twice by the tree"
    unlocked, stack = 0, list(tree.root.children.values())
    while stack:
        node = stack.pop()
        assert len(node.key) == len(node.value) >= 1
        assert node.lock_ref >= 0
        for first, child in node.children.items():
            assert child.key[0] == first and child.parent is node
            assert child.lock_ref <= node.lock_ref, "a locked node has an unlocked ancestor"
        if node.lock_ref == 0:
            unlocked += len(node.key)
        stack.extend(node.children.values())
    assert tree.evictable_size == unlocked


# ---------------------------------------------------------------- match / insert / split


def test_insert_then_match_longest_prefix():
    tree, _ = make_tree()
    assert tree.insert([1, 2, 3], [10, 11, 12]) == 0
    slots, node = tree.match_prefix([1, 2, 3, 4, 5])
    assert slots == [10, 11, 12]
    assert node.key == (1, 2, 3)
    assert tree.match_prefix([2, 3])[0] == []
    assert tree.match_prefix([])[0] == []
    assert tree.match_prefix([])[1] is tree.root
    check_sizes(tree)


def test_match_inside_an_edge_splits_it():
    tree, _ = make_tree()
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    slots, node = tree.match_prefix([1, 2, 9])
    assert slots == [10, 11]
    assert node.key == (1, 2) and node.value == [10, 11]
    (lower,) = node.children.values()
    assert lower.key == (3, 4) and lower.value == [12, 13] and lower.parent is node
    assert tree.total_size == 4  # splitting moves no slots
    assert tree.match_prefix([1, 2, 3, 4])[0] == [10, 11, 12, 13]
    check_sizes(tree)


def test_insert_returns_already_cached_length_and_branches():
    tree, _ = make_tree()
    tree.insert([1, 2, 3], [10, 11, 12])
    # Same prefix with a longer key: 3 already cached, only the tail is new.
    assert tree.insert([1, 2, 3, 4, 5], [90, 91, 92, 13, 14]) == 3
    assert tree.match_prefix([1, 2, 3, 4, 5])[0] == [10, 11, 12, 13, 14]  # first writer's slots kept
    # Diverging inside an edge: split and add a sibling.
    assert tree.insert([1, 2, 7, 8], [80, 81, 22, 23]) == 2
    assert tree.match_prefix([1, 2, 7, 8])[0] == [10, 11, 22, 23]
    assert tree.match_prefix([1, 2, 3, 4, 5])[0] == [10, 11, 12, 13, 14]
    # Fully cached key: nothing new.
    assert tree.insert([1, 2], [70, 71]) == 2
    assert tree.total_size == 7
    assert sorted(tree.all_slots()) == [10, 11, 12, 13, 14, 22, 23]
    check_sizes(tree)


def test_random_inserts_match_a_reference_model():
    """Against a dict prefix -> slot (first writer wins): every match returns the longest cached prefix."""
    rng = random.Random(0)
    tree, _ = make_tree()
    ref: dict[tuple, int] = {}
    next_slot = 1
    keys = []
    for _ in range(200):
        if keys and rng.random() < 0.5:
            base = rng.choice(keys)
            key = base[:rng.randint(0, len(base))] + [rng.randint(0, 3) for _ in range(rng.randint(1, 4))]
        else:
            key = [rng.randint(0, 3) for _ in range(rng.randint(1, 8))]
        keys.append(key)
        value = list(range(next_slot, next_slot + len(key)))
        next_slot += len(key)
        expected_cached = 0
        while expected_cached < len(key) and tuple(key[:expected_cached + 1]) in ref:
            expected_cached += 1
        assert tree.insert(key, value) == expected_cached
        for i in range(expected_cached, len(key)):
            ref[tuple(key[:i + 1])] = value[i]
        probe = [rng.randint(0, 3) for _ in range(rng.randint(0, 9))]
        for q in (probe, key, rng.choice(keys)):
            want = []
            while len(want) < len(q) and tuple(q[:len(want) + 1]) in ref:
                want.append(ref[tuple(q[:len(want) + 1])])
            assert tree.match_prefix(q)[0] == want
    assert tree.total_size == len(ref)
    check_sizes(tree)


# ---------------------------------------------------------------- locks


def test_lock_protects_path_from_eviction():
    tree, log = make_tree()
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    tree.insert([5, 6], [20, 21])
    _, node = tree.match_prefix([1, 2, 3, 4])
    tree.inc_lock_ref(node)
    assert tree.evictable_size == 2
    assert tree.evict(100) == 2
    assert sorted(log.freed) == [20, 21]
    assert tree.match_prefix([1, 2, 3, 4])[0] == [10, 11, 12, 13]
    assert tree.total_size == 4 and tree.evictable_size == 0
    tree.dec_lock_ref(node)
    assert tree.evictable_size == 4
    assert tree.evict(100) == 4
    assert sorted(log.freed) == [10, 11, 12, 13, 20, 21]
    assert tree.total_size == 0 and tree.evictable_size == 0
    check_sizes(tree)


def test_locked_ancestor_survives_but_unlocked_child_is_evicted():
    tree, log = make_tree()
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    _, upper = tree.match_prefix([1, 2])  # splits; upper = (1, 2)
    tree.inc_lock_ref(upper)
    assert tree.evictable_size == 2  # only (3, 4)
    assert tree.evict(1) == 2
    assert log.freed == [12, 13]
    assert tree.match_prefix([1, 2, 3, 4])[0] == [10, 11]
    tree.dec_lock_ref(upper)
    check_sizes(tree)


def test_split_of_a_locked_node_keeps_locks_balanced():
    tree, _ = make_tree()
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    _, full = tree.match_prefix([1, 2, 3, 4])
    tree.inc_lock_ref(full)  # request A holds the whole path
    assert tree.evictable_size == 0
    _, upper = tree.match_prefix([1, 2])  # request B matches inside A's locked edge
    assert upper.lock_ref == 1 and full.lock_ref == 1 and full.parent is upper
    tree.inc_lock_ref(upper)
    assert tree.evictable_size == 0
    tree.dec_lock_ref(full)  # A done: (3, 4) becomes evictable, (1, 2) still held by B
    assert tree.evictable_size == 2 and upper.lock_ref == 1
    tree.dec_lock_ref(upper)
    assert tree.evictable_size == tree.total_size == 4
    with pytest.raises(AssertionError):
        tree.dec_lock_ref(upper)  # unbalanced unlock is caught
    check_sizes(tree)


def test_lock_ref_counts_multiple_holders():
    tree, _ = make_tree()
    tree.insert([1, 2], [10, 11])
    _, node = tree.match_prefix([1, 2])
    tree.inc_lock_ref(node)
    tree.inc_lock_ref(node)
    tree.dec_lock_ref(node)
    assert tree.evictable_size == 0
    assert tree.evict(10) == 0
    tree.dec_lock_ref(node)
    assert tree.evictable_size == 2
    tree.inc_lock_ref(tree.root)  # the root is a no-op
    tree.dec_lock_ref(tree.root)
    assert tree.evictable_size == 2


# ---------------------------------------------------------------- eviction


def test_eviction_is_lru():
    tree, log = make_tree()
    tree.insert([1, 1], [10, 11])  # oldest
    tree.insert([2, 2], [20, 21])
    tree.insert([3, 3], [30, 31])
    tree.match_prefix([1, 1])  # touch: now the most recent
    assert tree.evict(1) == 2
    assert log.freed == [20, 21]
    assert tree.evict(1) == 2
    assert log.freed == [20, 21, 30, 31]
    assert tree.match_prefix([1, 1])[0] == [10, 11]
    assert tree.evict(1) == 2
    assert tree.total_size == 0


def test_insert_refreshes_lru_of_the_shared_path():
    tree, log = make_tree()
    tree.insert([1, 1], [10, 11])
    tree.insert([2, 2], [20, 21])
    tree.insert([1, 1], [90, 91])  # re-inserting touches (1, 1)
    tree.evict(1)
    assert log.freed == [20, 21]


def test_evict_cascades_to_parents_that_become_leaves():
    tree, log = make_tree()
    tree.insert([1, 2, 3], [10, 11, 12])
    tree.insert([1, 2, 4], [10, 11, 13])  # splits: (1, 2) -> {(3,), (4,)}
    assert tree.total_size == 4
    assert tree.evict(4) == 4
    assert sorted(log.freed) == [10, 11, 12, 13]
    assert tree.total_size == tree.evictable_size == 0
    assert tree.root.children == {}


def test_evict_frees_at_least_what_was_asked_and_no_more_leaves_than_needed():
    tree, log = make_tree()
    tree.insert([1, 1, 1], [10, 11, 12])
    tree.insert([2, 2, 2], [20, 21, 22])
    assert tree.evict(0) == 0 and tree.evict(-3) == 0
    assert tree.evict(2) == 3  # whole leaves only
    assert tree.total_size == tree.evictable_size == 3
    assert len(log.freed) == 3
    check_sizes(tree)


def test_flush_drops_every_unheld_prefix_and_keeps_the_held_ones():
    tree, log = make_tree()
    tree.insert([1, 2, 3], [10, 11, 12])
    tree.insert([1, 2, 4], [10, 11, 13])
    tree.insert([5, 6], [50, 51])
    _, held = tree.match_prefix([1, 2, 3])
    tree.inc_lock_ref(held)  # a running request's prefix
    assert tree.flush() == 3  # (4,) and (5, 6); the held path stays
    assert sorted(log.freed) == [13, 50, 51]
    assert tree.match_prefix([1, 2, 3])[0] == [10, 11, 12] and tree.match_prefix([5, 6])[0] == []
    check_sizes(tree)
    tree.dec_lock_ref(held)
    assert tree.flush() == 3 and tree.total_size == tree.evictable_size == 0


# ---------------------------------------------------------------- disabled and reset


def test_disabled_cache_holds_nothing():
    tree, log = make_tree(disabled=True)
    assert tree.insert([1, 2, 3], [10, 11, 12]) == 0
    slots, node = tree.match_prefix([1, 2, 3])
    assert slots == [] and node is tree.root
    assert tree.total_size == tree.evictable_size == 0
    assert tree.all_slots() == []
    assert tree.evict(10) == 0
    assert log.freed == []  # the caller frees its own slots when the cache is off


def test_reset_frees_everything():
    tree, log = make_tree()
    tree.insert([1, 2, 3], [10, 11, 12])
    tree.insert([1, 5], [10, 15])
    tree.reset()
    assert sorted(log.freed) == [10, 11, 12, 15]
    assert tree.total_size == tree.evictable_size == 0
    assert tree.match_prefix([1, 2, 3])[0] == []
    assert tree.all_slots() == []
    assert tree.insert([1], [7]) == 0
    check_sizes(tree)


def test_random_workload_keeps_accounting_exact():
    """Random insert / match+lock / unlock / evict: sizes stay exact, no slot is lost or freed twice."""
    rng = random.Random(1)
    tree, log = make_tree()
    owned_by_tree: set[int] = set()
    locks = []
    next_slot = 1
    for _ in range(400):
        op = rng.random()
        if op < 0.45:
            key = [rng.randint(0, 2) for _ in range(rng.randint(1, 7))]
            value = list(range(next_slot, next_slot + len(key)))
            next_slot += len(key)
            cached = tree.insert(key, value)
            owned_by_tree.update(value[cached:])
        elif op < 0.7:
            _, node = tree.match_prefix([rng.randint(0, 2) for _ in range(rng.randint(1, 7))])
            tree.inc_lock_ref(node)
            locks.append(node)
        elif op < 0.85 and locks:
            tree.dec_lock_ref(locks.pop(rng.randrange(len(locks))))
        else:
            locked_before = tree.total_size - tree.evictable_size
            freed_before = len(log.freed)
            got = tree.evict(rng.randint(1, 6))
            assert got == len(log.freed) - freed_before
            assert tree.total_size - tree.evictable_size == locked_before  # locked tokens never evicted
        check_sizes(tree)
        assert set(tree.all_slots()) | set(log.freed) == owned_by_tree
        assert not set(tree.all_slots()) & set(log.freed)
        assert len(set(log.freed)) == len(log.freed)
    for node in locks:
        tree.dec_lock_ref(node)
    assert tree.evictable_size == tree.total_size
