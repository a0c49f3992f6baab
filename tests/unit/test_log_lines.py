"""The log lines a person reads: the engine's activity line comes only after activity (at most every
LOG_INTERVAL_S, never while idle), names its drafters by name, and a server's shutdown says in one
line what it drained."""

from __future__ import annotations

import logging
import queue
from types import SimpleNamespace

import pytest

from specserve.engine.engine import Engine
from specserve.engine.messages import AddRequest, Shutdown
from specserve.names import Algorithm
from specserve.sampling_params import SamplingParams
from specserve.scheduler.scheduler import LOG_INTERVAL_S, SchedulerStats
from specserve.server.engine_process import EngineServer

STATS_LOGGER = "specserve.scheduler.scheduler"


@pytest.fixture
def lines(caplog):
    """The messages logged at INFO by the stats and the engine process, in order."""
    caplog.set_level(logging.INFO, logger=STATS_LOGGER)
    caplog.set_level(logging.INFO, logger="specserve.server.engine_process")
    return lambda: [r.getMessage() for r in caplog.records]


def test_an_idle_engine_logs_no_line(lines):
    stats = SchedulerStats(gamma=0)
    t0 = stats._last_time
    for k in range(1, 13):  # a minute of idle steps, one every 5 s
        assert not stats.maybe_log(0, 0, now=t0 + k * LOG_INTERVAL_S)
    assert lines() == []


def test_an_idle_engine_step_logs_no_line(lines):
    """Engine._maybe_log_stats (called after every step) hands the decision to the stats: idle long
    past the interval, nothing is logged."""
    stats = SchedulerStats(gamma=0)
    stats._last_time -= 10 * LOG_INTERVAL_S
    engine = SimpleNamespace(
        scheduler=SimpleNamespace(stats=stats, queues=SimpleNamespace(running=[], waiting=[])),
        runner=SimpleNamespace(speculation=SimpleNamespace(policy=None)),
    )
    Engine._maybe_log_stats(engine)  # type: ignore[arg-type]
    assert lines() == []
    stats.generated_tokens, stats._last_time = 7, stats._last_time - LOG_INTERVAL_S  # a step, 5 s on: a line
    Engine._maybe_log_stats(engine)  # type: ignore[arg-type]
    assert len(lines()) == 1 and lines()[0].startswith("running 0, waiting 0, gen ")


def test_activity_logs_a_line_at_most_every_interval_and_one_after_the_last_request(lines):
    stats = SchedulerStats(gamma=0)
    t0 = stats._last_time
    stats.generated_tokens = 50
    assert not stats.maybe_log(1, 0, now=t0 + 1)  # activity, but within the interval
    assert stats.maybe_log(1, 0, now=t0 + 5)
    stats.generated_tokens = 100
    assert not stats.maybe_log(1, 0, now=t0 + 6)
    assert stats.maybe_log(1, 0, now=t0 + 10)
    assert stats.maybe_log(0, 0, now=t0 + 15)  # the request left: one more line
    for t in range(20, 61, 5):  # then idle
        assert not stats.maybe_log(0, 0, now=t0 + t)
    stats.generated_tokens = 120  # a new request after the idle minute: its rate is its own interval's
    assert stats.maybe_log(1, 0, now=t0 + 65)
    assert lines() == [
        "running 1, waiting 0, gen 10.0 tok/s, total 50 tokens",
        "running 1, waiting 0, gen 10.0 tok/s, total 100 tokens",
        "running 0, waiting 0, gen 0.0 tok/s, total 100 tokens",
        "running 1, waiting 0, gen 4.0 tok/s, total 120 tokens",
    ]


def test_a_queue_change_alone_is_activity(lines):
    """Requests that arrive during a long prefill (no token yet) show in the next line."""
    stats = SchedulerStats(gamma=0)
    t0 = stats._last_time
    assert stats.maybe_log(1, 4, now=t0 + LOG_INTERVAL_S)
    assert not stats.maybe_log(1, 4, now=t0 + 2 * LOG_INTERVAL_S)
    assert lines() == ["running 1, waiting 4, gen 0.0 tok/s, total 0 tokens"]


def test_the_line_names_the_drafters_not_their_reprs():
    stats = SchedulerStats(gamma=3)
    for _ in range(6):
        stats.record_plan(Algorithm.DSPARK, 3)
    for _ in range(2):
        stats.record_plan(Algorithm.NGRAM, 2)
    stats.record_plan(None, 0)
    line = stats.log_line(0, 0)
    assert line.endswith(", drafts hist {0: 1, 2: 2, 3: 6}, drafter steps DSPARK 6, NGRAM 2"), line
    assert "Algorithm" not in line and "<" not in line


class _Engine:
    """What EngineServer calls, holding two running requests (their prompts' KV) and one waiting."""

    def __init__(self, max_running: int = 2):
        self.reqs: dict[str, SimpleNamespace] = {}
        self.max_running = max_running

    def add(self, cmd: AddRequest):
        running = sum(r.running for r in self.reqs.values()) < self.max_running
        self.reqs[cmd.rid] = SimpleNamespace(rid=cmd.rid, error=None, running=running,
                                             kv=len(cmd.input_ids) if running else 0)

    def abort(self, rid):
        self.reqs[rid].aborted = True

    def has_work(self):
        return bool(self.reqs)

    def step(self):
        finished = [r for r in self.reqs.values() if getattr(r, "aborted", False)]
        self.reqs = {rid: r for rid, r in self.reqs.items() if r not in finished}
        return SimpleNamespace(tokens=[], finished=finished, flushed=[])

    def output(self, req):
        return {"text": "", "meta_info": {"id": req.rid, "finish_reason": "abort"}}

    def load(self):
        reqs = self.reqs.values()
        return {
            "running": sum(r.running for r in reqs),
            "waiting": sum(not r.running for r in reqs),
            "kv_request_tokens": sum(r.kv for r in reqs),
        }


def test_shutdown_logs_one_line_of_what_it_drained(lines):
    commands: queue.Queue = queue.Queue()
    for rid, n in [("a", 10), ("b", 20), ("c", 5)]:
        commands.put(AddRequest(rid, [1] * n, SamplingParams()))
    commands.put(Shutdown())
    engine = _Engine()
    EngineServer(engine, commands, queue.Queue()).run()
    assert engine.reqs == {}
    assert lines() == ["shutdown: drained 2 running and 1 waiting requests (aborted 3), freed 30 KV slots"]


def test_an_idle_shutdown_says_it_drained_nothing(lines):
    commands: queue.Queue = queue.Queue()
    commands.put(Shutdown())
    EngineServer(_Engine(), commands, queue.Queue()).run()
    assert lines() == ["shutdown: drained 0 running and 0 waiting requests (aborted 0), freed 0 KV slots"]
