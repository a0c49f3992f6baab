"""`python -m benchmarks linear-rows`: what a row costs in each linear of the model, bf16 against int8
activations, side by side in one run.

A verify window of k drafts runs every linear on k + 1 rows where a decode step runs one, so how
the time grows with the rows decides what speculation can win. For one decoder layer's linears
(the middle one) and the LM head: the median time of `--calls` calls per row count, bf16 and int8
activations interleaved call by call, with the lowest and highest, and the bf16 multiply-adds per
second (what the row count buys once the weights' bytes stop bounding a call).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from specserve.args import ServerArgs, number_list


def add_linear_rows_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", default="1,2,4,6,16,32", help="row counts (M) to time")
    p.add_argument("--calls", type=int, default=60, help="timed calls per (linear, rows, activations)")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def _linears(model) -> dict[str, Any]:
    """One decoder layer's packed linears (the middle layer) and the LM head, by role."""
    from specserve.kernels.linear import PackedLinear

    middle = f"layers.{model.config.num_layers // 2}."
    found = {}
    for name, module in model.named_modules():
        kernel = getattr(module, "kernel", None)
        if isinstance(kernel, PackedLinear) and (middle in name or name.endswith("lm_head")):
            found[name.split(".")[-1]] = kernel
    return found


def _time(kernel, x: torch.Tensor, int8: bool) -> float:
    kernel.quantize_activations(int8)
    start = time.perf_counter()
    kernel(x, torch.bfloat16)
    return time.perf_counter() - start


def time_linear(kernel, rows: int, calls: int) -> dict[str, Any]:
    """Medians (µs) with ranges, bf16 and int8 interleaved; the kernel is left on bf16."""
    x = torch.randn(rows, kernel.k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    samples: dict[str, list[float]] = {"bf16": [], "int8": []}
    int8_ok = kernel.quantize_activations(True)
    for _ in range(3):  # warm
        _time(kernel, x, False)
        if int8_ok:
            _time(kernel, x, True)
    for _ in range(calls):
        samples["bf16"].append(_time(kernel, x, False))
        if int8_ok:
            samples["int8"].append(_time(kernel, x, True))
    kernel.quantize_activations(False)
    out: dict[str, Any] = {}
    for mode, s in samples.items():
        if s:
            us = [v * 1e6 for v in s]
            out[mode] = {"median_us": statistics.median(us), "min_us": min(us), "max_us": max(us)}
    out["bf16_gmac_s"] = rows * kernel.k * kernel.n / (out["bf16"]["median_us"] * 1e3)
    return out


def run_linear_rows_bench(ns: argparse.Namespace, args: ServerArgs) -> int:
    from specserve.bench.provenance import provenance
    from specserve.engine import Engine
    from specserve.kernels.linear import BF16, Q4, Q8

    format_names = {Q4: "4-bit codes", Q8: "8-bit codes", BF16: "bf16"}
    rows = number_list("--rows", ns.rows)
    report: dict[str, Any] = {**provenance(), "model": args.model_path or "embedded default", "calls": ns.calls,
                              "rows": rows, "linears": {}}
    with Engine(**vars(args.replace(dtype="bfloat16", speculative_algorithm="NONE", cpu_activations="bf16"))) as engine:
        for role, kernel in _linears(engine.target_model).items():
            report["linears"][role] = {"k": kernel.k, "n": kernel.n, "format": format_names[kernel.format],
                                       "by_rows": {str(m): time_linear(kernel, m, ns.calls) for m in rows}}
            print(role, json.dumps(report["linears"][role]["by_rows"])[:400], flush=True)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0
