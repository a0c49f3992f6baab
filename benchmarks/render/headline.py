"""The README's headline figures: a few like-for-like comparisons, each read from its result file
with its spread and the machine it ran on.

Like for like: the kernels against llama.cpp with speculation off on both sides (a decode step;
a prefill), the server against llama-server with neither speculating, and the seed's failure
with and without its fix. The models table's "vs native llama.cpp (tg128)" column is not one of
them: it sets specserve's default speculation against llama.cpp without any.
"""

from __future__ import annotations

import os
from typing import Any

from benchmarks.render.common import load, provenance, span
from benchmarks.render.engine import SIZE_RECORDS


def _ratio(cell: dict[str, float]) -> str:
    return f"{cell['median']:.2f}x ({cell['min']:.2f}-{cell['max']:.2f})"


def _file_stem(model: dict[str, Any]) -> str:
    return os.path.basename(model["path"]).removesuffix(".gguf")


def _per_model(data: dict[str, Any], key: str) -> str:
    return ", ".join(f"{_file_stem(m)} ({m.get('activations', 'bf16')} activations) {_ratio(m['summary'][key])}"
                     for m in data["models"].values())


def _startup(data: dict[str, Any]) -> str:
    """First token after a restart against llama-server's after its start, per file."""
    cells = []
    for name, f in data["files"].items():
        ours, native = f["specserve"]["first_token_s"]["median"], f["llama-server"]["first_token_s"]["median"]
        cells.append(f"{name.removesuffix('.gguf')} {_ratio(f['first_token_ratio'])} ({ours:.1f} s against {native:.1f} s)")
    return (f"- **Start-up at 1.5-7B** (synthetic weights): first token after a restart, against `llama-server` "
            f"starting on the same file: {', '.join(cells)}; a first start packs the file for the kernels and keeps "
            f"the packed weights for the restarts. Median (lowest-highest) of {data['rounds']} interleaved rounds. "
            f"{provenance(data, 'startup.json')}\n")


def render_headline(results: str) -> str:
    models = load(results, "models.json")
    serving = load(results, "serving_mtbench.json")
    seed = load(results, "seed_failure.json")
    summary = {(r["target"], r["concurrency"]): r for r in serving["summary"]}
    peer, mine = "llama-server", "specserve-none"
    top = max(c for t, c in summary if t == mine)
    cell = summary[(mine, top)]
    caught = [r for r in seed["aliased"] if r["caught"]]
    clean = [r for r in seed["owned"]
             if r["exit_code"] == 0 and not r["rank_divergences"] and r["events_checked"] == r["events_recorded"]]
    sizes = {f: load(results, f) for f in SIZE_RECORDS if os.path.exists(os.path.join(results, f))}
    return (
        f"- **Batch-1 decode at 1.5-7B, speculation off on both sides** (synthetic weights: real tensor tables, "
        f"random values) against native `llama-bench` tg128 on the same file: "
        f"{', '.join(_per_model(d, 'decode_vs_native') for d in sizes.values())}. Median (lowest-highest) of "
        f"{' or '.join(sorted({str(d['runs']) for d in sizes.values()}))} interleaved runs. "
        f"{' '.join(provenance(d, f) for f, d in sizes.items())}\n" + _startup(load(results, "startup.json")) +
        f"- **Decode step, speculation off on both sides**: one row after 256 cached tokens, speed against "
        f"llama.cpp (llama-cpp-python {models['llama_cpp_python']}) on the same file: {_per_model(models, 'decode_step_speedup')}.\n"
        f"- **Prefill of 512 tokens** against native `llama-bench` pp512 on the same file: "
        f"{_per_model(models, 'prefill_vs_native')}. Median (lowest-highest) of {models['runs']} interleaved runs, "
        f"{models['threads']} threads. {provenance(models, 'models.json')}\n"
        f"- **Serving, neither side speculating**: `specserve serve --speculative-algorithm NONE` against "
        f"`llama-server` ({serving['num_prompts']} MT-Bench first turns, streamed, greedy) at concurrency {top}: "
        f"{cell['output_tokens_per_s']['median']:.1f} against {summary[(peer, top)]['output_tokens_per_s']['median']:.1f} "
        f"output tokens/s, {_ratio(cell['throughput_ratio'])} over {serving['repeats']} rounds. "
        f"{provenance(serving, 'serving_mtbench.json')}\n"
        f"- **The seed's failure, caught**: with its bug planted (aliased accept buffers, rank 1's host copies a "
        f"step late, TP 2) the rank consensus checker stops the run in {len(caught)} of {len(seed['aliased'])} runs, "
        f"{span([r['seconds'] for r in seed['aliased']], 's')} after start; with the fix, {len(clean)} of "
        f"{len(seed['owned'])} runs end clean with every event checked. {provenance(seed, 'seed_failure.json')}\n")
