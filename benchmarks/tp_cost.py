"""`python -m benchmarks tp-cost`: what tensor parallelism and the rank consensus checker cost on this
machine, measured as `specserve soak` runs (DSPARK, the adaptive policy, overlap, the soak's
prompts) of the same token budget in three arms, interleaved so that the shared host's drift hits
every arm alike:

- `tp1`: one rank (no collectives, no checker);
- `tp2`: two ranks without the checker;
- `tp2_checker`: two ranks with the checker (its rounds, events and mean milliseconds per check
  come from the ranks' shutdown figures).

Each arm's generated tokens/s is reported as the median and min-max of its runs; a ratio is
"within noise" where the two arms' ranges overlap.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

# The adaptive policy, as a server runs by default (the soak's own default, fixed, drafts every step).
_POLICY = ["--speculative-policy", "adaptive"]
ARMS = {"tp1": (["--tp-size", "1", "--no-consensus-checker", *_POLICY], "0"),
        "tp2": (["--tp-size", "2", "--no-consensus-checker", *_POLICY], "0"),
        "tp2_checker": (["--tp-size", "2", *_POLICY], "1")}


def add_tp_cost_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=12000, help="token budget (processed) of every soak run")
    p.add_argument("--repeats", type=int, default=2, help="runs of each arm, interleaved")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds one soak may take")
    p.add_argument("--out", default=None, help="write the result JSON here")


def soak_once(arm: str, max_tokens: int, timeout: float) -> dict[str, Any]:
    flags, checker_env = ARMS[arm]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "soak.json")
        cmd = [sys.executable, "-m", "specserve.cli", "soak", *flags, "--max-tokens", str(max_tokens), "--out", out]
        env = {**os.environ, "SPECSERVE_ENABLE_RANK_CONSENSUS_CHECKER": checker_env}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"soak {arm} exited with {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}")
        with open(out) as f:
            summary = json.load(f)["summary"]
    run = {"arm": arm, "generated_tokens_per_s": summary["generated_tokens_per_s"], "seconds": summary["seconds"],
           "tokens_generated": summary["tokens_generated"], "tokens_processed": summary["tokens_processed"]}
    if arm == "tp2_checker":
        rank0 = summary["consensus_per_rank"][0]["consensus"]
        run.update(checks=rank0["checks"], events_checked=rank0["events_checked"],
                   mean_check_ms=rank0["mean_check_ms"], rank_divergences=summary["rank_divergences"])
    return run


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}


def compare(num: dict[str, float], den: dict[str, float]) -> dict[str, Any]:
    """num's median over den's, and whether the runs' ranges overlap (then it is within noise)."""
    overlap = num["min"] <= den["max"] and den["min"] <= num["max"]
    return {"ratio": round(num["median"] / den["median"], 3), "within_noise": overlap}


def run_tp_cost_bench(ns: argparse.Namespace) -> int:
    from specserve.bench.provenance import provenance

    names = list(ARMS)
    runs = []
    for repeat in range(ns.repeats):
        for arm in names[repeat % len(names):] + names[:repeat % len(names)]:
            runs.append(soak_once(arm, ns.max_tokens, ns.timeout))
            print(json.dumps(runs[-1]), flush=True)
    speed = {a: spread([r["generated_tokens_per_s"] for r in runs if r["arm"] == a]) for a in names}
    checked = [r for r in runs if r["arm"] == "tp2_checker"]
    report = {**provenance(_default_drafter()), "max_tokens": ns.max_tokens, "runs": runs,
              "generated_tokens_per_s": speed, "tp2_over_tp1": compare(speed["tp2"], speed["tp1"]),
              "checker_over_no_checker": compare(speed["tp2_checker"], speed["tp2"]),
              "mean_check_ms": spread([r["mean_check_ms"] for r in checked]),
              "rank_divergences": sum(r["rank_divergences"] for r in checked)}
    print(json.dumps({k: report[k] for k in ("generated_tokens_per_s", "tp2_over_tp1", "checker_over_no_checker")}))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["rank_divergences"] == 0 else 1


def _default_drafter():
    from specserve.args import ServerArgs

    return ServerArgs().speculative_draft_model_path  # the shipped drafter, as `soak` runs it
