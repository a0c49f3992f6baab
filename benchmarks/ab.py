"""Compare two git revisions with one `specserve bench` command, interleaved, and report medians.

    .venv/bin/python benchmarks/ab.py --before REV --after REV --runs 3 --out ab.json -- \
        bench offline --skip-hf --new-tokens 64 --batch-size 8

Each revision is checked out into a temporary worktree and run with this checkout's virtualenv
(PYTHONPATH points at the worktree, so its `specserve` package is the one imported). Runs
alternate before/after so drift on a shared machine hits both sides alike. Every numeric leaf of
the JSON the bench writes (`--out`) is collected; the report gives per key the median of each
side and after/before.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def numeric_leaves(obj, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(numeric_leaves(v, f"{prefix}{k}."))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(numeric_leaves(v, f"{prefix}{i}."))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out[prefix.rstrip(".")] = float(obj)
    return out


def run_once(tree: str, bench_args: list[str], workdir: str) -> dict[str, float]:
    out = os.path.join(workdir, "result.json")
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, "-m", "specserve.cli", *bench_args, "--out", out]
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return numeric_leaves(json.load(f))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True)
    p.add_argument("--after", default="HEAD")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--keys", default="tok_s,tokens_per_s", help="report only keys containing one of these")
    p.add_argument("--out", default=None)
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the specserve subcommand and its flags")
    ns = p.parse_args()
    bench_args = [a for a in ns.bench if a != "--"]
    repo = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True).stdout.strip()
    samples: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for side, rev in (("before", ns.before), ("after", ns.after)):
            trees[side] = os.path.join(tmp, side)
            subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", trees[side], rev], check=True,
                           capture_output=True)
        try:
            for i in range(ns.runs):
                for side in ("before", "after"):
                    samples[side].append(run_once(trees[side], bench_args, tmp))
                    print(f"run {i + 1}/{ns.runs} {side} done", file=sys.stderr)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", tree], capture_output=True)
    wanted = [k for k in ns.keys.split(",") if k]
    report = {}
    for key in sorted(samples["before"][0]):
        if not any(w in key for w in wanted):
            continue
        before = statistics.median(s[key] for s in samples["before"])
        after = statistics.median(s[key] for s in samples["after"])
        b_runs, a_runs = [s[key] for s in samples["before"]], [s[key] for s in samples["after"]]
        # Best run of each side (fewest ms, most tokens/s): what a run gets when no neighbour
        # takes the cores; on a shared machine the least disturbed estimate of each side.
        best = min if key.endswith("_ms") or key.endswith("_s") and not key.endswith("tok_s") else max
        b_best, a_best = best(s[key] for s in samples["before"]), best(s[key] for s in samples["after"])
        report[key] = {"before_median": round(before, 3), "after_median": round(after, 3),
                       "after_over_before": round(after / before, 4) if before else None,
                       "before_best": round(b_best, 3), "after_best": round(a_best, 3),
                       "best_after_over_before": round(a_best / b_best, 4) if b_best else None,
                       # the runs' ranges overlap: the two sides are within noise of each other
                       "ranges_overlap": max(b_runs) >= min(a_runs) and max(a_runs) >= min(b_runs),
                       "before_runs": [s[key] for s in samples["before"]],
                       "after_runs": [s[key] for s in samples["after"]]}
    print(json.dumps(report, indent=2))
    if ns.out:
        from specserve.bench.provenance import machine

        shas = {side: subprocess.run(["git", "-C", repo, "rev-parse", rev], capture_output=True, text=True,
                                     check=True).stdout.strip() for side, rev in (("before", ns.before),
                                                                                   ("after", ns.after))}
        with open(ns.out, "w") as f:
            json.dump({"before": shas["before"], "after": shas["after"], "bench": bench_args, "runs": ns.runs,
                       "machine": machine(), "report": report}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
