"""The load bench's smoke version: 16 streaming clients for 30 s with disconnects, aborts and hostile
requests against a live server. The bench's own checks must all pass (it exits non-zero otherwise):
no 5xx or failed stream on a valid request, every hostile request a 4xx, no KV held at the end,
memory growth bounded. `specserve bench load` with its defaults is the 10-minute, 64-client run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter

import pytest

from specserve.bench.load import Tally, _report, _token_budgets


def test_load_smoke(tmp_path):
    out = tmp_path / "load.json"
    cmd = [sys.executable, "-m", "specserve.cli", "bench", "load", "--minutes", "0.5", "--clients", "16",
           "--max-tokens", "4,16", "--rss-baseline-s", "15", "--hostile-share", "0.15", "--disconnect-share", "0.15",
           "--abort-share", "0.1", "--out", str(out), "--", "--context-length", "512"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    report = json.loads(out.read_text())
    assert proc.returncode == 0, (report, proc.stderr[-3000:])
    assert report["passed"] and all(report["checks"].values()), report
    sent = report["sent"]
    for kind in ("chat_stream", "completion", "generate", "disconnect", "abort", "hostile"):
        assert sent.get(kind, 0) > 0, sent  # every kind of client behaviour happened
    assert report["ok"]["hostile"] == sent["hostile"]
    assert report["kv_request_tokens_at_end"] == 0 and report["completion_tokens"] > 0
    assert report["valid_sent"] == report["valid_answered"] > 0  # no valid request lost
    assert report["max_tokens"] == [4, 16] and report["commit"] and report["machine"]["threads"] > 0


def test_mixed_token_budgets_parse_and_bad_ones_are_refused():
    assert _token_budgets("16,64,256") == [16, 64, 256]
    for bad in ("", "16,", "0", "a,3", "-4"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive integers"):
            _token_budgets(bad)


def test_a_valid_request_without_an_answer_fails_the_run():
    """The check that no request is lost: a valid request neither answered whole nor failed with a
    5xx (say a 4xx, or a stream cut short) fails the run."""
    ns = argparse.Namespace(minutes=1.0, rss_baseline_s=60.0, clients=2, max_tokens=[8], max_rss_growth=0.05)
    idle = {"specserve_kv_request_tokens": 0, "specserve_num_requests_running": 0}
    rss = {"baseline": 100 << 20, "end": 101 << 20}
    whole = Tally(sent=Counter(chat_stream=3, generate=2), ok=Counter(chat_stream=3, generate=2))
    assert _report(ns, whole, 1.0, idle, 200, rss)["passed"]
    lost = Tally(sent=Counter(chat_stream=3, generate=2), ok=Counter(chat_stream=3, generate=1))  # one never answered
    report = _report(ns, lost, 1.0, idle, 200, rss)
    assert not report["checks"]["every_valid_request_answered"] and not report["passed"]
