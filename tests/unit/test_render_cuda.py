"""The README part rendered from scripts/cuda_check.py's record: a failed, hung or skipped check
is named and its figures left out, never rendered as passed."""

from __future__ import annotations

import json
import os

from benchmarks.render.common import REPO
from benchmarks.render.cuda import render_cuda_check, render_cuda_threaded


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


def test_a_check_the_record_never_ran_is_named_as_not_run_on_a_gpu(tmp_path):
    """A check the script has but the record lacks (the script gained it after the GPU run) is said
    to be unrun, so no document reads as if it ran; one the record holds is not."""
    from benchmarks.render.cuda import script_checks

    with open(os.path.join(REPO, "bench_results", "cuda_check.json")) as f:
        record = json.load(f)
    assert "no_host_waits" in script_checks() and "loops_and_graphs" in script_checks()
    record["checks"]["no_host_waits"] = record["checks"]["cpu_agreement"]
    del record["checks"]["bf16_consistency"]
    (tmp_path / "cuda_check.json").write_text(json.dumps(record))
    text = render_cuda_check(str(tmp_path))
    assert "Not run on a GPU yet (the script gained them after this record): `bf16_consistency`." in text


def test_every_speed_check_is_a_column_set_named_by_its_model(tmp_path):
    with open(os.path.join(REPO, "bench_results", "cuda_check.json")) as f:
        record = json.load(f)
    speed = record["checks"].pop("speed_tiny")
    record["checks"].update(speed_small=speed, speed_medium=speed)
    record["runs"] = 5
    (tmp_path / "cuda_check.json").write_text(json.dumps(record))
    text = render_cuda_check(str(tmp_path))
    assert "median (min-max) of 5 runs" in text
    assert "| small NONE batch 1 |" in text and "| medium DSPARK batch 16 |" in text


def test_a_record_with_one_speed_check_names_no_model(tmp_path):
    with open(os.path.join(REPO, "bench_results", "cuda_check.json")) as f:
        record = json.load(f)
    record["checks"] = {"speed": record["checks"]["speed_tiny"]}
    record["failed"] = []
    (tmp_path / "cuda_check.json").write_text(json.dumps(record))
    text = render_cuda_check(str(tmp_path))
    assert "| NONE batch 1 |" in text and "tiny" not in text


def test_the_threaded_streams_table_sets_both_records_side_by_side(tmp_path):
    for name in ("cuda_check.json", "cuda_check_threaded.json"):
        with open(os.path.join(REPO, "bench_results", name)) as f:
            record = json.load(f)
        if name == "cuda_check_threaded.json":  # overlap made clearly faster: the ratio must say so
            cells = record["checks"]["speed_medium"]["value"]["NONE batch 16"]
            cells["overlap+graphs"] = {**cells["sync+graphs"], "tok_s": 9000.0, "range": [8900.0, 9100.0]}
        (tmp_path / name).write_text(json.dumps(record))
    text = render_cuda_threaded(str(tmp_path))
    threaded = next(line for line in text.splitlines() if line.startswith("| threaded streams"))
    assert "**" in threaded and text.count("| inline streams") == 1
    assert "`loops_and_graphs`: AssertionError" in text and "cuda_check_threaded.json" in text
