"""The README's headline figures: a few like-for-like comparisons, each read from its result file
with its spread and the machine it ran on.

Like for like: both sides measured the same way, speculation off on both. Decode is batch-1
generation through the whole engine with the prompt's prefill taken out, against native
`llama-bench` tg (no prompt either); prefill is one forward of 512 tokens against `llama-bench`
pp512; start-up is the first token and the first full-speed token after each server's start, cold
and warm, written as a speed-up (llama-server's seconds over ours); the server against llama-server with neither speculating; the stale-accept
race with and without its fix. The at-size rows come first as a user's own file runs them by default
(bf16 activations: `--cpu-activations auto` picks int8 only for the files that passed the quality
gate), int8 beside them as the opt-in it is.
"""

from __future__ import annotations

import os
from typing import Any

from benchmarks.render.common import load, load_renamed, provenance, span
from benchmarks.render.engine import SIZE_RECORDS, STALE_ACCEPT_OLD_RECORD, STALE_ACCEPT_RECORD


def _ratio(cell: dict[str, float]) -> str:
    """Median (range), called within noise where the range spans 1x: no gain, no loss."""
    noise = ", within noise" if cell["min"] <= 1.0 <= cell["max"] else ""
    return f"{cell['median']:.2f}x ({cell['min']:.2f}-{cell['max']:.2f}){noise}"


def _file_stem(model: dict[str, Any]) -> str:
    return os.path.basename(model["path"]).removesuffix(".gguf")


def _per_model(models: list[dict[str, Any]], key: str) -> str:
    return ", ".join(f"{_file_stem(m)} ({m.get('activations', 'bf16')} activations) {_ratio(m['summary'][key])}"
                     for m in models)


def _by_activations(records: dict[str, dict[str, Any]], activations: str) -> list[dict[str, Any]]:
    return [m for d in records.values() for m in d["models"].values() if m.get("activations", "bf16") == activations]


def _at_size(records: dict[str, dict[str, Any]]) -> str:
    runs = " or ".join(sorted({str(d["runs"]) for d in records.values()}))
    return (f"- **Batch-1 decode at 1.5-7B, speculation off on both sides** (synthetic weights: real tensor tables, "
            f"random values) against native `llama-bench` tg128 on the same file, as a user's own file runs by default "
            f"(int8 activations for quantized weights): {_per_model(_by_activations(records, 'int8'), 'decode_vs_native')}"
            f"; with `--cpu-activations bf16` (the exact mode): "
            f"{_per_model(_by_activations(records, 'bf16'), 'decode_vs_native')}. Median (lowest-highest) of {runs} "
            f"interleaved runs. {' '.join(provenance(d, f) for f, d in records.items())}\n")


def _startup(data: dict[str, Any]) -> str:
    """Per file and page-cache state: the restart's speed-up over llama-server (with its warm-up) to
    the first token and to the first full-speed token; the first start's seconds beside them."""
    cells = []
    for name, f in data["files"].items():
        states = "; ".join(
            f"{state} {_ratio(s['speedup']['llama-server']['first_token_s'])} / "
            f"{_ratio(s['speedup']['llama-server']['full_speed_s'])}" for state, s in f["states"].items())
        first = f["specserve_first_start"]
        cells.append(f"{name.removesuffix('.gguf')}: {states} (a first start, packing the file: "
                     f"{first['full_speed_s']:.1f} s to full speed)")
    return (f"- **Start-up at 1.5-7B** (synthetic weights), specserve restarting (mapping the packed weights its "
            f"first start kept) against `llama-server` starting on the same file, speculation off: speed to the first "
            f"token / to the first full-speed token (llama-server's seconds over ours: above 1x specserve is first), "
            f"page cache cold and warm: {'. '.join(cells)}. Median (lowest-highest) of {data['rounds']} interleaved "
            f"rounds. {provenance(data, 'startup.json')}\n")


def _small_files(data: dict[str, Any]) -> str:
    models = list(data["models"].values())
    return (f"- **Decode and prefill on the real small files, speculation off on both sides**, against native "
            f"`llama-bench` on the same file: batch-1 decode through the whole engine, the prompt's prefill taken out, "
            f"against tg128: {_per_model(models, 'decode_vs_native')}; prefill of 512 tokens, one forward on both "
            f"sides, against pp512: {_per_model(models, 'prefill_vs_native')}. Median (lowest-highest) of "
            f"{data['runs']} interleaved runs, {data['threads']} threads. {provenance(data, 'models_small_native.json')}\n")


VS_IK = "models_vs_peers_probed.json"  # the newest record of the default against ik_llama.cpp


def _vs_ik(data: dict[str, Any], name: str) -> str:
    """The default configuration against ik_llama.cpp, the fastest CPU peer, on the same files."""
    models = list(data["models"].values())
    per_gbs = ("; decode per GB/s of the read bandwidth probed beside each side (the machine's own bandwidth moves "
               f"with its neighbours' load): {_per_model(models, 'decode_vs_ik_per_bandwidth')}"
               if all("decode_vs_ik_per_bandwidth" in m["summary"] for m in models) else "")
    return (f"- **Against ik_llama.cpp** (`llama-bench -rtr 1`, the engine demanding CPU users pick) at 1.5-7B, "
            f"specserve's defaults, speculation off on both sides: decode {_per_model(models, 'decode_vs_ik')}; "
            f"prefill of 512 tokens {_per_model(models, 'prefill_vs_ik')}{per_gbs}. Median (lowest-highest) of "
            f"{data['runs']} interleaved runs, {data['threads']} threads. {provenance(data, name)}\n")


def render_headline(results: str) -> str:
    serving = load(results, "serving_mtbench.json")
    race, race_file = load_renamed(results, STALE_ACCEPT_RECORD, STALE_ACCEPT_OLD_RECORD)
    summary = {(r["target"], r["concurrency"]): r for r in serving["summary"]}
    peer, mine = "llama-server", "specserve-none"
    top = max(c for t, c in summary if t == mine)
    cell = summary[(mine, top)]
    caught = [r for r in race["aliased"] if r["caught"]]
    clean = [r for r in race["owned"]
             if r["exit_code"] == 0 and not r["rank_divergences"] and r["events_checked"] == r["events_recorded"]]
    sizes = {f: load(results, f) for f in SIZE_RECORDS if os.path.exists(os.path.join(results, f))}
    return (
        _at_size(sizes) + _vs_ik(load(results, VS_IK), VS_IK) + _startup(load(results, "startup.json")) + _small_files(load(results, "models_small_native.json")) +
        f"- **Serving, neither side speculating**: `specserve serve --speculative-algorithm NONE` against "
        f"`llama-server` ({serving['num_prompts']} MT-Bench first turns, streamed, greedy) at concurrency {top}: "
        f"{cell['output_tokens_per_s']['median']:.1f} against {summary[(peer, top)]['output_tokens_per_s']['median']:.1f} "
        f"output tokens/s, {_ratio(cell['throughput_ratio'])} over {serving['repeats']} rounds. "
        f"{provenance(serving, 'serving_mtbench.json')}\n"
        f"- **The stale-accept race, caught**: with its bug planted (aliased accept buffers, rank 1's host copies a "
        f"step late, TP 2) the rank consensus checker stops the run in {len(caught)} of {len(race['aliased'])} runs, "
        f"{span([r['seconds'] for r in race['aliased']], 's')} after start; with the fix, {len(clean)} of "
        f"{len(race['owned'])} runs end clean with every event checked. {provenance(race, race_file)}\n")
