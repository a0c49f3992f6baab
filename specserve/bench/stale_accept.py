"""`specserve bench stale-accept`: the stale-accept race (the first design's failure: a host copy of
a step's accept results read after the next step had overwritten them) reproduced and measured,
then the same run with the fix in place. Each run is `specserve soak` (TP 2, DSPARK, overlap, the consensus checker)
in a subprocess with rank 1's host copies a step late (SPECSERVE_FAULT_COPY_LAG_MS on rank 1,
the fixed policy so every step drafts):

- `aliased`: read_accept hands out views (SPECSERVE_FAULT_ALIAS_ACCEPT_BUFFERS=1), the race's cause.
  Recorded: the exit code, the checker's first "Found rank divergence" line (site, agreed events
  before it) and the seconds from process start to exit.
- `owned`: the same lag with the fix (clones): the soak's own summary (divergences, hangs, events
  checked, rank 1's late copies).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import time
from typing import Any

logger = logging.getLogger(__name__)

DIVERGENCE = re.compile(r"Found rank divergence for (?P<events>\d+) event\(s\)! \(rank (?P<rank>\d) reporting; "
                        r"first at site '(?P<site>\w+)' after (?P<agreed>\d+) agreed events\)")
LATE_RANK_1 = ["--copy-lag-ms", "10000", "--copy-lag-ranks", "1", "--speculative-policy", "fixed"]


def add_stale_accept_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", type=int, default=3, help="runs of each arm")
    p.add_argument("--clean-tokens", type=int, default=3000, help="token budget of each owned (fixed) run")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one soak may take")
    p.add_argument("--out", default=None, help="write the result JSON here")


def _soak(flags: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "specserve.cli", "soak", *LATE_RANK_1, *flags]
    start = time.monotonic()
    proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, round(time.monotonic() - start, 1)


def aliased_run(timeout: float) -> dict[str, Any]:
    code, out, seconds = _soak(["--max-minutes", "3"], {"SPECSERVE_FAULT_ALIAS_ACCEPT_BUFFERS": "1"}, timeout)
    found = DIVERGENCE.search(out)
    return {"exit_code": code, "seconds": seconds, "caught": found is not None and code == 3,
            "divergence": {k: (int(v) if v.isdigit() else v) for k, v in found.groupdict().items()} if found else None}


def owned_run(tokens: int, timeout: float) -> dict[str, Any]:
    code, out, seconds = _soak(["--max-tokens", str(tokens), "--json"], {}, timeout)
    summary = next((json.loads(line) for line in out.splitlines() if line.startswith("{")), None)
    if summary is None:
        return {"exit_code": code, "seconds": seconds, "summary": None, "log_tail": out[-2000:]}
    late = [r["copy_lag"] for r in summary["consensus_per_rank"] if r.get("copy_lag")]
    return {"exit_code": code, "seconds": seconds, "rank_divergences": summary["rank_divergences"],
            "hangs": summary["hangs"], "events_checked": summary["events_checked"],
            "events_recorded": summary["events_recorded"], "tokens_processed": summary["tokens_processed"],
            "late_copies_rank1": late[0]["late"] if late else None}


def run_stale_accept_bench(ns: argparse.Namespace) -> int:
    from specserve.bench.provenance import provenance

    report: dict[str, Any] = {**provenance(), "soak_flags": LATE_RANK_1, "aliased": [], "owned": []}
    for _ in range(ns.runs):
        report["aliased"].append(aliased_run(ns.timeout))
        print(json.dumps({"aliased": report["aliased"][-1]}), flush=True)
        report["owned"].append(owned_run(ns.clean_tokens, ns.timeout))
        print(json.dumps({"owned": report["owned"][-1]}), flush=True)
    ok = all(r["caught"] for r in report["aliased"]) and all(
        r["exit_code"] == 0 and r.get("rank_divergences") == 0 for r in report["owned"])
    report["as_expected"] = ok
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if ok else 1


def run_under_old_name(ns: argparse.Namespace) -> int:
    """`specserve bench seed-failure`, its name before issue 71: the same run, with a deprecation line."""
    logger.warning("`specserve bench seed-failure` is deprecated: use `specserve bench stale-accept` (the same run)")
    return run_stale_accept_bench(ns)
