"""Rendered parts about serving: the grammar library and structured output, SGLang's router, the
serving sweep against llama.cpp's server, and HiCache."""

from __future__ import annotations

import os
import statistics

from benchmarks.render.common import load, provenance, table, versus


def render_grammar(results: str) -> str:
    data = load(results, "grammar.json")
    llg, xgr = data["libraries"]["llguidance"], data["libraries"]["xgrammar"]
    return (f"In `bench_results/grammar.json` llguidance compiles the {data['schemas']} schemas in "
            f"{llg['compile_ms_median']:.3g} ms (median) against XGrammar's {xgr['compile_ms_median']:.3g} ms and "
            f"computes a mask in {llg['mask_ms_per_token']:.3g} ms per token against "
            f"{xgr['mask_ms_per_token']:.3g} ms; XGrammar accepts "
            f"{', '.join('`' + f + '`' for f in xgr['accepted_but_not_enforced'])} and does not enforce them, "
            f"where llguidance refuses them (a 400). {provenance(data, 'grammar.json')}\n")


def render_grammar_engine(results: str) -> str:
    data = load(results, "grammar.json")
    e = data["engine"]
    b1, b16 = e["batch 1"], e["batch 16"]
    return (f"On that run the masks cost {b1['mask_overhead_ms_per_token']:.2f} ms per token at batch 1 "
            f"({e['NONE batch 1 schema']['ms_per_token']:.2f} against {e['NONE batch 1 free']['ms_per_token']:.2f} ms, "
            f"NONE) and {b16['mask_overhead_ms_per_token']:.2f} ms at batch 16; DSPARK's accept length with a schema "
            f"was {e['DSPARK batch 1 schema']['accept_length']:.2f} against {e['DSPARK batch 1 free']['accept_length']:.2f} "
            f"without at batch 1. One run over {e['NONE batch 1 schema']['tokens']} tokens at batch 1: the generated "
            f"schemas are small, so the engine figures are a small sample and no ratio here is a measured gain.\n")


def render_router(results: str) -> str:
    data = load(results, "router.json")
    rows = []
    for key, label in (("cache_aware", "cache-aware"), ("round_robin", "round-robin")):
        arm = data[key]
        rows.append([label, f"{arm['second_turn_hit_rate']:.1%}",
                     f"{arm['second_turn_ttft_ms_mean']:.0f} / {arm['second_turn_ttft_ms_p50']:.0f} ms",
                     " / ".join(map(str, arm["requests_per_replica"]))])
    header = ["router policy", "second turns: prompt tokens from the prefix cache", "second turns: TTFT mean / p50",
              "requests per replica"]
    r, two, one = data["ratios"], data["two_replicas"], data["one_server"]
    return table(header, rows) + (
        f"\n\nThe cache-aware router serves {r['hit_rate_cache_aware_over_round_robin']:.2f}x as many second-turn "
        f"prompt tokens from the cache and cuts their time to first token "
        f"{r['ttft_round_robin_over_cache_aware']:.2f}x. Throughput of the same {two['requests']} first turns "
        f"({data['first_tokens']} tokens each, {data['concurrency']} at a time): 2 replicas "
        f"{two['output_tokens_per_s']:.1f} tokens/s, one server {one['output_tokens_per_s']:.1f} tokens/s, "
        f"{r['throughput_two_replicas_over_one_server']:.2f}x (one run each, no spread: not a measured gain). "
        f"{provenance(data, 'router.json')}\n")


def _median_range(cell: dict[str, float], fmt: str) -> str:
    return f"{cell['median']:{fmt}} ({cell['min']:{fmt}}-{cell['max']:{fmt}})"


DATASETS = {"mt-bench": "MT-Bench first turns", "multiturn": "multi-turn conversations (ShareGPT, turn 2 onward)"}


