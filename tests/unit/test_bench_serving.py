"""`bench serving` with rounds: each ratio is formed within its round and the summary reports the
rounds' median and range; the renderer calls a ratio a gain only where every run beat every
baseline run."""

from __future__ import annotations

import json

import pytest

from benchmarks.render.serving import render_serving
from specserve.bench.serving import RunResult, ratios, summary


def _run(target: str, c: int, repeat: int, tok_s: float, tpot: float) -> RunResult:
    return RunResult(target, c, None, 8, 0, 1.0, int(tok_s), tok_s, 8.0, {"p50": 50.0}, {"p50": tpot}, None,
                     repeat=repeat)


def _rounds(base: list[float], other: list[float]) -> list[RunResult]:
    runs = []
    for k, (b, o) in enumerate(zip(base, other)):
        runs += [_run("peer", 1, k, b, 10.0), _run("ours", 1, k, o, 5.0)]
    return runs


def test_ratios_pair_runs_of_the_same_round():
    runs = _rounds([100.0, 50.0, 80.0], [200.0, 150.0, 80.0])
    got = sorted((r["repeat"], r["throughput_ratio"]) for r in ratios(runs))
    assert got == [(0, 2.0), (1, 3.0), (2, 1.0)]  # not 200/50 or 150/100: each round against its own baseline


def test_summary_gives_median_and_range_per_target_and_concurrency():
    rows = {row["target"]: row for row in summary(_rounds([100.0, 50.0, 80.0], [200.0, 150.0, 80.0]))}
    assert rows["ours"]["output_tokens_per_s"] == {"median": 150.0, "min": 80.0, "max": 200.0}
    assert rows["ours"]["throughput_ratio"] == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert rows["ours"]["tpot_p50_ratio"]["median"] == 0.5
    assert "throughput_ratio" not in rows["peer"] and rows["peer"]["runs"] == 3


@pytest.mark.parametrize("ours, marked", [([200.0, 210.0, 220.0], "**"), ([90.0, 150.0, 160.0], "within noise")])
def test_rendered_ratio_is_a_gain_only_when_the_runs_do_not_overlap(tmp_path, ours, marked):
    runs = _rounds([100.0, 110.0, 120.0], ours)
    data = {"commit": "abc", "date": "2026-12-05 00:00 UTC", "machine": {"description": "test machine"},
            "num_prompts": 8, "max_tokens": 16, "repeats": 3, "servers": {},
            "runs": [vars(r) for r in runs], "summary": summary(runs)}
    (tmp_path / "serving_mtbench.json").write_text(json.dumps(data))
    text = render_serving(str(tmp_path))
    row = next(line for line in text.splitlines() if line.startswith("| 1 |"))
    assert marked in row
    assert "median (lowest-highest) of 3 rounds" in text


def test_a_spec_workload_is_sent_as_whole_conversations():
    """--dataset multiturn: each request is a conversation whose last message is the user's next
    turn, after at least one earlier exchange (turn 2 onward)."""
    from specserve.bench.serving import load_bench_prompts

    conversations = load_bench_prompts("multiturn", 3, 0, 0)
    assert len(conversations) == 3
    for messages in conversations:
        roles = [m["role"] for m in messages]
        assert roles[-1] == "user" and "assistant" in roles and roles.count("user") >= 2, roles
    assert all(isinstance(p, str) for p in load_bench_prompts("random", 2, 0, 8))
