"""The CUDA-path check run on a lent GPU (`scripts/cuda_check.py` -> bench_results/cuda_check.json)."""

from __future__ import annotations

import ast
import os
from typing import Any

from benchmarks.render.common import REPO, load, provenance, table, versus

CONFIGS = ("overlap+graphs", "sync+graphs", "overlap+eager", "sync+eager")


def _compare(a: dict[str, Any], b: dict[str, Any]) -> str:
    """a's median over b's, a gain or a loss only when their (min, max) ranges do not overlap."""
    return versus(a["tok_s"] / b["tok_s"], a["range"], b["range"])


def _speed(data: dict[str, Any]) -> dict[str, Any]:
    """Every passed speed check's columns ("speed" in older records, "speed_<model>" since), each
    column named after its model where the record has more than one."""
    found = {k.removeprefix("speed").lstrip("_"): v["value"] for k, v in data["checks"].items()
             if (k == "speed" or k.startswith("speed_")) and v["ok"]}
    return {f"{model} {column}" if len(found) > 1 else column: cells
            for model, value in found.items() for column, cells in value.items()}


def _value(checks: dict[str, Any], name: str) -> Any:
    """A check's value, or None where it failed or was skipped."""
    check = checks.get(name)
    return check["value"] if check and check["ok"] else None


def script_checks() -> tuple[str, ...]:
    """The checks scripts/cuda_check.py runs today (its CHECKS tuple, read without importing torch)."""
    with open(os.path.join(REPO, "scripts", "cuda_check.py")) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CHECKS" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise ValueError("scripts/cuda_check.py has no CHECKS tuple")


def render_cuda_check(results: str) -> str:
    data = load(results, "cuda_check.json")
    checks = data["checks"]
    passed = [name for name, c in checks.items() if c["ok"]]
    loops = _value(checks, "loops_and_graphs") or {}
    graphs: dict[str, list[str]] = {}
    for name, v in loops.items():  # "<algorithm> <loop> <graphs|eager>": the counts of the captured runs
        if name.endswith(" graphs"):
            graphs.setdefault(name.split()[0], []).append(f"{v['graphs']} ({name.split()[1]})")
    hi = (_value(checks, "hicache_reload") or {}).get("NONE")
    bf16 = _value(checks, "bf16_consistency")
    silent, caught = _value(checks, "sanitizer_silent"), _value(checks, "sanitizer_catches_alias")
    machine = {**data, "machine": f"{data['device']}, torch {data['torch']}, CUDA {data['cuda']}"}
    never = [n for n in script_checks() if n not in checks]
    lines = [f"- {len(passed)} of {len(checks)} checks passed ({', '.join(f'`{n}`' for n in checks)}), "
             f"failed: {', '.join(data['failed']) or 'none'}."
             + (f" Not run on a GPU yet (the script gained them after this record): {', '.join(f'`{n}`' for n in never)}."
                if never else "")]
    if loops:
        lines.append(f"- Every algorithm under the overlap and the sync loop, with CUDA graphs and eager "
                     f"({len(loops)} engines): the same fp32 output as that algorithm's sync + eager run "
                     f"(greedy, seeded sampling, logprobs, penalties) in "
                     f"{sum(v['same_as_sync_eager'] for v in loops.values())} of {len(loops)}, NONE's greedy tokens in "
                     f"{sum(v['greedy_as_none'] for v in loops.values())} of {len(loops)}; graphs captured per engine: "
                     f"{'; '.join(f'{k} ' + ', '.join(v) for k, v in graphs.items())}.")
    if silent and caught:
        lines.append(f"- The stream sanitizer: silent over {silent['verify_steps']} "
                     f"DSPARK verify steps (overlap, graphs); with `read_accept` planted to hand out views, it "
                     f"stopped the run at the first verify step's host copy (verify results processed before: "
                     f"{caught['verify_steps_before']}).")
    if hi:
        lines.append(f"- HiCache: {hi['evicted_to_host']} tokens evicted to host memory (pinned: {hi['host_pinned']}), "
                     f"{hi['host_hit_tokens']} reloaded, the same tokens as before the eviction.")
    if bf16:
        lines.append(f"- bf16 (torch's cuBLAS matmuls, not claimed batch-invariant on CUDA): "
                     f"{bf16['batched_vs_alone_identical_requests']} of {bf16['requests']} requests identical "
                     f"batched and alone on this tiny model.")
    return "\n".join(lines) + "\n" + _speed_table(data) + "\n" + provenance(machine, "cuda_check.json") + "\n"


def _speed_table(data: dict[str, Any]) -> str:
    speed = _speed(data)
    if not speed:
        return "\n(no speed figures in this record)\n"
    runs = f"{data['runs']} runs" if "runs" in data else "the runs"
    header = [f"decode, fp32 (tokens/s, median (min-max) of {runs})", *speed]
    rows = [[name, *(f"{s[name]['tok_s']:g} ({s[name]['range'][0]:g}-{s[name]['range'][1]:g})"
                     for s in speed.values())] for name in CONFIGS]
    rows.append(["CUDA graphs vs eager (sync loop)", *(_compare(s["sync+graphs"], s["sync+eager"]) for s in speed.values())])
    rows.append(["overlap vs sync loop (graphs)", *(_compare(s["overlap+graphs"], s["sync+graphs"])
                                                   for s in speed.values())])
    return "\n" + table(header, rows) + "\n"


def render_cuda_threaded(results: str) -> str:
    """The overlap loop with the CUDA streams on worker threads (bench_results/cuda_check_threaded.json)
    beside the inline streams of the last full run (cuda_check.json): overlap over sync, graphs."""
    inline, threaded = _speed(load(results, "cuda_check.json")), _speed(load(results, "cuda_check_threaded.json"))
    data = load(results, "cuda_check_threaded.json")
    columns = [c for c in inline if c in threaded]
    rows = [[f"{label} ({file})", *(_compare(s[c]["overlap+graphs"], s[c]["sync+graphs"]) for c in columns)]
            for label, file, s in (("inline streams", "cuda_check.json", inline),
                                   ("threaded streams", "cuda_check_threaded.json", threaded))]
    failed = "; ".join(f"`{n}`: {data['checks'][n]['error']}" for n in data["failed"]) or "none"
    machine = {**data, "machine": f"{data['device']}, torch {data['torch']}, CUDA {data['cuda']}"}
    return (table(["overlap vs sync loop, CUDA graphs (median tokens/s ratio)", *columns], rows) +
            f"\n\nChecks the threaded run failed: {failed}.\n\n" + provenance(machine, "cuda_check_threaded.json") + "\n")
