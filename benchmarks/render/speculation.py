"""Rendered parts about speculation: the adaptive policy against fixed drafters (table and what
the policy chose), where a DSPARK verify step's time goes, and the overlap loop against the
normal loop."""

from __future__ import annotations

import os
from typing import Any

from benchmarks.render.common import load, provenance, table, versus

WORKLOADS = (("mtbench", "MT-Bench"), ("humaneval", "HumanEval"))


def _rows(data: dict[str, Any]) -> dict[tuple, dict[str, Any]]:
    return {(r["workload"], r["batch_size"], r["config"]): r for r in data["table"]}


def render_spec_policy(results: str) -> str:
    data = load(results, "spec_policy.json")
    rows = _rows(data)
    sizes = sorted({bs for _, bs, _ in rows})
    body = []
    for workload, label in WORKLOADS:
        for config in ("NONE", "NGRAM", "DSPARK", "DEFAULT"):
            cells = []
            for bs in sizes:
                row, none = rows[(workload, bs, config)], rows[(workload, bs, "NONE")]
                runs = row["runs_tokens_per_s"]
                cell = f"{row['tokens_per_s']:.1f} ({min(runs):.1f}-{max(runs):.1f})"
                ratio = row.get("ratio_to_none") or row["tokens_per_s"] / none["tokens_per_s"]
                cells.append(cell if config == "NONE" else f"{cell} {versus(ratio, runs, none['runs_tokens_per_s'])}")
            body.append([f"{label} {config}"] + cells)
    same = all(r["identical_to_none"] for r in data["table"])
    header = ["tok/s: median (min-max of the runs), ratio to NONE"] + [f"bs {b}" for b in sizes]
    return table(header, body) + (f"\n\nA ratio is bold only where every run of the configuration beat every run "
                                  f"of NONE. Tokens equal NONE's in every run: {'yes' if same else '**no**'}. "
                                  f"{provenance(data, 'spec_policy.json')}\n")


def render_spec_ready(results: str) -> str:
    """DEFAULT against NONE at the batch sizes where the policy (almost) never drafts: what keeping
    speculation ready costs a step that does not draft."""
    data = load(results, "spec_ready.json")
    rows = _rows(data)
    sizes = sorted({bs for _, bs, _ in rows})
    body = []
    for workload, label in WORKLOADS:
        for bs in sizes:
            default, none = rows[(workload, bs, "DEFAULT")], rows[(workload, bs, "NONE")]
            runs, base = default["runs_tokens_per_s"], none["runs_tokens_per_s"]
            body.append([f"{label}, batch {bs}", f"{none['tokens_per_s']:.1f} ({min(base):.1f}-{max(base):.1f})",
                         f"{default['tokens_per_s']:.1f} ({min(runs):.1f}-{max(runs):.1f})",
                         versus(default["ratio_to_none"], runs, base), _plan(default)])
    same = all(r["identical_to_none"] for r in data["table"])
    header = ["workload", "NONE tok/s (min-max)", "DEFAULT tok/s (min-max)", "DEFAULT / NONE", "what DEFAULT drafted (last run)"]
    return table(header, body) + (f"\n\n{data['repeats']} interleaved runs each, {data['new_tokens']} new tokens, greedy; "
                                  f"the ratio is the median of the runs' ratios, called a gain or a loss only where the "
                                  f"runs do not overlap. Tokens equal NONE's in every run: {'yes' if same else '**no**'}. "
                                  f"{provenance(data, 'spec_ready.json')}\n")


def _plan(row: dict[str, Any]) -> str:
    steps = sum(row["draft_len_histogram"].values())
    drafted = ", ".join(f"{n} with {d}" for d, n in sorted(row["drafter_steps"].items())) or "none drafted"
    accept = (f", accept length {row['accept_length']:.2f} (predicted {row['predicted_accept_length']:.2f})"
              if row.get("accept_length") and row.get("predicted_accept_length") else "")
    return f"{drafted} of {steps} request-steps{accept}"


def render_spec_policy_notes(results: str) -> str:
    data = load(results, "spec_policy.json")
    rows = _rows(data)
    sizes = sorted({bs for _, bs, _ in rows})
    fixed = "; ".join(f"{label}: NGRAM {rows[(w, 1, 'NGRAM')]['accept_length']:.2f}, DSPARK "
                      f"{rows[(w, 1, 'DSPARK')]['accept_length']:.2f}" for w, label in WORKLOADS)
    plans = "; ".join(f"{label} at batch {bs}: {_plan(rows[(w, bs, 'DEFAULT')])}"
                      for w, label in WORKLOADS for bs in sizes)
    cats = []
    for cat, speeds in sorted(data["by_category_bs1"].items()):
        best = max((c for c in speeds if c != "DEFAULT"), key=speeds.get)
        cats.append(f"{cat} {speeds['DEFAULT']:.1f} / {speeds[best]:.1f} {best}")
    peers = ", ".join(f"{p['peer']} {p['tokens_per_s']:.1f} tok/s ({p['prompts']} prompts)" for p in data["peers"])
    return (f"Accept length of the fixed drafters at batch 1 (steps with drafts): {fixed}. What DEFAULT chose, "
            f"per request-step (the last run of each cell): {plans}. MT-Bench at batch 1 by category (tok/s, "
            f"DEFAULT / best fixed configuration, median runs): {', '.join(cats)}. Peers at batch 1: "
            f"{peers or 'not run'}.\n")


