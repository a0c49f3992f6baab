"""`specserve bench spec`: speculative decoding configurations side by side in one run.

Configurations: NONE (plain decoding), NGRAM, SUFFIX, DSPARK and STANDALONE (the draft model of
--speculative-draft-model-path) with the policy turned off (every request drafts gamma tokens with
that drafter), and DEFAULT (what `specserve serve` runs: the adaptive policy over DSPARK, NGRAM and
SUFFIX, over STANDALONE, NGRAM and SUFFIX given --speculative-algorithm STANDALONE, or the two
lookups for a model without a drafter).
Workloads (bench/workloads.py): MT-Bench first turns (by category at batch 1), HumanEval,
multi-turn chat, code editing, JSON extraction and a repeated task, greedy. SUFFIX's index of past
outputs starts empty at every run, so a repeat never drafts from its own earlier answers. Batch size b is a server's concurrency: every prompt is submitted at once to
an engine that runs at most b requests (--max-running-requests b), admitting the next as one
finishes; at batch 1 each prompt runs alone, so its time is its category's. Each configuration
keeps one engine per batch size; its policy keeps learning across repeats, as a server's would.
Runs are interleaved (repeat r runs every configuration of a workload and batch size before
repeat r + 1, in a rotated order) and the report gives medians over repeats and ratios to NONE.
Peers: Hugging Face transformers greedy and its prompt-lookup decoding at batch 1.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from typing import Any, Optional

import torch

from specserve.errors import ConfigError
from specserve.args import ServerArgs, number_list
from specserve.bench.offline import request_ids
from specserve.bench.workloads import load_workloads
from specserve.datasets import mtbench_first_turns

CONFIGS = {
    "NONE": {"speculative_algorithm": "NONE"},
    "NGRAM": {"speculative_algorithm": "NGRAM", "speculative_policy": "fixed"},
    "SUFFIX": {"speculative_algorithm": "SUFFIX", "speculative_policy": "fixed"},
    "DSPARK": {"speculative_algorithm": "DSPARK", "speculative_policy": "fixed"},
    "STANDALONE": {"speculative_algorithm": "STANDALONE", "speculative_policy": "fixed"},
    "DEFAULT": {},
}
# The targets: DEFAULT >= 0.98x NONE everywhere; at batch 1 >= the best fixed configuration
# minus 2% on every category, and >= 1.3x NONE on extraction.
FLOOR_VS_NONE, FLOOR_VS_BEST, EXTRACTION_TARGET = 0.98, 0.98, 1.3
# Speculation's own workloads: the default at least twice NONE at batch 1.
REPEATING_WORKLOADS, REPEATING_TARGET = ("code-edit", "repeated-task", "multiturn"), 2.0


def add_spec_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", default="NONE,NGRAM,DSPARK,DEFAULT", help=f"comma-separated of {list(CONFIGS)}")
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=80, help="MT-Bench first turns (80: all)")
    p.add_argument("--humaneval-prompts", type=int, default=64, help="HumanEval problems (0: skip)")
    p.add_argument("--workloads", default="mtbench,humaneval",
                   help="comma-separated of multiturn, code-edit, extraction, repeated-task, mtbench, humaneval")
    p.add_argument("--workload-prompts", type=int, default=16, help="requests per workload other than mtbench and humaneval")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hf-prompts", type=int, default=4, help="prompts for the transformers peers (0: skip)")
    p.add_argument("--out", default=None, help="write the results as JSON here (and a PNG beside it)")


def run_spec_bench(ns: argparse.Namespace, args: ServerArgs) -> int:
    from specserve.engine import Engine

    configs = [c.strip().upper() for c in ns.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or "NONE" not in configs:
        raise ConfigError(f"--configs: choose from {list(CONFIGS)}, NONE included (the baseline); got {ns.configs!r}")
    sizes = number_list("--batch-sizes", ns.batch_sizes)
    limits = {"mtbench": ns.num_prompts, "humaneval": ns.humaneval_prompts}
    names = [w for w in (part.strip() for part in ns.workloads.split(",")) if w and limits.get(w, 1) > 0]
    workloads = {name: load_workloads(name, limits.get(name, ns.workload_prompts))[name] for name in names}
    runs, cost, tokenizer = [], None, None
    for bs in sizes:
        engines = {name: Engine(**{**engine_kwargs(args, name), "max_running_requests": bs}) for name in configs}
        tokenizer = engines["NONE"].tokenizer
        for repeat in range(ns.repeats):
            for workload, items in workloads.items():
                prompts = [request_ids(tokenizer, q["messages"]) for q in items]
                categories = [q["category"] for q in items]
                params = [{"temperature": 0, "max_new_tokens": ns.new_tokens,
                           **({"json_schema": q["json_schema"]} if "json_schema" in q else {})} for q in items]
                for name in configs[repeat % len(configs):] + configs[:repeat % len(configs)]:
                    run = run_once(engines[name], prompts, categories, bs, params)
                    run.update(config=name, workload=workload, batch_size=bs, repeat=repeat)
                    runs.append(run)
                    print(_line(run), flush=True)
        fitted = engines["DEFAULT"].speculation_cost_coefficients() if "DEFAULT" in engines else None
        cost = fitted if fitted is not None else cost
        for engine in engines.values():
            engine.shutdown()
        del engines
        gc.collect()
    peers = run_peers(ns, args, mtbench_first_turns()[:ns.num_prompts], tokenizer)
    report = summarize(runs, peers, cost)
    from specserve.bench.provenance import provenance

    report.update(provenance(args.speculative_draft_model_path), new_tokens=ns.new_tokens, repeats=ns.repeats,
                  workload_prompts={w: len(items) for w, items in workloads.items()})
    if "SUFFIX" in configs or "DEFAULT" in configs:  # the global index's memory (worst case: no bigram repeats)
        from specserve.speculative.suffix_index import measure_bytes_per_token

        report["suffix_index_mib_per_million_tokens"] = measure_bytes_per_token(200_000) * 1e6 / 2**20
    print(json.dumps({k: report[k] for k in ("ratios", "targets")}, indent=2))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=2)
        plot(report, os.path.splitext(ns.out)[0] + ".png")
    return 0


def engine_kwargs(args: ServerArgs, name: str) -> dict[str, Any]:
    base = {k: v for k, v in vars(args).items() if not k.startswith("speculative_")}
    if name in ("DSPARK", "STANDALONE", "DEFAULT"):
        base["speculative_draft_model_path"] = args.speculative_draft_model_path
    if name == "DEFAULT" and args.speculative_algorithm == "STANDALONE":  # serve's default with a draft model
        base["speculative_algorithm"] = "STANDALONE"
    return {**base, **CONFIGS[name]}


def run_once(engine, prompts: list[list[int]], categories: list[str], bs: int,
             params: list[dict[str, Any]]) -> dict[str, Any]:
    """Generate every prompt: alone at batch 1 (a group each), else all at once (one group) with
    the engine running at most bs; per group its wall time, tokens and spec counters. SUFFIX's
    index of past outputs starts empty (a run never drafts from an earlier run's answers)."""
    engine.forget_past_outputs()
    groups = []
    group = 1 if bs == 1 else len(prompts)
    for i in range(0, len(prompts), group):
        engine.reset_prefix_cache()  # every run prefills its prompts from scratch
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts[i:i + group], sampling_params=params[i:i + group])
        wall = time.perf_counter() - start
        metas = [o["meta_info"] for o in outs]
        groups.append({"categories": categories[i:i + bs], "wall_s": wall, "outputs": [o["output_ids"] for o in outs],
                       "tokens": sum(m["completion_tokens"] for m in metas),
                       "verify_ct": sum(m.get("spec_verify_ct", 0) for m in metas),
                       "correct": sum(m.get("spec_num_correct_drafts", 0) for m in metas),
                       "predicted": sum(m.get("spec_predicted_accept_length", 0) * m.get("spec_verify_ct", 0)
                                        for m in metas),
                       "drafter_steps": _sum_dicts(m.get("spec_drafter_steps", {}) for m in metas),
                       "draft_len": _sum_dicts(m.get("spec_draft_len_histogram", {}) for m in metas)})
    tokens, wall = sum(g["tokens"] for g in groups), sum(g["wall_s"] for g in groups)
    verify, correct = sum(g["verify_ct"] for g in groups), sum(g["correct"] for g in groups)
    out = {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "groups": groups,
           "accept_length": 1 + correct / verify if verify else None,
           "drafter_steps": _sum_dicts(g["drafter_steps"] for g in groups),
           "draft_len_histogram": _sum_dicts(g["draft_len"] for g in groups)}
    if verify and any(g["predicted"] for g in groups):
        out["predicted_accept_length"] = sum(g["predicted"] for g in groups) / verify
    return out


