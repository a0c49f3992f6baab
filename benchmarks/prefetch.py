"""`python -m benchmarks prefetch`: what the kernels' weight prefetching changes, with it and without it
on the same commit, alternating.

The C++ kernels read SPECSERVE_PREFETCH_BYTES once, when they load, so each setting needs its own
process: every run starts `bench dspark-step` (the Q8_0 drafter) with prefetching off and then on,
and the plain decode step, the target's verify forward with the accept, and the whole DSPARK verify
step are compared within the run before their medians and ranges over the runs are taken.
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

from specserve import envs

FIGURES = {"decode_step_ms": lambda b: b["plain_decode_step_ms"],
           "target_verify_ms": lambda b: b["verify_step_parts_ms"]["target_verify_and_accept"],
           "verify_step_ms": lambda b: b["verify_step_parts_ms"]["verify_step"]}
SETTINGS = {"off": "0", "on": None}  # None: the kernels' default distance


def add_prefetch_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", type=int, default=3, help="alternating runs (off, then on, in each)")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--num-prompts", type=int, default=40, help="MT-Bench first turns per batch size")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--out", default=None, help="write the results as JSON here")


def _dspark_step(ns: argparse.Namespace, bytes_ahead: str | None, out: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in (envs.PREFETCH_BYTES, envs.PREFETCH_BYTES_WIDE)}
    if bytes_ahead is not None:  # "0": off for every tile height
        env[envs.PREFETCH_BYTES] = env[envs.PREFETCH_BYTES_WIDE] = bytes_ahead
    cmd = [sys.executable, "-m", "specserve.cli", "bench", "dspark-step", "--draft-weights", "q8", "--batch-sizes",
           ns.batch_sizes, "--num-prompts", str(ns.num_prompts), "--new-tokens", str(ns.new_tokens),
           "--num-threads", str(ns.num_threads), "--out", out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"bench dspark-step (prefetch {bytes_ahead or 'default'}) failed:\n{proc.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)["draft_weights"]["q8"]["batch_sizes"]


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per batch size and figure: each setting's median and range, and the speedup (off / on)
    formed within each run."""
    out: dict[str, Any] = {}
    for bs in runs[0]["on"]:
        out[bs] = {}
        for name, read in FIGURES.items():
            on = [read(r["on"][bs]) for r in runs]
            off = [read(r["off"][bs]) for r in runs]
            out[bs][name] = {"on": _spread(on), "off": _spread(off),
                             "speedup": _spread([b / a for a, b in zip(on, off)])}  # off / on
    return out


def run_prefetch_bench(ns: argparse.Namespace) -> int:
    from specserve.bench.provenance import provenance

    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for i in range(ns.runs):
            run = {name: _dspark_step(ns, value, os.path.join(folder, f"{name}{i}.json"))
                   for name, value in SETTINGS.items()}
            runs.append(run)
            print(json.dumps({"run": i, **summarize([run])}), flush=True)
    report = {**provenance(), "runs": ns.runs, "num_prompts": ns.num_prompts, "new_tokens": ns.new_tokens,
              "batch_sizes": summarize(runs), "raw": runs}
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0
