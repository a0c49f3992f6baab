"""Tensor parallelism on CPU (gloo, TP 2): identical tokens, the consensus checker, no silent hang."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from helpers import cheap_drafting_table, policy_args

from specserve.models.loader import default_model_path


PROMPTS = ["What is the capital of France?", "Write a haiku about autumn leaves.",
           "Explain recursion to a child in two sentences."]
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


# DSPARK: the default candidates (the shipped drafter, NGRAM and SUFFIX) under the adaptive policy, its
# cost table frozen so that every run plans the same (helpers.policy_args). STANDALONE: the embedded model as
# its own draft model (replicated on every rank), beside NGRAM and SUFFIX.
ALGORITHMS = {"NONE": {"speculative_algorithm": "NONE"}, "DSPARK": {"speculative_algorithm": "DSPARK", **policy_args()},
              "STANDALONE": {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": default_model_path(),
                             **policy_args()}}
PLAN_KEYS = ("spec_draft_len_histogram", "spec_drafter_steps", "spec_verify_ct", "spec_correct_drafts_histogram")


def tokens_and_plans(outs: list[dict]) -> list[tuple]:
    return [(o["output_ids"], [o["meta_info"].get(k) for k in PLAN_KEYS]) for o in outs]


DTYPES = ["float32", "bfloat16"]  # bf16: specserve's kernels, the row-parallel shards run as one chain


@pytest.fixture(scope="module")
def tp1_outputs():
    from specserve import Engine

    out = {}
    for dtype in DTYPES:
        for algorithm, kw in ALGORITHMS.items():
            with Engine(dtype=dtype, max_total_tokens=4096, **kw) as engine:
                out[dtype, algorithm] = tokens_and_plans(engine.generate(PROMPTS, sampling_params=GREEDY))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "normal"])
def test_tp2_tokens_and_speculation_plans_equal_tp1(tp1_outputs, algorithm, overlap, dtype):
    from specserve import Engine

    if dtype == "bfloat16" and not overlap and algorithm in ("NONE", "STANDALONE"):
        pytest.skip("the loops compute the same steps (tests/integration); bf16 runs them in the overlap loop")
    with Engine(dtype=dtype, max_total_tokens=4096, tp_size=2, disable_overlap_schedule=not overlap,
                collective_timeout=120, **ALGORITHMS[algorithm]) as engine:
        outs = engine.generate(PROMPTS, sampling_params=GREEDY)
    assert tokens_and_plans(outs) == tp1_outputs[dtype, algorithm]  # same tokens, same drafters and draft counts
    if algorithm != "NONE":
        assert all(o["meta_info"].get("spec_verify_ct", 0) > 0 for o in outs)


def soak(*flags: str, env: dict[str, str], timeout: float = 300) -> tuple[int, str, float]:
    """Run `specserve soak` in a subprocess; (exit code, output, seconds)."""
    cmd = [sys.executable, "-m", "specserve.cli", "soak", "--dtype", "float32", "--max-total-tokens", "8192",
           "--wave", "4", "--small-new-tokens", "4", "--large-new-tokens", "24", *flags]
    start = time.monotonic()
    proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def test_clean_run_with_every_feature_and_delays_agrees():
    code, out, _ = soak("--max-tokens", "2000", "--copy-delay-ms", "3", "--forward-delay-ms", "2", "--json",
                        env={"SPECSERVE_ENABLE_RANK_CONSENSUS_CHECKER": "1"})
    assert code == 0, out[-3000:]
    assert "Found rank divergence" not in out
    summary = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    # Measured, not printed: the checker ran on every rank to the end and checked all it recorded.
    assert summary["rank_divergences"] == 0 and summary["hangs"] == 0
    assert summary["verify_steps"] > 0  # the soak's fixed policy: the accept path ran under the delays
    assert summary["checker_alive"] is True and summary["consensus_checks"] > 0
    assert summary["events_checked"] == summary["events_recorded"] > 0
    for rank in summary["consensus_per_rank"]:
        c = rank["consensus"]
        assert c["alive"] and c["checks"] > 0 and c["events_checked"] == c["events_recorded"] > 0


# The stale-accept race, made deterministic: rank 1's host copy of each step waits until its next
# step has run (SPECSERVE_FAULT_COPY_LAG_MS on rank 1 only), while rank 0 copies on time. A random
# delay (the old form of this test) outlasted a step on some machines and not on others. Every
# step drafts (the fixed policy), so each verify step's accept buffers are overwritten by the next
# one's; under the adaptive policy a step without drafts leaves them as they were, and the late
# read then sees the right values (detection took from 16 to 736 checked events).
LATE_RANK_1 = ("--copy-lag-ms", "10000", "--copy-lag-ranks", "1", "--speculative-policy", "fixed")


def test_alias_fault_with_one_late_rank_is_caught_and_exits():
    """Views of the accept buffers, read a step late on rank 1 only: the ranks commit different
    tokens, and the consensus checker must report it and end the process, fast."""
    code, out, seconds = soak("--max-minutes", "3", *LATE_RANK_1,
                              env={"SPECSERVE_FAULT_ALIAS_ACCEPT_BUFFERS": "1",
                                   "SPECSERVE_ENABLE_RANK_CONSENSUS_CHECKER": "1"})
    assert code == 3, out[-3000:]
    assert re.search(r"Found rank divergence for \d+ event\(s\)! \(rank \d reporting; first at site 'committed'", out), \
        out[-3000:]
    assert seconds < 120


def test_owned_accept_results_survive_one_late_rank():
    """The same late copies with the ownership fix in place (read_accept hands out clones): no
    divergence, every rank's checker alive and all its events checked."""
    code, out, _ = soak("--max-tokens", "1500", "--json", *LATE_RANK_1,
                        env={"SPECSERVE_ENABLE_RANK_CONSENSUS_CHECKER": "1"})
    assert code == 0, out[-3000:]
    summary = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert summary["rank_divergences"] == 0 and summary["hangs"] == 0
    assert summary["events_checked"] == summary["events_recorded"] > 0
    assert summary["accept_length"] is not None  # it speculated: verify steps ran under the lag
    lags = {r["rank"]: r["copy_lag"] for r in summary["consensus_per_rank"]}
    assert lags[0] is None and lags[1]["late"] > 10, lags  # rank 1's copies really were a step late