def _sum_dicts(dicts) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))


def run_peers(ns: argparse.Namespace, args: ServerArgs, questions: list[dict], tokenizer) -> list[dict[str, Any]]:
    if ns.hf_prompts <= 0:
        return []
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q["prompt"]}])
               for q in questions[:ns.hf_prompts]]
    return [run_hf(prompts, ns.new_tokens, lookup) for lookup in (None, args.speculative_num_steps or 5)]


def run_hf(prompts: list[list[int]], new_tokens: int, prompt_lookup: Optional[int]) -> dict[str, Any]:
    import transformers

    from specserve.models.loader import default_model_path

    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                              dtype=torch.bfloat16).eval()
    extra = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    tokens, start = 0, time.perf_counter()
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            out = model.generate(x, max_new_tokens=new_tokens, do_sample=False, attention_mask=torch.ones_like(x), **extra)
            tokens += out.shape[1] - x.shape[1]
    wall = time.perf_counter() - start
    return {"peer": "hf-prompt-lookup" if prompt_lookup else "hf-greedy", "batch_size": 1, "prompts": len(prompts),
            "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def summarize(runs: list[dict[str, Any]], peers: list[dict[str, Any]], cost: Optional[dict]) -> dict[str, Any]:
    """Medians over repeats, ratios to NONE, per-category figures at batch 1 and the targets."""
    cells: dict[tuple, list[dict]] = {}
    for r in runs:
        cells.setdefault((r["workload"], r["batch_size"], r["config"]), []).append(r)
    table, ratios = [], {}
    for (workload, bs, name), rs in sorted(cells.items()):
        none = cells[(workload, bs, "NONE")]
        speed = statistics.median(r["tokens_per_s"] for r in rs)
        row = {"workload": workload, "batch_size": bs, "config": name, "tokens_per_s": speed,
               "runs_tokens_per_s": [r["tokens_per_s"] for r in rs],
               "ratio_to_none": statistics.median(r["tokens_per_s"] / n["tokens_per_s"] for r, n in zip(rs, none)),
               "accept_length": _median([r["accept_length"] for r in rs]),
               "predicted_accept_length": _median([r.get("predicted_accept_length") for r in rs]),
               "identical_to_none": all(_outputs(r) == _outputs(n) for r, n in zip(rs, none)),
               "drafter_steps": rs[-1]["drafter_steps"], "draft_len_histogram": rs[-1]["draft_len_histogram"]}
        table.append(row)
        ratios[f"{name}@{workload}/bs{bs}"] = round(row["ratio_to_none"], 3)
    by_category = category_table(runs)
    return {"table": table, "ratios": ratios, "by_category_bs1": by_category, "peers": peers,
            "targets": check_targets(table, by_category), "default_cost_model_s": cost}


def category_table(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """MT-Bench at batch 1, per category: median over repeats of tokens / wall, per configuration."""
    out: dict[str, dict[str, list[float]]] = {}
    for r in runs:
        if r["workload"] != "mtbench" or r["batch_size"] != 1:
            continue
        per_cat: dict[str, list[float]] = {}
        for g in r["groups"]:
            tokens_wall = per_cat.setdefault(g["categories"][0], [0.0, 0.0])
            tokens_wall[0] += g["tokens"]
            tokens_wall[1] += g["wall_s"]
        for cat, (tokens, wall) in per_cat.items():
            out.setdefault(cat, {}).setdefault(r["config"], []).append(tokens / wall)
    return {cat: {name: statistics.median(v) for name, v in sorted(cfgs.items())} for cat, cfgs in sorted(out.items())}


def check_targets(table: list[dict], by_category: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Each target with its measured value (never asserted: a benchmark reports)."""
    out: dict[str, Any] = {}
    for row in table:
        if row["config"] == "DEFAULT":
            key = f"default_vs_none@{row['workload']}/bs{row['batch_size']}"
            out[key] = {"ratio": round(row["ratio_to_none"], 3), "met": row["ratio_to_none"] >= FLOOR_VS_NONE}
    for row in table:
        if row["config"] == "DEFAULT" and row["batch_size"] == 1 and row["workload"] in REPEATING_WORKLOADS:
            key = f"default_2x_none@{row['workload']}/bs1"
            out[key] = {"ratio": round(row["ratio_to_none"], 3), "met": row["ratio_to_none"] >= REPEATING_TARGET}
    for cat, speeds in by_category.items():
        fixed = {k: v for k, v in speeds.items() if k != "DEFAULT"}
        if "DEFAULT" not in speeds or not fixed:
            continue
        best = max(fixed, key=fixed.get)
        ratio = speeds["DEFAULT"] / fixed[best]
        out[f"default_vs_best_fixed@{cat}/bs1"] = {"best": best, "ratio": round(ratio, 3), "met": ratio >= FLOOR_VS_BEST}
        if cat == "extraction" and "NONE" in speeds:
            ratio = speeds["DEFAULT"] / speeds["NONE"]
            out["default_vs_none@extraction/bs1"] = {"ratio": round(ratio, 3), "met": ratio >= EXTRACTION_TARGET}
    return out


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({row["workload"] for row in report["table"]})
    fig, axes = plt.subplots(1, len(workloads) + 1, figsize=(6 * (len(workloads) + 1), 4.5))
    for ax, workload in zip(axes, workloads):
        rows = [r for r in report["table"] if r["workload"] == workload]
        for name in sorted({r["config"] for r in rows}):
            pts = sorted((r["batch_size"], r["ratio_to_none"]) for r in rows if r["config"] == name)
            ax.plot([str(b) for b, _ in pts], [v for _, v in pts], marker="o", label=name)
        ax.axhline(FLOOR_VS_NONE, color="grey", linestyle=":")
        ax.set(title=f"{workload}: tokens/s vs NONE", xlabel="batch size", ylabel="ratio (median of repeats)")
        ax.legend()
    cats = report["by_category_bs1"]
    names = sorted({n for speeds in cats.values() for n in speeds})
    ax = axes[-1]
    for j, name in enumerate(names):
        ax.bar([i + j / (len(names) + 1) for i in range(len(cats))],
               [speeds.get(name, 0) / speeds["NONE"] for speeds in cats.values()], width=1 / (len(names) + 1), label=name)
    ax.set_xticks(range(len(cats)), list(cats), rotation=45, ha="left")
    ax.set(title="MT-Bench bs1 by category (vs NONE)", ylabel="ratio")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _outputs(run: dict[str, Any]) -> list[list[int]]:
    return [o for g in run["groups"] for o in g["outputs"]]


def _median(values: list) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _line(r: dict[str, Any]) -> str:
    extra = f"  accept {r['accept_length']:.2f}" if r.get("accept_length") else ""
    if r.get("drafter_steps"):
        extra += f"  drafter steps {r['drafter_steps']}  drafts hist {r['draft_len_histogram']}"
    return (f"{r['config']:>8} {r['workload']:>9} bs{r['batch_size']:<3} rep{r['repeat']} {r['tokens']:6d} tok "
            f"{r['wall_s']:7.1f} s {r['tokens_per_s']:8.1f} tok/s{extra}")
