"""`python -m benchmarks hicache`: a shared-prefix workload with a small device pool, radix-only vs HiCache.

MT-Bench second turns re-use their first turns: every first turn is answered first (greedy), then
every second turn is asked with the whole first exchange as its prefix. With a device pool too small
to keep all first exchanges, the radix cache alone has evicted most of them by then and recomputes;
HiCache loads them back from host memory. Per configuration: prefix-cache hit rate of the second
turns (cached / prompt tokens), their time to first token (a one-token generate each, sequentially)
and HiCache's host hits, in one run, with the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from specserve.args import ServerArgs


def add_hicache_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-questions", type=int, default=40)
    p.add_argument("--answer-tokens", type=int, default=96, help="first-turn answer length")
    p.add_argument("--device-tokens", type=int, default=3000, help="device KV pool size (small on purpose)")
    p.add_argument("--out", default=None)


def run_config(args: ServerArgs, ns: argparse.Namespace, hicache: bool) -> dict[str, Any]:
    from specserve.datasets import mtbench_questions
    from specserve.engine import Engine

    questions = mtbench_questions()[:ns.num_questions]
    kw = {**vars(args), "max_total_tokens": ns.device_tokens, "enable_hierarchical_cache": hicache}
    with Engine(**kw) as engine:
        chat = engine.tokenizer.apply_chat_template
        firsts = [chat([{"role": "user", "content": q["turns"][0]}]) for q in questions]
        answers = engine.generate(input_ids=firsts, sampling_params={"temperature": 0,
                                                                    "max_new_tokens": ns.answer_tokens})
        ttft, cached, prompt = [], 0, 0
        for q, a in zip(questions, answers):
            ids = chat([{"role": "user", "content": q["turns"][0]}, {"role": "assistant", "content": a["text"]},
                        {"role": "user", "content": q["turns"][1]}])
            start = time.perf_counter()
            out = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 1})
            ttft.append(time.perf_counter() - start)
            cached += out["meta_info"]["cached_tokens"]
            prompt += out["meta_info"]["prompt_tokens"]
        stats = engine.prefix_cache_stats() if hicache else {}
    return {"hicache": hicache, "hit_rate": cached / max(1, prompt), "ttft_ms_mean": 1e3 * statistics.mean(ttft),
            "ttft_ms_p50": 1e3 * statistics.median(ttft), "prompt_tokens": prompt, "cached_tokens": cached,
            "hicache_stats": {k: v for k, v in stats.items() if k != "extra"}}


def run_hicache_bench(ns: argparse.Namespace, args: ServerArgs) -> int:
    radix = run_config(args, ns, hicache=False)
    hier = run_config(args, ns, hicache=True)
    from specserve.bench.provenance import provenance

    report = {**provenance(args.speculative_draft_model_path if args.speculating else None), "radix_only": radix, "hicache": hier, "ttft_ratio": radix["ttft_ms_mean"] / hier["ttft_ms_mean"],
              "device_tokens": ns.device_tokens, "num_questions": ns.num_questions, "answer_tokens": ns.answer_tokens}
    print(json.dumps(report, indent=1))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0
