"""CPU streams, events, async_d2h, fault delays and the stream sanitizer."""

import gc
import threading
import time
import weakref

import pytest
import torch

from specserve.runtime.faults import CopyLag, Delay, FaultConfig
from specserve.runtime.sanitizer import StreamHazardError, StreamSanitizer
from specserve.runtime.stream import Event, Stream, StreamError, async_d2h, current_stream


@pytest.fixture(params=[False, True], ids=["inline", "threaded"])
def threaded(request):
    return request.param


def test_work_on_one_stream_runs_in_submission_order(threaded):
    s = Stream("s", threaded=threaded, delay=Delay(3, "x") if threaded else None)
    seen = []
    for i in range(20):
        s.submit(seen.append, i)
    s.synchronize()
    assert seen == list(range(20))
    s.close()


def test_event_wait_orders_work_across_streams(threaded):
    slow = Stream("slow", threaded=threaded, delay=Delay(20, "a") if threaded else None)
    fast = Stream("fast", threaded=threaded)
    # One element per write: the slow stream may run ahead of the reader (nothing orders it after
    # the reads), so a shared cell could already hold a later value; each read must see its write.
    box = torch.zeros(6)
    got = []
    for i in range(1, 6):
        slow.submit(box[i].fill_, float(i))
        Event().record(slow).wait(fast)
        fast.submit(lambda i=i: got.append(float(box[i])))
    fast.synchronize()
    assert got == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_without_the_wait_a_threaded_reader_runs_ahead():
    """The hazard is real on CPU: a delayed writer and an unordered reader disagree."""
    slow = Stream("slow", threaded=True, delay=Delay(30, "b"))
    fast = Stream("fast", threaded=True)
    box = torch.zeros(1)
    got = []
    slow.submit(lambda: (time.sleep(0.02), box.fill_(1.0)))
    fast.submit(lambda: got.append(float(box)))
    fast.synchronize()
    slow.synchronize()
    assert got == [0.0]


def test_async_d2h_keeps_its_source_alive_until_the_copy_runs():
    copy = Stream("copy", threaded=True)
    gate = threading.Event()
    copy.submit(gate.wait)  # hold the copy stream until we have dropped our reference
    src = torch.arange(6.0)
    alive = weakref.ref(src)
    host, done = async_d2h(src, copy)
    del src
    gc.collect()
    assert alive() is not None, "the queued copy must hold its source"
    assert not done.query()
    gate.set()
    done.synchronize()
    assert torch.equal(host, torch.arange(6.0))
    copy.close()


def test_exceptions_on_a_stream_surface_in_the_caller(threaded):
    s = Stream("s", threaded=threaded)

    def boom():
        raise ValueError("kernel failed")

    s.submit(boom)
    ran = []
    with pytest.raises(StreamError, match="kernel failed"):
        s.submit(ran.append, 1)  # inline raises at once; threaded at the latest at the sync below
        s.synchronize()
    with pytest.raises(StreamError):
        Event().record(s).synchronize()
    assert ran == []


def test_events_query_and_unrecorded_events_are_noops():
    s = Stream("s", threaded=True)
    gate = threading.Event()
    s.submit(gate.wait)
    ev = Event().record(s)
    assert not ev.query()
    gate.set()
    ev.synchronize()
    assert ev.query()
    Event().wait(s)  # never recorded: nothing to wait for
    Event().synchronize()


def test_fault_config_from_env(monkeypatch):
    monkeypatch.setenv("SPECSERVE_FAULT_COPY_DELAY_MS", "5")
    monkeypatch.delenv("SPECSERVE_FAULT_SEED", raising=False)
    monkeypatch.delenv("SPECSERVE_FAULT_FORWARD_DELAY_MS", raising=False)
    cfg0, cfg1 = FaultConfig.from_env(rank=0), FaultConfig.from_env(rank=1)
    assert cfg0.copy_delay_ms == 5 and cfg0.needs_threads and cfg0.seed != cfg1.seed
    assert cfg0.delay_for("copy") is not None and cfg0.delay_for("forward") is None
    monkeypatch.setenv("SPECSERVE_FAULT_SEED", "7")
    assert FaultConfig.from_env(rank=3).seed == 7
    monkeypatch.setenv("SPECSERVE_FAULT_COPY_DELAY_MS", "-1")
    with pytest.raises(ValueError, match="SPECSERVE_FAULT_COPY_DELAY_MS"):
        FaultConfig.from_env()
    monkeypatch.setenv("SPECSERVE_FAULT_COPY_DELAY_MS", "0")
    monkeypatch.setenv("SPECSERVE_FAULT_ALIAS_ACCEPT_BUFFERS", "maybe")
    with pytest.raises(ValueError, match="ALIAS"):
        FaultConfig.from_env()


def test_copy_lag_holds_a_copy_until_the_next_step_has_finished(monkeypatch):
    monkeypatch.setenv("SPECSERVE_FAULT_COPY_LAG_MS", "1000")
    cfg = FaultConfig.from_env()
    assert cfg.needs_threads and cfg.copy_lag_ms == 1000
    lag, order = cfg.copy_lag(), []
    forward, copy = Stream("forward", threaded=True), Stream("copy", threaded=True)
    gate = threading.Event()
    for number in range(2):  # what ModelRunner.launch queues for a step, the forward held at a gate
        forward.submit(lambda n=number: (gate.wait(), order.append(f"step {n}")))
        forward.submit(lag.step_finished)
        copy.submit(lag.wait_for_next_step, number)
        copy.submit(lambda n=number: order.append(f"copy {n}"))
    gate.set()
    copy.synchronize()
    # Copy 0 ran after step 1 (without the lag it runs first of all); copy 1 had no next step, so
    # it waited out the bound, and that is counted.
    assert order == ["step 0", "step 1", "copy 0", "copy 1"] and lag.timeouts == 1
    assert FaultConfig().copy_lag() is None
    forward.close()
    copy.close()


