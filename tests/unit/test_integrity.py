"""Scheduler.check_integrity catches planted KV accounting errors (mutation tests for the checker)."""

import pytest
from fake_runner import make_req, make_scheduler, run_to_completion


@pytest.fixture
def busy():
    """A scheduler with a cached prefix and two running requests, one of which reuses the cache."""
    sched = make_scheduler(pool_size=200)
    run_to_completion(sched, [make_req("warm", [5, 6, 7, 8, 9, 10], max_new_tokens=3)])
    sched.add_request(make_req("a", [5, 6, 7, 8, 9, 10, 11], max_new_tokens=20))
    sched.add_request(make_req("b", [20, 21, 22], max_new_tokens=20))
    sched.step()
    sched.step()
    assert len(sched.queues.running) == 2 and sched.ledger.tree.total_size > 0
    a = next(r for r in sched.queues.running if r.rid == "a")
    assert a.cache_protected_len > 0
    sched.check_integrity()  # healthy before the mutation
    return sched


def test_healthy_states_pass(busy):
    busy.check_integrity()
    run_to_completion(busy)
    busy.check_integrity()


def test_double_free_of_a_free_slot(busy):
    busy.ledger.allocator.free([busy.ledger.allocator._free[0]])
    with pytest.raises(AssertionError, match="double free"):
        busy.check_integrity()


def test_freeing_a_slot_still_owned_by_a_running_request(busy):
    owned = busy.queues.running[0].kv_slots[-1]
    busy.ledger.allocator.free([owned])
    with pytest.raises(AssertionError, match="KV integrity"):
        busy.check_integrity()


def test_freeing_a_slot_held_by_the_tree(busy):
    busy.ledger.allocator.free([busy.ledger.tree.all_slots()[0]])
    with pytest.raises(AssertionError, match="KV integrity"):
        busy.check_integrity()


def test_leaked_slot(busy):
    assert busy.ledger.allocator.alloc(1) is not None  # taken and never recorded anywhere
    with pytest.raises(AssertionError, match="KV integrity"):
        busy.check_integrity()


def test_swapped_slot_both_free_and_owned(busy):
    """Counts still add up, but one slot is both free and owned while another leaked."""
    req = busy.queues.running[1]
    leaked = busy.ledger.allocator._free.pop()
    busy.ledger.allocator._free.append(req.kv_slots[-1])
    assert leaked not in req.kv_slots
    with pytest.raises(AssertionError, match="both free and in use"):
        busy.check_integrity()


def test_scratch_slot_on_the_free_list(busy):
    busy.ledger.allocator._free[0] = 0
    with pytest.raises(AssertionError, match="scratch slot"):
        busy.check_integrity()


def test_tree_size_out_of_sync(busy):
    busy.ledger.tree.total_size += 1
    with pytest.raises(AssertionError, match="tree size"):
        busy.check_integrity()


def test_lock_left_behind_when_idle():
    sched = make_scheduler()
    run_to_completion(sched, [make_req("a", [5, 6, 7, 8], max_new_tokens=3)])
    sched.check_integrity()
    _, node = sched.ledger.tree.match_prefix([5, 6, 7])
    sched.ledger.tree.inc_lock_ref(node)  # a lock no request will ever release
    with pytest.raises(AssertionError, match="still locked"):
        sched.check_integrity()


def test_released_request_slot_twice_is_detected():
    """A request's own slots freed twice (e.g. release running twice) shows up as a double free."""
    sched = make_scheduler()
    sched.add_request(make_req("a", [5, 6, 7, 8], max_new_tokens=10))
    sched.step()
    req = sched.queues.running[0]
    own = req.kv_slots[req.cache_protected_len:]
    sched.ledger.allocator.free(list(own))  # first "release" without bookkeeping ...
    sched.queues.running.clear()
    sched.ledger.allocator.free(list(own))  # ... and a second one
    with pytest.raises(AssertionError, match="double free"):
        sched.check_integrity()