def render_dspark_step(results: str) -> str:
    data = load(results, "dspark_step.json")
    sentences = []
    for mode, runs in data["draft_weights"].items():
        parts = []
        for bs, b in sorted(runs["batch_sizes"].items(), key=lambda kv: int(kv[0])):
            v = b["verify_step_parts_ms"]
            parts.append(f"at batch {bs} a DSPARK verify step takes {v['verify_step']:.2f} ms against a "
                         f"{b['plain_decode_step_ms']:.2f} ms decode step ({b['verify_step_vs_decode_step']:.2f}x), of "
                         f"which drafting {b['drafting_ms']:.2f} ms ({b['drafting_share_of_decode_step']:.0%} of a decode "
                         f"step: block {v['block_hidden']:.2f}, head {v['draft_head']:.2f}, Markov head "
                         f"{v['markov_decode']:.2f}) and the target's verify and accept {v['target_verify_and_accept']:.2f} ms"
                         + (f"; accept length {b['accept_length']:.3f}" if "accept_length" in b else ""))
        sentences.append(f"- drafter weights {mode}: {'; '.join(parts)}.")
    return (f"`python -m benchmarks dspark-step` ({data['num_prompts']} MT-Bench prompts, {data['new_tokens']} new tokens, fixed "
            f"policy: every window drafted and verified whole; the engines interleaved in one run):\n\n"
            + "\n".join(sentences) + f"\n\n{provenance(data, 'dspark_step.json')}\n")


def render_overlap(results: str) -> str:
    data = load(results, "overlap.json")
    sizes = sorted({r["batch_size"] for r in data["rows"]})
    by = {(r["algorithm"], r["batch_size"]): r for r in data["rows"]}
    body = []
    for algorithm in dict.fromkeys(r["algorithm"] for r in data["rows"]):
        cells = [f"{by[(algorithm, bs)]['overlap_tokens_per_s']:.1f} / {by[(algorithm, bs)]['normal_tokens_per_s']:.1f} "
                 f"({by[(algorithm, bs)]['ratio']:.2f})" for bs in sizes]
        body.append([algorithm] + cells)
    shares = [r[f"{loop}_host_processing_share"] for r in data["rows"] for loop in ("overlap", "normal")]
    return table(["tokens/s (overlap / normal)"] + [f"batch {bs}" for bs in sizes], body) + (
        f"\n\nGreedy, {data.get('new_tokens', '?')} new tokens, the fixed policy (every step drafts), best of "
        f"{data.get('repeats', '?')} alternating runs (no spread is recorded, so no ratio here is a measured gain "
        f"or loss); result processing on the host took "
        f"{min(shares):.2%}-{max(shares):.2%} of the wall time. {provenance(data, 'overlap.json')}\n")


def render_prefetch(results: str) -> str:
    """bench prefetch: each step's time with the kernels' prefetching off and on, and on over off."""
    data = load(results, "prefetch.json")
    names = {"decode_step_ms": "decode step", "target_verify_ms": "target verify + accept",
             "verify_step_ms": "DSPARK verify step (with drafting)"}
    rows = []
    for bs, figures in sorted(data["batch_sizes"].items(), key=lambda kv: int(kv[0])):
        for key, label in names.items():
            f = figures[key]
            rows.append([f"batch {bs}: {label}", _ms(f["off"]), _ms(f["on"]),
                         versus(f["speedup"]["median"], _rates(f["on"]), _rates(f["off"]))])
    return (table(["ms per step, median (min-max)", "prefetch off", "prefetch on", "speed, on over off"], rows)
            + f"\n\n{data['runs']} alternating runs of `python -m benchmarks dspark-step` ({data['num_prompts']} MT-Bench prompts, "
            f"{data['new_tokens']} new tokens, Q8_0 drafter weights), each setting in its own process; the ratio is "
            f"the median of the per-run speedups (off / on), a gain or a loss only where the runs' ranges do not overlap. "
            f"{provenance(data, 'prefetch.json')}\n")


def _ms(s: dict[str, float]) -> str:
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"


def _rates(s: dict[str, float]) -> list[float]:
    """Steps per ms at the range's ends (a shorter step is the faster)."""
    return [1.0 / s["max"], 1.0 / s["min"]]


