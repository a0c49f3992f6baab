"""`python -m benchmarks weight-stream`: where a batch-1 step's weight stream goes, and at what share
of the machine's read bandwidth.

Every packed linear of the model is called once per sweep in the order a step calls them (layer by
layer, then the head), on `--rows` rows, so each reads its weights from memory as in a decode step
(the file is larger than the caches); each call is timed on its own. Per role (qkv, o, gate_up,
down, head) and per weight kind (layout, code bits, scale type): bytes, median ms per sweep and
GB/s, with the read bandwidth probed in the same run (bench/bandwidth.py). bf16 and int8
activations alternate sweep by sweep.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from specserve.args import number_list


def add_weight_stream_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", default=None, help="a GGUF file (default: the embedded model)")
    p.add_argument("--rows", default="1,4", help="row counts (M) of the sweeps")
    p.add_argument("--sweeps", type=int, default=7, help="timed sweeps per (rows, activations)")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def packed_linears(model) -> list[tuple[str, Any]]:
    """(role, kernel) of every packed linear in module order (a step's order)."""
    from specserve.kernels.linear import PackedLinear

    found = []
    for name, module in model.named_modules():
        kernel = getattr(module, "kernel", None)
        if isinstance(kernel, PackedLinear):
            found.append((name.split(".")[-1], kernel))
    return found


def kind_of(kernel) -> str:
    """The layout, code bits and scale type a kernel streams, e.g. 'Q4/4-bit/int8 scales'."""
    layout = {0: "Q4", 1: "Q8", 2: "BF16"}[kernel.format]
    bits = f"/{kernel.bits}-bit" if kernel.format == 0 else ""
    scales = {torch.int8: "int8", torch.float16: "f16", torch.float32: "f32"}.get(kernel.scale.dtype, "none")
    return f"{layout}{bits}/{scales} scales/group {kernel.group}"


def _sweep(linears: list[tuple[str, Any]], inputs: dict[int, torch.Tensor], int8: bool) -> list[float]:
    """One call of every linear in order; each call's seconds."""
    from specserve.kernels.dispatch import path_id

    path, times = path_id(), []
    for _, kernel in linears:
        kernel.int8_activations = int8 and kernel.format != 2 and kernel.k % 32 == 0
        x = inputs[kernel.k]
        start = time.perf_counter()
        kernel.run(x, True, path)
        times.append(time.perf_counter() - start)
    return times


def _summary(linears, sweeps: list[list[float]], key) -> dict[str, dict[str, float]]:
    groups: dict[str, list[int]] = defaultdict(list)
    for i, (role, kernel) in enumerate(linears):
        groups[key(role, kernel)].append(i)
    out = {}
    for name, idx in groups.items():
        seconds = statistics.median(sum(s[i] for i in idx) for s in sweeps)
        nbytes = sum(linears[i][1].nbytes() for i in idx)
        out[name] = {"mib": nbytes / 2**20, "ms": seconds * 1e3, "gb_s": nbytes / seconds / 1e9}
    return out


def run_weight_stream(ns: argparse.Namespace) -> int:
    from specserve.bench.bandwidth import read_bandwidth_gbs
    from specserve.bench.provenance import emit_report, provenance
    from specserve.engine.engine import Engine

    model_path = ns.model_path
    with Engine(model_path=model_path, dtype="bfloat16", speculative_algorithm="NONE", max_total_tokens=256) as engine:
        linears = packed_linears(engine.target_model)
        saved = [k.int8_activations for _, k in linears]
        total = sum(k.nbytes() for _, k in linears)
        report: dict[str, Any] = {"model": model_path or "default",
                                  "weights_mib": total / 2**20, "linears": len(linears), "rows": {}}
        report["read_bandwidth_gbs"] = read_bandwidth_gbs()
        for rows in number_list("--rows", ns.rows):
            inputs = {k.k: torch.randn(rows, k.k).to(torch.bfloat16) for _, k in linears}
            runs: dict[str, list[list[float]]] = {"bf16": [], "int8": []}
            for i in range(ns.sweeps + 1):
                for act in ("bf16", "int8"):
                    times = _sweep(linears, inputs, act == "int8")
                    if i:  # the first sweep warms
                        runs[act].append(times)
            report["rows"][rows] = {
                act: {"ms": statistics.median(sum(s) for s in sweeps) * 1e3,
                      "gb_s": total / statistics.median(sum(s) for s in sweeps) / 1e9,
                      "by_role": _summary(linears, sweeps, lambda role, k: role),
                      "by_kind": _summary(linears, sweeps, lambda role, k: kind_of(k))}
                for act, sweeps in runs.items()}
        for (_, kernel), flag in zip(linears, saved):
            kernel.int8_activations = flag
    report |= provenance(None)
    emit_report(report, ns.out)
    return 0
