"""`python -m benchmarks standalone-cost`: what a STANDALONE step costs at the sizes people run, and
the acceptance at which a draft model pays.

For each target file: an engine without speculation and one STANDALONE engine per draft count k
(the policy turned off: every step drafts k tokens with the draft model and verifies them), batch
1, greedy, the same short prompt, each engine warmed up by one untimed round. A step's seconds come
from two generations of one prompt, of 1 and of n tokens: (t_n - t_1) / decode or verify steps, so
the prefill (and the draft model's catch-up over the prompt) drop out. On a synthetic target (random weights) nearly every draft is
rejected, so each STANDALONE step is a steady one: the anchor caught up, k - 1 draft decode steps,
the target over k + 1 rows. The step's cost over a plain decode step, r(k), then prices the draft
model, and the break-even acceptance is the per-token acceptance a at which a window's expected
tokens, (1 - a^(k+1)) / (1 - a), equal r(k): a composed figure (cost measured here, acceptance a
property of the pair of real models), never a measured speed-up. Runs are interleaved (repeat i
times every engine before repeat i + 1); the report gives medians and ranges over repeats.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from typing import Any

from specserve.args import ServerArgs, number_list

PROMPT = [(7919 * i) % 5000 + 100 for i in range(16)]  # plain token ids: every target here reads them


def add_standalone_cost_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--targets", required=True, help="comma-separated target GGUF files")
    p.add_argument("--draft-model", required=True, help="the draft model GGUF (the targets' vocabulary)")
    p.add_argument("--drafts", default="2,4", help="comma-separated draft counts k, one engine each")
    p.add_argument("--new-tokens", type=int, default=33)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the results as JSON here")


def run_standalone_cost(ns: argparse.Namespace, args: ServerArgs) -> int:
    from specserve.bench.provenance import emit_report, provenance

    drafts = number_list("--drafts", ns.drafts)
    rows = [_measure_target(path, ns.draft_model, drafts, ns.new_tokens, ns.repeats, args)
            for path in (p.strip() for p in ns.targets.split(",")) if path]
    report = {**provenance(), "draft_model": os.path.basename(ns.draft_model), "new_tokens": ns.new_tokens,
              "repeats": ns.repeats, "batch_size": 1, "threads": args.num_threads, "targets": rows}
    emit_report(report, ns.out)
    return 0


def _measure_target(path: str, draft: str, drafts: list[int], new_tokens: int, repeats: int,
                    args: ServerArgs) -> dict[str, Any]:
    from specserve.engine import Engine

    base = {"model_path": path, "max_total_tokens": 4096, "max_running_requests": 1, "num_threads": args.num_threads}
    engines = {0: Engine(**base, speculative_algorithm="NONE")}
    for k in drafts:
        engines[k] = Engine(**base, speculative_algorithm="STANDALONE", speculative_policy="fixed",
                            speculative_draft_model_path=draft, speculative_num_steps=k)
    steps: dict[int, list[float]] = {k: [] for k in engines}
    accepted: dict[int, list[float]] = {k: [] for k in engines}
    try:
        for engine in engines.values():  # untimed: a new engine's first steps make what later steps reuse
            _step_seconds(engine, new_tokens)
        for _ in range(repeats):
            for k, engine in engines.items():
                seconds, accept = _step_seconds(engine, new_tokens)
                steps[k].append(seconds)
                accepted[k].append(accept)
    finally:
        for engine in engines.values():
            engine.shutdown()
        del engines
        gc.collect()
    plain = steps[0]
    out: dict[str, Any] = {"target": os.path.basename(path), "decode_step_ms": _spread([s * 1e3 for s in plain]),
                           "drafts": {}}
    for k in drafts:
        ratios = [s / p for s, p in zip(steps[k], plain)]  # repeat by repeat: the same machine state
        out["drafts"][str(k)] = {
            "step_ms": _spread([s * 1e3 for s in steps[k]]),
            "step_over_decode": _spread(ratios),
            "accepted_per_step": _spread(accepted[k]),
            "break_even_acceptance": _spread([break_even(r, k) for r in ratios]),
        }
    return out


def _step_seconds(engine, new_tokens: int) -> tuple[float, float]:
    """Seconds per decode (or verify) step of one request at batch 1, and its drafts accepted per step."""
    greedy = {"temperature": 0, "ignore_eos": True}
    timed = []
    for n in (1, new_tokens):
        engine.reset_prefix_cache()
        start = time.perf_counter()
        out = engine.generate(input_ids=PROMPT, sampling_params={**greedy, "max_new_tokens": n})
        timed.append((time.perf_counter() - start, out["meta_info"]))
    (t1, _), (tn, info) = timed
    verify = info.get("spec_verify_ct", 0)
    steps = verify or new_tokens - 1
    return (tn - t1) / steps, info.get("spec_num_correct_drafts", 0) / verify if verify else 0.0


def break_even(ratio: float, k: int) -> float:
    """The per-token acceptance a at which (1 - a^(k+1)) / (1 - a) = ratio (1 when even all k accepted
    drafts cannot repay the step), by bisection: the left side rises with a from 1 to k + 1."""
    if ratio >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**j for j in range(k + 1)) < ratio:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}