def render_serving(results: str, file: str = "serving_mtbench.json") -> str:
    data = load(results, file)
    rows_by = {(r["target"], r["concurrency"]): r for r in data["summary"]}
    runs = data["runs"]
    targets = list(dict.fromkeys(r["target"] for r in data["summary"]))
    base = targets[0]
    header = ["concurrency"] + [f"{t} tok/s" for t in targets] + [f"{t} / {base}" for t in targets[1:]] + \
             [f"TPOT p50 (ms) {' / '.join(targets)}", f"TTFT p50 (ms) {' / '.join(targets)}"]
    rows = []
    for c in sorted({c for _, c in rows_by}):
        cells = [rows_by[(t, c)] for t in targets]
        tput = {t: [r["output_tokens_per_s"] for r in runs if r["target"] == t and r["concurrency"] == c] for t in targets}
        rows.append([c] + [_median_range(x["output_tokens_per_s"], ".1f") for x in cells]
                    + [versus(x["throughput_ratio"]["median"], tput[t], tput[base]) + _range(x["throughput_ratio"])
                       for t, x in zip(targets[1:], cells[1:])]
                    + [" / ".join(f"{x['tpot_p50_ms']['median']:.1f}" for x in cells),
                       " / ".join(f"{x['ttft_p50_ms']['median']:.0f}" for x in cells)])
    failed = sum(r["failed"] for r in runs)
    pairs = [(t, "llama-server") for t in targets if t.startswith("llama-server-")]
    pairs += [(targets[-1 - len(pairs)], targets[1])] if len(targets) >= 3 else []
    pair = "".join(f" {_over(runs, a, b)}" for a, b in pairs)
    accept = [f"{r['target']} {r['accept_length']:.2f} at concurrency {r['concurrency']}" for r in runs
              if r.get("accept_length") and r["repeat"] == 0]
    served = sorted(set(data.get("models", {}).values()) - {""})
    servers = data.get("servers", {})
    said = "; ".join(f"{t}: {s.get('speculative_algorithm')}, {s.get('speculative_policy')} policy"
                     for t, s in servers.items() if s)
    return table(header, rows) + (
        f"\n\n" + (f"Served model (as each server named it): {', '.join(f'`{m}`' for m in served)}. " if served else "")
        + f"{data['num_prompts']} {DATASETS.get(data.get('dataset', 'mt-bench'), data.get('dataset'))} a run"
        + (" (each run, round and concurrency, its own: no request repeats)" if data.get("distinct_prompts") else "")
        + f", streamed, greedy, up to {data['max_tokens']} tokens; "
        f"median (lowest-highest) of {data['repeats']} rounds, the targets interleaved in each, each ratio formed "
        f"within its round (bold: every run beat every run of {base}; \"within noise\": the runs overlap); "
        f"failed requests: {failed}.{pair} Accept length (first round): {', '.join(accept) or 'not reported'}. "
        + (f"Servers as they reported themselves: {said}. " if said else "") +
        f"{provenance(data, file)}\n")


def _over(runs: list[dict], a: str, b: str) -> str:
    """Target a's throughput over target b's at each concurrency (speculation over none: the last
    specserve target over the second, a llama-server with a --spec-type over the plain one), each
    ratio formed within its round: median (lowest-highest), a gain or a loss only where the two
    targets' runs do not overlap."""
    cells = []
    for c in sorted({r["concurrency"] for r in runs}):
        mine = {r["repeat"]: r["output_tokens_per_s"] for r in runs if r["target"] == a and r["concurrency"] == c}
        base = {r["repeat"]: r["output_tokens_per_s"] for r in runs if r["target"] == b and r["concurrency"] == c}
        within = sorted(mine[k] / base[k] for k in mine if k in base)
        if within:
            cells.append(f"concurrency {c} {versus(statistics.median(within), list(mine.values()), list(base.values()))} "
                         f"({within[0]:.2f}-{within[-1]:.2f})")
    return f"{a} over {b}, each round's ratio: {'; '.join(cells)}."


