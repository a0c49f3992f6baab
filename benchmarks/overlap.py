"""`python -m benchmarks overlap`: overlap loop against the normal loop, side by side in one run
(`--compare capture`: captured decode/verify steps against eager steps, both under the overlap loop).

For each algorithm (NONE, NGRAM, DSPARK) one engine is built; for each batch size the same greedy
generation (fixed length, EOS ignored) runs under the normal and the overlap loop, alternating,
`--repeats` times, and the best time of each is kept. Reported: decode tokens/s, the ratio
overlap / normal, and where the host's time goes (scheduling and result processing against
waiting for steps).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from specserve.errors import ConfigError
from specserve.args import ServerArgs, number_list
from specserve.bench.offline import PROMPTS


def add_overlap_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--algorithms", default="NONE,NGRAM,DSPARK")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--compare", choices=("loops", "capture"), default="loops",
                   help="loops: overlap vs normal loop; capture: captured vs eager steps (overlap loop)")
    p.add_argument("--out", default=None)


class HostTimer:
    """Wall time the host spends processing results (the work the overlap loop hides)."""

    def __init__(self, sched):
        self.process_s = 0.0
        original = sched.process_result

        def timed(batch, tokens):
            start = time.perf_counter()
            try:
                return original(batch, tokens)
            finally:
                self.process_s += time.perf_counter() - start

        sched.process_result = timed


def timed_generate(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    params = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    engine.reset_prefix_cache()
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    return time.perf_counter() - start, sum(o["meta_info"]["completion_tokens"] for o in outs)


def bench_algorithm(args: ServerArgs, algorithm: str, sizes: list[int], ns) -> list[dict[str, Any]]:
    from specserve.engine import Engine

    kw = {"speculative_algorithm": algorithm, "speculative_policy": "fixed"}  # every step drafts: loops compared
    if algorithm != "DSPARK":
        kw["speculative_draft_model_path"] = None
    engine = Engine(**{**vars(args), **kw})
    timer = HostTimer(engine.scheduler)
    normal, overlap = engine.new_loop(overlap=False), engine.new_loop(overlap=True)
    captured = not args.disable_cuda_graph
    variants = {"normal": (normal, captured), "overlap": (overlap, captured)}  # name -> (loop, captured steps)
    if ns.compare == "capture":
        variants = {"eager": (overlap, False), "captured": (overlap, True)}
    rows = []
    for bs in sizes:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
                   for i in range(bs)]
        engine.loop = normal
        timed_generate(engine, prompts, 8)  # warm-up
        best = {}
        for _ in range(ns.repeats):
            for name, (loop, captured) in variants.items():  # alternating, so noise hits both alike
                engine.loop = loop
                engine.set_step_choices(captured=captured)
                timer.process_s = 0.0
                wall, tokens = timed_generate(engine, prompts, ns.new_tokens)
                if name not in best or wall < best[name][0]:
                    best[name] = (wall, tokens, timer.process_s)
        row = {"algorithm": algorithm, "batch_size": bs}
        for name, (wall, tokens, process_s) in best.items():
            row[f"{name}_tokens_per_s"] = round(tokens / wall, 2)
            row[f"{name}_host_processing_share"] = round(process_s / wall, 4)
        base, new = variants
        row["ratio"] = round(row[f"{new}_tokens_per_s"] / row[f"{base}_tokens_per_s"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    engine.shutdown()
    return rows


def run_overlap_bench(ns: argparse.Namespace, args: ServerArgs) -> int:
    from specserve.bench.provenance import provenance

    algorithms = [a.strip().upper() for a in ns.algorithms.split(",") if a.strip()]
    if "DSPARK" in algorithms and not args.speculative_draft_model_path:
        raise ConfigError("speculative_draft_model_path: DSPARK needs a drafter (`specserve init-drafter --out DIR`)")
    sizes = number_list("--batch-sizes", ns.batch_sizes)
    rows = []
    for algorithm in algorithms:
        rows += bench_algorithm(args, algorithm, sizes, ns)
    worst = min(r["ratio"] for r in rows)
    label = "overlap / normal" if ns.compare == "loops" else "captured / eager"
    print(f"{label}: worst {worst:.3f}, best {max(r['ratio'] for r in rows):.3f}")
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({**provenance(args.speculative_draft_model_path if "DSPARK" in algorithms else None),
                       "compare": ns.compare, "new_tokens": ns.new_tokens, "repeats": ns.repeats,
                       "rows": rows, "worst_ratio": worst}, f, indent=2)
    return 0