def test_copy_lag_lets_a_copy_go_when_the_host_waits_with_no_later_step(monkeypatch):
    """The run's last step (or any step of the synchronous loop) has no successor to lag behind:
    once the host waits on it, its copy goes at once instead of waiting out the bound."""
    lag = CopyLag(60_000)
    forward, copy = Stream("forward", threaded=True), Stream("copy", threaded=True)
    numbers = [lag.hold_copy(forward, copy) for _ in range(2)]  # two steps queued back to back
    done = threading.Event()
    copy.submit(done.set)
    lag.host_waits(numbers[0])  # step 1 is queued: copy 0 still waits for it, and gets it
    lag.host_waits(numbers[1])  # nothing after step 1: copy 1 is released
    assert numbers == [0, 1] and done.wait(timeout=10) and lag.timeouts == 0
    forward.close()
    copy.close()


def test_copy_lag_ranks_pick_the_late_ranks(monkeypatch):
    monkeypatch.setenv("SPECSERVE_FAULT_COPY_LAG_MS", "500")
    monkeypatch.setenv("SPECSERVE_FAULT_COPY_LAG_RANKS", "1,3")
    assert [FaultConfig.from_env(rank=r).copy_lag_ms for r in range(4)] == [0, 500, 0, 500]
    monkeypatch.delenv("SPECSERVE_FAULT_COPY_LAG_RANKS")
    assert [FaultConfig.from_env(rank=r).copy_lag_ms for r in range(2)] == [500, 500]
    monkeypatch.setenv("SPECSERVE_FAULT_COPY_LAG_RANKS", "one")
    with pytest.raises(ValueError, match="SPECSERVE_FAULT_COPY_LAG_RANKS must be comma-separated integers"):
        FaultConfig.from_env(rank=0)


# ---------------------------------------------------------------- sanitizer


def producer_consumer(threaded: bool, ordered: bool, sanitizer: StreamSanitizer) -> None:
    """The forward stream rewrites a persistent buffer each step; the copy stream reads it."""
    forward = Stream("forward", threaded=threaded, sanitizer=sanitizer)
    copy = Stream("copy", threaded=threaded, sanitizer=sanitizer)
    buf = torch.zeros(4)
    pending = None
    for step in range(3):  # as the overlap loop does: launch step N, then wait for step N-1's copy
        if ordered:  # the next write waits for the previous copy
            Event().record(copy).wait(forward)
        forward.submit(buf.fill_, float(step))
        if pending is not None:
            pending.synchronize()
        Event().record(forward).wait(copy)
        host, pending = async_d2h(buf, copy)
    pending.synchronize()
    forward.synchronize()


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "threaded"])
def test_sanitizer_is_silent_when_every_pair_is_ordered(threaded):
    san = StreamSanitizer()
    with san.active():
        producer_consumer(threaded, ordered=True, sanitizer=san)
    assert san.accesses > 0


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "threaded"])
def test_sanitizer_reports_a_missing_wait_whatever_the_timing(threaded):
    """Mutation: drop the copy -> forward ordering. Inline, the copy always runs in time, yet the
    pair is unordered and must be reported."""
    san = StreamSanitizer()
    with pytest.raises((StreamHazardError, StreamError)) as info:
        with san.active():
            producer_consumer(threaded, ordered=False, sanitizer=san)
    text = str(info.value) + str(info.value.__cause__ or "")
    assert "stream hazard" in text and "'forward'" in text and "'copy'" in text
    assert "test_runtime.py" in text  # both call sites point at user code


def test_sanitizer_reports_a_host_read_before_the_copy_event():
    san = StreamSanitizer()
    copy = Stream("copy", threaded=False, sanitizer=san)
    with san.active():
        host, done = async_d2h(torch.ones(3), copy)
        with pytest.raises(StreamHazardError, match="stream hazard"):
            host.sum()  # no done.synchronize(): the host read is unordered with the copy's write
        done.synchronize()
        host.sum()
    assert current_stream().name == "host"


def test_sanitizer_flags_any_foreign_access_to_a_persistent_buffer_at_once():
    """Mutation of the stale-accept fix: copying a view of a persistent buffer instead of a clone."""
    san = StreamSanitizer()
    forward = Stream("forward", sanitizer=san)
    copy = Stream("copy", sanitizer=san)
    buf = torch.zeros(4)
    san.register_persistent([buf], forward)
    with san.active():
        forward.submit(buf.fill_, 1.0)
        owned = []
        forward.submit(lambda: owned.append(buf.clone()))
        Event().record(forward).wait(copy)
        host, done = async_d2h(owned[0], copy)  # the fix: an owned clone
        done.synchronize()
        assert torch.equal(host, torch.ones(4))
        with pytest.raises(StreamError, match="persistent buffer"):
            host, done = async_d2h(buf[:2], copy)  # the bug: a view, on the very first step
            done.synchronize()