def render_spec_workloads(results: str, file: str = "spec_workloads.json") -> str:
    """Every drafter and the default against NONE on the workloads where speculation matters
    (bench/workloads.py), per batch size, with accept lengths and what the default chose."""
    data = load(results, file)
    rows = _rows(data)
    configs = [c for c in ("NGRAM", "SUFFIX", "DSPARK", "STANDALONE", "DEFAULT") if any(k[2] == c for k in rows)]
    body = []
    for workload, bs in sorted({(w, b) for w, b, _ in rows}):
        none = rows[(workload, bs, "NONE")]
        cells = []
        for config in configs:
            row = rows[(workload, bs, config)]
            accept = f", {row['accept_length']:.2f} per step" if row.get("accept_length") else ""
            cells.append(f"{versus(row['ratio_to_none'], row['runs_tokens_per_s'], none['runs_tokens_per_s'])}{accept}")
        chosen = rows[(workload, bs, "DEFAULT")].get("drafter_steps", {}) if "DEFAULT" in configs else {}
        body.append([workload, bs, f"{none['tokens_per_s']:.1f}"] + cells + [", ".join(f"{k} {v}" for k, v in chosen.items())])
    same = all(r["identical_to_none"] for r in data["table"])
    header = ["workload", "batch", "NONE tok/s"] + [f"{c} vs NONE" for c in configs] + ["DEFAULT's request-steps by drafter"]
    counts = ", ".join(f"{w} {n}" for w, n in data.get("workload_prompts", {}).items())
    return table(header, body) + (
        f"\n\n`specserve bench spec`, greedy, {data['new_tokens']} new tokens, requests per workload: {counts}; "
        f"median of {data['repeats']} interleaved repeats (a ratio is bold only where every run beat every run of "
        f"NONE). Tokens equal NONE's in every run: {'yes' if same else '**no**'}. SUFFIX's global index: "
        f"{data['suffix_index_mib_per_million_tokens']:.0f} MiB per million tokens at worst (no bigram repeating). "
        f"{provenance(data, file)}\n")


def render_standalone_cost(results: str, file: str = "standalone_cost.json") -> str:
    """A STANDALONE step against a plain decode step per target, and the break-even acceptance
    composed from it (`python -m benchmarks standalone-cost`)."""
    data = load(results, file)
    body = []
    for target in data["targets"]:
        for k, row in target["drafts"].items():
            ratio, even = row["step_over_decode"], row["break_even_acceptance"]
            body.append([target["target"], f"{target['decode_step_ms']['median']:.1f}", k,
                         f"{row['step_ms']['median']:.1f}",
                         f"{ratio['median']:.2f} [{ratio['min']:.2f}-{ratio['max']:.2f}]",
                         f"{even['median']:.2f} [{even['min']:.2f}-{even['max']:.2f}]"])
    header = ["target", "decode step ms", "drafts k", "STANDALONE step ms", "step / decode step",
              "break-even acceptance per token (composed)"]
    return table(header, body) + (
        f"\n\nDraft model `{data['draft_model']}`, batch 1, greedy; a step's time is (t({data['new_tokens']} tokens) "
        f"- t(1 token)) / steps of one request, median [lowest-highest] of {data['repeats']} interleaved repeats. "
        "The targets are synthetic (the published tensor tables, random weights): they reject nearly every draft, "
        "so each STANDALONE step is a steady one (the anchor caught up, k - 1 draft decode steps, k + 1 target rows). "
        "The break-even acceptance is the per-token acceptance a at which a window's expected tokens "
        "(1 - a^(k+1)) / (1 - a) repay that step: a price, composed from the measured cost, not a measured speed-up "
        f"(acceptance belongs to a pair of real models). {provenance(data, file)}\n" + _standalone_floor(results))


def _standalone_floor(results: str, file: str = "spec_standalone_1.5b.json") -> str:
    """End to end on the first target, where the drafts fail: what every window drafted costs, and
    whether the default (adaptive over STANDALONE and the lookups) keeps to NONE's speed."""
    data = load(results, file)
    rows = _rows(data)
    cells = []
    for config in ("STANDALONE", "DEFAULT"):
        for (workload, bs, name), row in sorted(rows.items()):
            if name == config:
                none = rows[(workload, bs, "NONE")]
                cells.append(f"{config} {versus(row['ratio_to_none'], row['runs_tokens_per_s'], none['runs_tokens_per_s'])} "
                             f"on {workload} at batch {bs}")
    same = all(r["identical_to_none"] for r in data["table"])
    # The file's drafter is this draft model (a GGUF), not a DSpark drafter to check against the shipped one.
    draft = os.path.basename(data["drafter"]["path"])
    data = {k: v for k, v in data.items() if k != "drafter"}
    return (f"\nEnd to end with the same draft model (`{draft}`) on the first target (`specserve bench spec --configs "
            f"NONE,STANDALONE,DEFAULT`, {data['new_tokens']} new tokens, prefill included, median of {data['repeats']} "
            f"interleaved repeats), against NONE: {'; '.join(cells)}; tokens equal NONE's: {'yes' if same else '**no**'}. "
            f"{provenance(data, file)}\n")