def test_planted_divergence_is_reported_at_its_site():
    code, out, _ = soak("--max-tokens", "2000", env={"SPECSERVE_ENABLE_RANK_CONSENSUS_CHECKER": "1",
                                                      "SPECSERVE_FAULT_DIVERGE_SITE": "cache_finished_req:1"})
    assert code == 3, out[-3000:]
    assert re.search(r"Found rank divergence for \d+ event\(s\)!", out), out[-3000:]
    assert "first at site 'cache_finished_req'" in out, out[-3000:]
    assert "planted-divergence" in out


def test_rank_that_skips_a_collective_makes_the_others_fail_with_the_site():
    code, out, seconds = soak("--max-tokens", "2000", "--collective-timeout", "5",
                              env={"SPECSERVE_FAULT_SKIP_COLLECTIVE": "model.all_reduce:1"}, timeout=120)
    assert code != 0
    assert "collective timeout at site 'model.all_reduce' on rank 0/2" in out, out[-3000:]
    assert seconds < 90


def test_server_fails_loudly_when_a_rank_stalls(tmp_path):
    """The front end answers the in-flight request with an error and turns unhealthy; no client waits forever."""
    import httpx

    from helpers import MODEL, ServerProcess

    os.environ["SPECSERVE_FAULT_SKIP_COLLECTIVE"] = "model.all_reduce:1"
    try:
        # A given cost table: no start-up warm-up, so the skipped collective is the request's.
        srv = ServerProcess("--tp-size", "2", "--collective-timeout", "5", "--speculative-cost-table-path",
                            cheap_drafting_table(), log_path=str(tmp_path / "server.log"))
    finally:
        del os.environ["SPECSERVE_FAULT_SKIP_COLLECTIVE"]
    try:
        start = time.monotonic()
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})
        assert r.status_code == 500 and "collective timeout at site 'model.all_reduce'" in r.json()["error"]["message"]
        assert time.monotonic() - start < 60
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 503
    finally:
        srv.stop()
