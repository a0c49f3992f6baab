"""scripts/cuda_check.py, the check run where a GPU is lent, kept working by CI on CPU: its checks
pass on the CPU path (captured steps instead of graphs), and a hung check is reported with every
thread's stack and fails the run instead of eating the device time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "cuda_check.py")


def test_checks_pass_on_cpu(tmp_path):
    out = tmp_path / "record.json"
    run = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--out", str(out), "--speed-models", "",
                          "--skip", "bf16_consistency,cpu_agreement"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["failed"] == [] and record["skipped"] == ["bf16_consistency", "cpu_agreement"]
    assert set(record["checks"]) == {"loops_and_graphs", "sanitizer_silent", "sanitizer_catches_alias",
                                     "no_host_waits", "alias_with_late_copies", "hicache_reload"}
    waits = record["checks"]["no_host_waits"]["value"]
    assert "the host waits on the device inside a step's launch: item" in waits["planted_item"]
    assert all(waits[a]["overlapped_steps"] > 10
               for a in ("NONE", "NGRAM", "SUFFIX", "DSPARK", "DSPARK-compact", "DSPARK-policy"))
    loops = record["checks"]["loops_and_graphs"]["value"]
    assert len(loops) == 20 and all(v["same_as_sync_eager"] and v["greedy_as_none"] for v in loops.values())
    assert any(v["accepted_drafts"] for k, v in loops.items() if k.startswith("NGRAM"))  # acceptance was exercised
    # The planted alias fault with late copies corrupts the CPU overlap loop (threaded streams).
    assert record["checks"]["alias_with_late_copies"]["value"]["alias=1"]["greedy_requests_differing"] > 0


def test_a_hung_check_is_reported_and_fails_the_run(tmp_path):
    out = tmp_path / "record.json"
    code = (f"import sys, time; sys.path.insert(0, {os.path.dirname(SCRIPT)!r}); import cuda_check\n"
            f"record = {{}}\n"
            f"checks = cuda_check.Checks(1.0, lambda: cuda_check.write({str(out)!r}, record, checks))\n"
            f"checks.run('quick', lambda: 1)\n"
            f"checks.run('stuck', lambda: time.sleep(60))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "[HANG] stuck" in run.stdout
    record = json.loads(out.read_text())
    assert record["failed"] == ["stuck"] and record["checks"]["quick"]["ok"]
    assert 'File "<string>", line 5, in <lambda>' in record["checks"]["stuck"]["trace"]  # where it hung
