"""`specserve eval-acceptance`: how well a drafter is accepted, on real prompts, in one run.

For every (algorithm, temperature, verify mode) it generates for the dataset's prompts (groups of
`--batch-size`, no prefix reuse across groups) and reports, from the verify steps:
- accept length: mean tokens committed per verify step (accepted drafts + the bonus), overall and
  per category;
- per-position acceptance: the share of verify steps whose draft k was accepted (k = 1..g);
- accept rate: accepted drafts / proposed drafts;
- decode tokens/s, and the speedup over NONE at the same temperature when NONE is in the run.
Writes JSON (`--out`) and a PNG (`--plot`): per-position acceptance and the accept-length histogram.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections import Counter
from typing import Any

from specserve.errors import ConfigError
from specserve.args import ServerArgs, number_list


def add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", default="mt-bench", help="mt-bench (80 first turns), humaneval, or a .jsonl file")
    p.add_argument("--num-prompts", type=int, default=0, help="first N prompts (0: all)")
    p.add_argument("--algorithms", default="DSPARK,NGRAM,NONE", help="comma-separated; NONE gives the speedup base")
    p.add_argument("--temperatures", default="0", help="comma-separated, e.g. 0,0.7")
    p.add_argument("--verify-modes", default="static", help="comma-separated: static,compact (DSPARK only)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--out", default=None, help="JSON results")
    p.add_argument("--plot", default=None, help="PNG: per-position acceptance and accept-length histogram")


def run_eval_acceptance(ns: argparse.Namespace, args: ServerArgs) -> int:
    from specserve.datasets import load_prompts
    from specserve.tokenizer.tokenizer import load_tokenizer
    from specserve.models.loader import resolve_model_path

    questions = load_prompts(ns.dataset)
    if ns.num_prompts:
        questions = questions[:ns.num_prompts]
    tokenizer = load_tokenizer(resolve_model_path(args.model_path))
    prompts = [(q["category"], tokenizer.apply_chat_template([{"role": "user", "content": q["prompt"]}]))
               for q in questions]
    algorithms = [a.strip().upper() for a in ns.algorithms.split(",") if a.strip()]
    results = []
    for temperature in number_list("--temperatures", ns.temperatures, float):
        for algorithm in algorithms:
            modes = [m.strip() for m in ns.verify_modes.split(",")] if algorithm == "DSPARK" else ["static"]
            for mode in modes:
                r = evaluate(args, algorithm, mode, temperature, prompts, ns.batch_size, ns.max_new_tokens)
                results.append(r)
                print(json.dumps({k: v for k, v in r.items() if k not in ("per_category", "histogram")}), flush=True)
    add_speedups(results)
    report = {"dataset": ns.dataset, "prompts": len(prompts), "batch_size": ns.batch_size,
              "max_new_tokens": ns.max_new_tokens, "results": results}
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=2)
    if ns.plot:
        plot(results, ns.plot)
    return 0


def evaluate(args: ServerArgs, algorithm: str, mode: str, temperature: float, prompts: list[tuple[str, list[int]]],
             bs: int, max_new_tokens: int) -> dict[str, Any]:
    from specserve.engine import Engine

    # The drafter itself is measured: every request drafts gamma tokens (the policy turned off).
    kw: dict[str, Any] = {"speculative_algorithm": algorithm, "speculative_policy": "fixed"}
    if algorithm == "DSPARK":
        kw["speculative_verify_mode"] = mode
    else:
        kw["speculative_draft_model_path"] = None
    engine = Engine(**{**vars(args), **kw})
    engine.generate(input_ids=prompts[0][1], sampling_params={"temperature": 0, "max_new_tokens": 8})  # warm-up
    engine.reset_prefix_cache()
    outs, start = [], time.perf_counter()
    for i in range(0, len(prompts), bs):
        group = prompts[i:i + bs]
        params = [{"temperature": temperature, "max_new_tokens": max_new_tokens, "seed": i + j} for j in range(len(group))]
        outs += engine.generate(input_ids=[ids for _, ids in group], sampling_params=params)
        engine.reset_prefix_cache()
    wall = time.perf_counter() - start
    gamma = engine.verified_draft_length()
    engine.shutdown()
    del engine
    gc.collect()
    return summarize(algorithm, mode, temperature, [c for c, _ in prompts], outs, wall, gamma)


def summarize(algorithm: str, mode: str, temperature: float, categories: list[str], outs: list[dict], wall: float,
              gamma: int) -> dict[str, Any]:
    """Aggregate the per-request verify histograms (correct drafts per verify step)."""
    total, by_category = Counter(), {}
    for category, out in zip(categories, outs):
        hist = {int(k): v for k, v in out["meta_info"].get("spec_correct_drafts_histogram", {}).items()}
        total.update(hist)
        by_category.setdefault(category, Counter()).update(hist)
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    result = {"algorithm": algorithm, "verify_mode": mode if algorithm == "DSPARK" else None,
              "temperature": temperature, "completion_tokens": tokens, "wall_s": round(wall, 2),
              "tokens_per_s": round(tokens / wall, 2)}
    steps = sum(total.values())
    if steps:
        result.update(accept_length=round(_accept_length(total), 3), verify_steps=steps, gamma=gamma,
                      accept_rate=round(sum(c * n for c, n in total.items()) / (steps * gamma), 4),
                      per_position=[round(sum(n for c, n in total.items() if c >= k) / steps, 4)
                                    for k in range(1, gamma + 1)],
                      histogram={c + 1: total[c] for c in sorted(total)},
                      per_category={cat: round(_accept_length(h), 3) for cat, h in sorted(by_category.items()) if h})
    return result


def _accept_length(hist: Counter) -> float:
    steps = sum(hist.values())
    return sum((c + 1) * n for c, n in hist.items()) / steps


def add_speedups(results: list[dict[str, Any]]) -> None:
    base = {r["temperature"]: r["tokens_per_s"] for r in results if r["algorithm"] == "NONE"}
    for r in results:
        if r["temperature"] in base and r["algorithm"] != "NONE":
            r["speedup_over_none"] = round(r["tokens_per_s"] / base[r["temperature"]], 3)


def plot(results: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib
    except ImportError as e:
        raise ConfigError("--plot needs matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = [r for r in results if "per_position" in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in spec:
        label = _label(r)
        left.plot(range(1, len(r["per_position"]) + 1), r["per_position"], marker="o", label=label)
        lengths = sorted(r["histogram"])
        steps = sum(r["histogram"].values())
        right.plot(lengths, [r["histogram"][n] / steps for n in lengths], marker="s", label=label)
    left.set(xlabel="draft position k", ylabel="share of verify steps accepting draft k", title="per-position acceptance",
             ylim=(0, 1))
    right.set(xlabel="tokens committed per verify step", ylabel="share of verify steps", title="accept-length histogram")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _label(r: dict[str, Any]) -> str:
    mode = f" {r['verify_mode']}" if r.get("verify_mode") else ""
    return f"{r['algorithm']}{mode} T={r['temperature']:g} (accept {r['accept_length']:.2f})"
