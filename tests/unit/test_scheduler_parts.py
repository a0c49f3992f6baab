"""The scheduler's parts, each alone (no Scheduler, no loop): the KV ledger, memory pressure,
admission and decode windows over a real allocator, table and radix cache."""

from __future__ import annotations

from fake_runner import make_req

from specserve.kv.pool import ReqToTokenPool, TokenSlotAllocator
from specserve.kv.radix_cache import RadixCache
from specserve.scheduler.batching import Admission, DecodeWindows, MemoryPressure, SchedulerConfig
from specserve.scheduler.kv_ledger import KVLedger
from specserve.scheduler.req import RequestQueues


def parts(pool: int = 64, window: int = 1, **cfg):
    allocator = TokenSlotAllocator(pool)
    events: list = []
    ledger = KVLedger(allocator, ReqToTokenPool(5, 128), RadixCache(allocator.free),
                      lambda site, value: events.append(site))
    queues = RequestQueues()
    pressure = MemoryPressure(ledger, queues, window)
    config = SchedulerConfig(context_length=100, num_draft_tokens=window - 1, **cfg)
    return ledger, queues, pressure, Admission(config, ledger, queues, pressure), \
        DecodeWindows(window, ledger, queues, pressure), events


def running_request(ledger: KVLedger, queues: RequestQueues):
    """A request with 3 prompt tokens in its KV and one output token, running."""
    req = make_req("a", [3, 4, 5])
    ledger.bind(req, [], ledger.lock_prefix([])[1])
    ledger.append(req, ledger.alloc(3))
    req.kv_len, req.output_ids = 3, [9]
    queues.running.append(req)
    return req


def table_row(ledger: KVLedger, req) -> list[int]:
    return ledger.req_to_token.table[req.row, :len(req.kv_slots)].tolist()


def test_the_ledger_writes_a_requests_positions_in_one_place_and_releases_them_once():
    ledger, *_ , events = parts()
    req = make_req("a", [5, 6, 7, 8])
    slots, node = ledger.lock_prefix(req.fill_ids[:-1])
    assert slots == []  # nothing cached yet
    ledger.bind(req, slots, node)
    ledger.append(req, ledger.alloc(4))
    assert table_row(ledger, req) == req.kv_slots and len(req.kv_slots) == 4
    req.kv_len = 4
    free_before = ledger.allocator.available
    ledger.release(req)
    ledger.release(req)  # a second release is a no-op
    assert events == ["cache_finished_req"] and req.req_pool_idx is None and req.kv_slots == []
    assert ledger.tree.total_size == 4 and ledger.allocator.available == free_before  # cached, not freed
    again = make_req("b", [5, 6, 7, 8, 9])
    cached, node = ledger.lock_prefix(again.fill_ids[:-1])
    assert len(cached) == 4 and ledger.tree.evictable_size == 0  # the match is locked


def test_admission_chunks_a_long_prompt_and_admits_nothing_behind_it():
    ledger, queues, _, admission, _, _ = parts(chunked_prefill_size=8)
    long, short = make_req("long", list(range(3, 23))), make_req("short", [3, 4])
    queues.waiting += [long, short]
    batch = admission.schedule()
    assert batch.reqs == [long] and batch.extend_lens == [8] and batch.sample == [False]
    assert queues.waiting == [short]  # a chunk ends the batch
    assert table_row(ledger, long) == batch.out_cache_loc == long.kv_slots


def test_pressure_retracts_the_newest_request_into_the_cache_and_requeues_it():
    ledger, queues, pressure, *_ = parts()
    old, new = make_req("old", [3, 4, 5]), make_req("new", [6, 7, 8])
    old.arrival, new.arrival = 0, 1
    for req in (old, new):
        ledger.bind(req, [], ledger.lock_prefix([])[1])
        ledger.append(req, ledger.alloc(3))
        req.kv_len = 3
        queues.running.append(req)
    ratio = pressure.new_token_ratio
    pressure.retract_one()
    assert queues.running == [old] and queues.waiting == [new] and new.num_retractions == 1
    assert pressure.num_retractions == 1 and pressure.new_token_ratio > ratio
    assert ledger.tree.total_size == 3  # its computed KV went to the prefix cache


def test_decode_windows_grow_by_the_shortfall_and_plan_for_an_in_flight_step():
    ledger, queues, _, _, windows, _ = parts(window=4)
    req = running_request(ledger, queues)
    assert windows.need(req) == 4  # positions 3..6 of its first window
    batch = windows.schedule()
    assert batch.mode == "verify" and batch.extend_lens == [4] and len(req.kv_slots) == 7
    assert table_row(ledger, req) == req.kv_slots
    queues.in_flight.append(batch)
    assert windows.need(req) == 4  # the in-flight window may commit all 4 first
    assert windows.overlap_ready()
    queues.waiting.append(make_req("b", [3]))
    assert not windows.overlap_ready()  # someone waits: the next step may admit it


def test_a_decode_batch_says_whether_a_freed_slot_is_refilled():
    """Refilled unless a closed batch runs (Engine.generate) with nobody waiting."""
    ledger, queues, _, _, windows, _ = parts(window=4)
    running_request(ledger, queues)
    assert windows.schedule().refills and windows.schedule().step_input().refills  # serving: more may arrive
    queues.closed = True
    assert not windows.schedule().step_input().refills
    queues.waiting.append(make_req("b", [3]))
    assert windows.schedule().step_input().refills  # a waiting request takes the slot
