"""`specserve profile-sps`: measure verify steps per second against batch verify tokens.

The compact-mode planner trades expected accepted tokens against step time, so it needs the step
time of a target verify pass as a function of how many rows it carries, on this machine. Each
point runs the real target forward over `ceil(T / W)` requests with a cached prefix of
`prefix_len` tokens (their K/V content does not matter for timing) verifying T rows in total.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Callable, Sequence

import torch

from specserve.args import number_list
from specserve.errors import ConfigError
from specserve.speculative.planner import SpsTable

DEFAULT_TOKENS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def add_profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)),
                   help="comma-separated batch verify token counts to measure")
    p.add_argument("--window", type=int, default=6, help="rows per request (gamma + 1)")
    p.add_argument("--prefix-len", type=int, default=256, help="cached tokens per request")
    p.add_argument("--repeats", type=int, default=5, help="timed passes per point (median is kept)")


def median_call_s(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `repeats` calls of `fn`, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(engine, tokens: Sequence[int], width: int, prefix_len: int, repeats: int) -> SpsTable:
    sps = []
    for total in tokens:
        with engine.forward_rows(total, prefix_len, width=width) as forward:
            sps.append(1.0 / median_call_s(forward, repeats))
        print(f"  {total:4d} verify tokens: {sps[-1]:8.1f} steps/s", flush=True)
    meta = {"window": width, "prefix_len": prefix_len, "threads": torch.get_num_threads(),
            "dtype": str(engine.model.dtype), "model": engine.args.model_path or "default"}
    return SpsTable(tuple(tokens), tuple(sps), meta)


def run_profile_sps(ns: argparse.Namespace, args) -> int:
    from specserve.engine import Engine

    tokens = sorted(set(number_list("--tokens", ns.tokens)))
    if not tokens or tokens[0] < 1:
        raise ConfigError("--tokens: give positive integers")
    bs = math.ceil(tokens[-1] / ns.window)
    size = max(args.max_total_tokens or 0, bs * (ns.prefix_len + ns.window) + 16)
    args = args.replace(speculative_algorithm="NONE", max_total_tokens=size,
                        max_running_requests=max(args.max_running_requests, bs))
    with Engine(**vars(args)) as engine:
        table = measure(engine, tokens, ns.window, ns.prefix_len, ns.repeats)
    table.save(ns.out)
    print(f"wrote {ns.out}")
    return 0
