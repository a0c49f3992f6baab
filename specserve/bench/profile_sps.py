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
from typing import Sequence

import torch

from specserve.args import number_list
from specserve.errors import ConfigError
from specserve.models.forward_batch import ForwardBatch
from specserve.speculative.planner import SpsTable

DEFAULT_TOKENS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def add_profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)),
                   help="comma-separated batch verify token counts to measure")
    p.add_argument("--window", type=int, default=6, help="rows per request (gamma + 1)")
    p.add_argument("--prefix-len", type=int, default=256, help="cached tokens per request")
    p.add_argument("--repeats", type=int, default=5, help="timed passes per point (median is kept)")


def verify_pass(engine, total: int, width: int, prefix_len: int) -> ForwardBatch:
    """A verify-shaped ForwardBatch over scratch request rows: `total` rows in windows of `width`."""
    lens = [width] * (total // width) + ([total % width] if total % width else [])
    bs, dev = len(lens), engine.args.device
    if bs > engine.runner.req_to_token.table.shape[0] or bs * (prefix_len + width) > engine.scheduler.ledger.allocator.size:
        raise ConfigError(f"profile-sps: {total} tokens need {bs} requests of {prefix_len + width} slots; "
                         "raise --max-running-requests / --max-total-tokens")
    rows = list(range(bs))
    for r in rows:  # distinct slots per request; their values are whatever the pool holds
        engine.runner.req_to_token.table[r, :prefix_len + width] = torch.arange(1, prefix_len + width + 1) + r * (prefix_len + width)
    seq = [prefix_len + n for n in lens]
    meta = engine.runner.model.ops.attention_metadata(engine.runner.req_to_token.table, rows, seq, lens, dev)
    positions = torch.tensor([prefix_len + i for n in lens for i in range(n)], device=dev)
    slots = torch.cat([engine.runner.req_to_token.table[r, prefix_len:prefix_len + n] for r, n in zip(rows, lens)])
    return ForwardBatch(input_ids=torch.randint(3, 1000, (total,), device=dev), positions=positions,
                        out_cache_loc=slots, attn=meta, logit_rows=torch.arange(total, device=dev))


def measure(engine, tokens: Sequence[int], width: int, prefix_len: int, repeats: int) -> SpsTable:
    model, kv = engine.runner.model, engine.runner.kv
    sps = []
    for total in tokens:
        fb = verify_pass(engine, total, width, prefix_len)
        model(fb, kv)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model(fb, kv)
            times.append(time.perf_counter() - start)
        sps.append(1.0 / statistics.median(times))
        print(f"  {total:4d} verify tokens: {sps[-1]:8.1f} steps/s", flush=True)
    engine.runner.req_to_token.table.zero_()
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
