"""`python -m benchmarks kernel-paths`: the CPU kernel paths this machine runs, side by side in one run.

The same engine serves the same greedy requests through each path (SPECSERVE_CPU_KERNEL_PATH is
read on every kernel call): batch-1 decode tokens/s on MT-Bench first turns and prefill tokens/s
on one long ShareGPT text, with each path's speed relative to the portable generic path. The
paths must give the same tokens; a difference fails the run.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from specserve import envs


def add_kernel_paths_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=3, help="MT-Bench first turns decoded one at a time")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=1024)
    p.add_argument("--paths", default=None, help="comma-separated paths (default: every path this CPU runs)")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def _timed(engine, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], int, float]:
    outputs, started = [], time.perf_counter()
    for ids in prompts:
        engine.reset_prefix_cache()  # every path pays the whole prefill
        outputs.append(engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": new_tokens})["output_ids"])
    return outputs, sum(len(o) for o in outputs), time.perf_counter() - started


def run_kernel_paths_bench(ns: argparse.Namespace) -> int:
    from specserve.datasets import mtbench_first_turns, sharegpt_exchanges
    from specserve.engine import Engine
    from specserve.kernels import dispatch

    paths = ns.paths.split(",") if ns.paths else list(dispatch.available_paths())
    from specserve.bench.provenance import provenance

    results: dict = {**provenance(), "paths": {}}
    saved = os.environ.get(envs.CPU_KERNEL_PATH)
    with Engine(speculative_algorithm="NONE", random_seed=0) as engine:
        chat = [engine.tokenizer.apply_chat_template([{"role": "user", "content": q["prompt"]}])
                for q in mtbench_first_turns()[:ns.num_prompts]]
        text = "\n\n".join(f"{h}\n{a}" for h, a in sharegpt_exchanges(64))
        long_ids = engine.tokenizer.encode(text)[:ns.prefill_tokens]
        reference, same = None, True
        try:
            for path in paths:
                os.environ[envs.CPU_KERNEL_PATH] = path
                _timed(engine, chat[:1], 4)  # warm-up
                outputs, tokens, seconds = _timed(engine, chat, ns.new_tokens)
                _, _, prefill_s = _timed(engine, [long_ids], 1)
                reference = reference or outputs
                same = same and outputs == reference
                results["paths"][path] = {"decode_tokens_per_s": round(tokens / seconds, 2),
                                          "prefill_tokens_per_s": round(len(long_ids) / prefill_s, 1)}
                print(json.dumps({path: results["paths"][path]}), flush=True)
        finally:
            if saved is None:
                os.environ.pop(envs.CPU_KERNEL_PATH, None)
            else:
                os.environ[envs.CPU_KERNEL_PATH] = saved
    if "generic" in results["paths"]:
        base = results["paths"]["generic"]
        for r in results["paths"].values():
            r["decode_vs_generic"] = round(r["decode_tokens_per_s"] / base["decode_tokens_per_s"], 2)
            r["prefill_vs_generic"] = round(r["prefill_tokens_per_s"] / base["prefill_tokens_per_s"], 2)
    results["same_tokens_on_every_path"] = same
    print(json.dumps(results, indent=1))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(results, f, indent=1)
    if not same:
        raise RuntimeError(f"kernel paths {', '.join(paths)} give different tokens: see {ns.out or 'the report above'}")
    return 0
