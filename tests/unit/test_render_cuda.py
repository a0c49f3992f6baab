"""The README part rendered from scripts/cuda_check.py's record: a failed, hung or skipped check
is named and its figures left out, never rendered as passed."""

from __future__ import annotations

import json
import os

from specserve.bench.render.common import REPO
from specserve.bench.render.cuda import render_cuda_check


def test_failed_and_skipped_checks_are_named_not_rendered(tmp_path):
    with open(os.path.join(REPO, "bench_results", "cuda_check.json")) as f:
        record = json.load(f)
    del record["checks"]["sanitizer_silent"]
    record["checks"]["hicache_reload"] = {"ok": False, "error": "hung: still running after 150 s"}
    record["failed"] = ["hicache_reload"]
    (tmp_path / "cuda_check.json").write_text(json.dumps(record))
    text = render_cuda_check(str(tmp_path))
    assert f"- {len(record['checks']) - 1} of {len(record['checks'])} checks passed" in text
    assert "failed: hicache_reload." in text
    assert "HiCache:" not in text and "stream sanitizer" not in text
    assert "| overlap vs sync loop (graphs) |" in text  # the speed table still renders


def test_every_speed_check_is_a_column_set_named_by_its_model(tmp_path):
    with open(os.path.join(REPO, "bench_results", "cuda_check.json")) as f:
        record = json.load(f)
    speed = record["checks"].pop("speed")
    record["checks"].update(speed_tiny=speed, speed_medium=speed)
    record["runs"] = 5
    (tmp_path / "cuda_check.json").write_text(json.dumps(record))
    text = render_cuda_check(str(tmp_path))
    assert "median (min-max) of 5 runs" in text
    assert "| tiny NONE batch 1 |" in text and "| medium DSPARK batch 16 |" in text
