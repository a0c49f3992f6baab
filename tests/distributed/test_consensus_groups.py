"""Real gloo groups between two spawned processes: the consensus checker and collective timeouts."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time


def _addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _checker_rank(rank: int, addr: str, diverge_at: int, out) -> None:
    from specserve.distributed.consensus import RankConsensusChecker
    from specserve.distributed.group import DistConfig, TPGroup

    group = TPGroup(DistConfig(rank, 2, addr, timeout_s=20))
    reports: list[str] = []
    checker = RankConsensusChecker(group, interval_s=0.01, on_divergence=reports.append)
    for i in range(20):
        value = ("rid-7", i, 100 + i) if not (rank == 1 and i == diverge_at) else ("rid-7", i, -1)
        checker.record("cache_finished_req" if i % 2 else "committed", value)
        time.sleep(0.002)
    deadline = time.monotonic() + 10
    while checker.checked < 20 and not reports and time.monotonic() < deadline:
        checker.flush()
    checker.stop()
    out.put((rank, reports, checker.checked, checker.checks))


def _run_pair(target, *args) -> dict:
    ctx = mp.get_context("spawn")
    out, addr = ctx.Queue(), _addr()
    procs = [ctx.Process(target=target, args=(r, addr, *args, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    return {r[0]: r[1:] for r in got}


def test_agreeing_ranks_pass_every_check():
    results = _run_pair(_checker_rank, -1)
    for rank in (0, 1):
        reports, checked, checks = results[rank]
        assert reports == [] and checked == 20 and checks > 0


def test_planted_event_difference_is_reported_with_its_site():
    results = _run_pair(_checker_rank, 9)  # event 9 is a cache_finished_req on rank 1 only
    for rank in (0, 1):
        reports = results[rank][0]
        assert len(reports) == 1
        assert reports[0].startswith("Found rank divergence for 1 event(s)!")
        assert "site 'cache_finished_req'" in reports[0] and "-1" in reports[0]


def _timeout_rank(rank: int, addr: str, out) -> None:
    import torch

    from specserve.distributed.group import CollectiveTimeout, DistConfig, TPGroup

    group = TPGroup(DistConfig(rank, 2, addr, timeout_s=3))
    group.all_reduce_(torch.ones(1), "warmup")
    group.started()  # past start-up: collectives wait at most the collective timeout
    if rank == 1:  # never arrives at the next site
        time.sleep(8)
        out.put((rank, "skipped", 0.0))
        return
    start = time.monotonic()
    try:
        group.all_reduce_(torch.ones(1), "scheduler.step_barrier")
        out.put((rank, "completed", 0.0))
    except CollectiveTimeout as exc:
        out.put((rank, str(exc), time.monotonic() - start))


def test_a_skipped_collective_times_out_naming_the_site():
    results = _run_pair(_timeout_rank)
    message, waited = results[0]
    assert "collective timeout at site 'scheduler.step_barrier' on rank 0/2" in message
    assert 2.5 < waited < 8


def _late_stop_rank(rank: int, addr: str, out) -> None:
    from specserve.distributed.consensus import RankConsensusChecker
    from specserve.distributed.group import DistConfig, TPGroup

    group = TPGroup(DistConfig(rank, 2, addr, timeout_s=20))
    reports: list[str] = []
    checker = RankConsensusChecker(group, interval_s=0.01, on_divergence=reports.append)
    for i in range(5):
        checker.record("committed", ("rid-7", i))
    if rank == 1:
        time.sleep(0.5)  # rank 0 asked to stop long ago; many rounds run meanwhile
    checker.stop()
    out.put((rank, checker.alive_at_stop, checker.checked, reports))


def test_a_rank_that_stops_later_keeps_its_checker_until_it_stops():
    """The last round is the one after every rank asked to stop: a rank that reaches its stop later
    (its engine applies the shutdown a step behind) still has a live checker then, which the
    figures report (a last round after the first rank's request alone ended the others' early)."""
    results = _run_pair(_late_stop_rank)
    for rank in (0, 1):
        alive_at_stop, checked, reports = results[rank]
        assert alive_at_stop and checked == 5 and reports == [], (rank, results[rank])
