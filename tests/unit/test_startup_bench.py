"""The start-up benchmark's figures (benchmarks/startup.py): the first full-speed token is the first
whose gap is within 10% of the steady gap (tokens 32-64), either way, and the speed-ups are llama-server's
seconds over ours, within each round."""

from __future__ import annotations

import pytest

from benchmarks.startup import full_speed_at, summarize


def arrivals(gaps: list[float], start: float = 1.0) -> list[float]:
    out = [start]
    for gap in gaps:
        out.append(out[-1] + gap)
    return out


def test_a_lazy_page_in_delays_the_full_speed_token_past_the_first():
    """A server that maps its weights lazily: the first token early, the next ones slow while its
    pages come in, then a steady 0.1 s."""
    times = arrivals([2.0, 1.0, 0.5, 0.2, 0.105, *[0.1] * 60])
    assert full_speed_at(times) == pytest.approx(times[5])  # the 0.105 s gap: within 10% of 0.1
    assert full_speed_at(times) > times[0] + 3.7


def test_a_server_at_full_speed_from_its_first_token():
    times = arrivals([0.1] * 63)
    assert full_speed_at(times) == pytest.approx(times[1])


def test_two_tokens_read_together_are_not_full_speed():
    """A gap near 0 (two events in one read) is not within 10% of the steady gap: the first
    full-speed token is the first regular one after it."""
    times = arrivals([0.0, 0.5, 0.1, *[0.1] * 60])
    assert full_speed_at(times) == pytest.approx(times[3])


def test_too_few_tokens_to_tell():
    assert full_speed_at(arrivals([0.1] * 20)) is None


def test_speedups_are_their_seconds_over_ours_within_each_round():
    ours = [{"first_token_s": 2.0, "full_speed_s": 4.0}, {"first_token_s": 1.0, "full_speed_s": 8.0}]
    theirs = [{"first_token_s": 4.0, "full_speed_s": 4.0}, {"first_token_s": 3.0, "full_speed_s": 4.0}]
    out = summarize({"warm": {"specserve": ours, "llama-server": theirs, "llama-server --no-warmup": theirs}})
    first = out["warm"]["speedup"]["llama-server"]["first_token_s"]
    assert (first["min"], first["max"]) == (2.0, 3.0)
    full = out["warm"]["speedup"]["llama-server --no-warmup"]["full_speed_s"]
    assert (full["min"], full["max"]) == (0.5, 1.0)
    assert out["warm"]["specserve"]["first_token_s"]["median"] == 1.5