def _range(cell: dict[str, float]) -> str:
    return f" ({cell['min']:.2f}-{cell['max']:.2f})"


def render_hicache(results: str) -> str:
    data = load(results, "hicache_mtbench.json")
    radix, hier = data["radix_only"], data["hicache"]
    return (f"`python -m benchmarks hicache --num-questions {data['num_questions']} --answer-tokens {data['answer_tokens']} --device-tokens "
            f"{data['device_tokens']}` (MT-Bench second turns after all first turns, a "
            f"{data['device_tokens']:,}-token device pool, one run): prefix-cache hit rate of the second turns "
            f"{radix['hit_rate']:.2f} (radix only) against {hier['hit_rate']:.2f} (HiCache, "
            f"{hier['hicache_stats']['host_hit_tokens']:,} tokens loaded back from the host), time to first token "
            f"{radix['ttft_ms_mean']:.0f} ms against {hier['ttft_ms_mean']:.0f} ms mean ({data['ttft_ratio']:.1f}x), "
            f"{radix['ttft_ms_p50']:.0f} against {hier['ttft_ms_p50']:.0f} ms median. "
            f"{provenance(data, 'hicache_mtbench.json')}\n")


def render_load(results: str, file: str = "load_1.5b_20min.json") -> str:
    """A `bench load` soak: what was sent and answered, the checks, and the server's memory."""
    data = load(results, file)
    model = next((a for prev, a in zip(data["serve_args"], data["serve_args"][1:]) if prev == "--model-path"), "default")
    hostile = data["sent"].get("hostile", 0)
    checks = ", ".join(f"{name.replace('_', ' ')} {'yes' if ok else 'NO'}" for name, ok in data["checks"].items())
    return (f"`specserve bench load --minutes {data['minutes']:g} --clients {data['clients']} --max-tokens "
            f"{','.join(map(str, data['max_tokens']))}` on `{os.path.basename(model)}`: {sum(data['sent'].values()):,} "
            f"requests in {data['seconds'] / 60:.1f} minutes, {data['valid_sent']:,} valid ones of which "
            f"{data['valid_answered']:,} answered whole and {data['valid_failures']} failed; {hostile:,} hostile ones, "
            f"{hostile - data['hostile_not_4xx']:,} answered 4xx; {data['completion_tokens']:,} completion tokens "
            f"({data['completion_tokens_per_s']:.1f}/s, disconnects and aborts included); KV tokens held at the end "
            f"{_measured(data['kv_request_tokens_at_end'], '.0f')}; resident memory "
            f"{_measured(data['rss_baseline_mib'], '.0f', ' MiB')} at {data.get('rss_baseline_s', 60):g} s, "
            f"{data['rss_end_mib']:.0f} MiB at the end ({_measured(data['rss_growth'], '+.2%')}), peak "
            f"{data['rss_peak_mib']:.0f} MiB.{_series(data)} Checks: {checks}; {'passed' if data['passed'] else 'FAILED'}. "
            f"{provenance(data, file)}\n")


def _measured(value, fmt: str, unit: str = "") -> str:
    """A figure the report may leave unmeasured (None): the value, or 'not measured'."""
    return "not measured" if value is None else f"{value:{fmt}}{unit}"


def _series(data) -> str:
    """The engine processes' resident memory under load, from the baseline on (recorded since the
    report kept a series: [seconds, server MiB, engine MiB] every 30 s)."""
    points = [p for p in data.get("rss_series_mib", []) if p[0] >= data.get("rss_baseline_s", 60)]
    if not points:
        return ""
    engine = [p[2] for p in points]
    return (f" Under load the engine processes held {engine[0]:.0f} MiB at {points[0][0]} s and {engine[-1]:.0f} MiB "
            f"at {points[-1][0]} s ({min(engine):.0f}-{max(engine):.0f} MiB over {len(points)} samples 30 s apart), "
            f"the server process {points[0][1]:.0f} then {points[-1][1]:.0f} MiB.")
