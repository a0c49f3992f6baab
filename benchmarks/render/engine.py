"""Rendered parts about the engine itself: the CPU kernel paths, the offline benchmark against its
peers and where a step goes, bf16 quality against fp32, and the tensor-parallel figures (the
stale-accept race caught, the soak, what TP 2 and the consensus checker cost)."""

from __future__ import annotations

import math
import os
from typing import Any

from benchmarks.render.common import load, load_renamed, provenance, span, table, versus


def kernel_paths_table(results: str, file: str) -> str:
    data = load(results, file)
    rows = []
    for path, r in data["paths"].items():
        ratio = lambda key: f" ({r[key]:.2f}x generic)" if path != "generic" and key in r else ""  # noqa: E731
        rows.append([path, f"{r['decode_tokens_per_s']:g}{ratio('decode_vs_generic')}",
                     f"{r['prefill_tokens_per_s']:g}{ratio('prefill_vs_generic')}"])
    same = "the same on every path" if data["same_tokens_on_every_path"] else "**not the same on every path**"
    return (table(["path", "decode, batch 1 (tok/s)", "prefill, 1,024 tokens (tok/s)"], rows)
            + f"\n\nTokens: {same} (one run; the bench fails otherwise). {provenance(data, file)}\n")


def render_offline(results: str) -> str:
    data = load(results, "offline_bf16_kernels.json")
    ours, llama, hf = data["specserve"], data.get("llama.cpp", {}), data.get("transformers", {})
    bs = data["batch_size"]
    ms = lambda v: f"{v:.2f}" if v else ""  # noqa: E731
    rows = [["batch 1, tokens/s", f"{ours['batch1_tok_s']:.1f}", f"{llama.get('batch1_tok_s', 0):.1f}",
             f"{hf.get('batch1_tok_s', 0):.1f}", f"{ours['batch1_tok_s'] / llama['batch1_tok_s']:.2f}x" if llama else ""],
            ["decode step (1 row), ms", ms(ours["decode_1_row_ms"]), ms(llama.get("decode_1_row_ms")), "",
             f"{llama['decode_1_row_ms'] / ours['decode_1_row_ms']:.2f}x faster" if llama else ""],
            ["6-row verify step, ms", f"{ours['verify_6_rows_ms']:.2f} ({ours['verify_over_decode']:.2f}x decode)",
             f"{llama['verify_6_rows_ms']:.2f} ({llama['verify_6_rows_ms'] / llama['decode_1_row_ms']:.2f}x decode)"
             if llama else "", "", f"{llama['verify_6_rows_ms'] / ours['verify_6_rows_ms']:.2f}x faster" if llama else ""],
            ["prefill (512 tokens), tokens/s", f"{ours['prefill_tok_s']:.0f}", f"{llama.get('prefill_tok_s', 0):.0f}",
             "", f"{ours['prefill_tok_s'] / llama['prefill_tok_s']:.2f}x" if llama else ""],
            [f"batch {bs}, tokens/s", f"{ours[f'batch{bs}_tok_s']:.0f} ({data['specserve_batch_over_batch1']:.1f}x own "
             "batch 1)", "", "", ""]]
    version = llama.get("version", "?")
    header = ["", "specserve", f"llama.cpp (llama-cpp-python {version})", "transformers", "ratio vs llama.cpp"]
    return table(header, rows) + (f"\n\nbf16, NONE, {data['new_tokens']} new tokens, one run (the ratios have no "
                                  f"spread). {provenance(data, 'offline_bf16_kernels.json')}\n")


PROFILE_GROUPS = (("Q4 linears", lambda k: k.startswith("linear q4")), ("Q8 LM head", lambda k: k.startswith("linear q8")),
                  ("attention", lambda k: k == "attention"),
                  ("norm, RoPE, SiLU", lambda k: k in ("add_rms_norm", "rope_store", "silu_mul", "gelu_tanh_mul")),
                  ("other (Python, embedding)", lambda k: k == "other"), ("step, op by op", lambda k: k == "step"))


def render_step_profile(results: str) -> str:
    data = load(results, "offline_bf16_kernels.json")
    ours = data["specserve"]
    rows = []
    native = ours.get("decoder_layers") == "native"  # files before the native layers have no such step
    for label, key, step in (("decode, 1 row", "decode_profile_ms", "decode_1_row_ms"),
                             ("verify, 6 rows", "verify_profile_ms", "verify_6_rows_ms")):
        prof: dict[str, float] = ours[key]
        rows.append([label] + [f"{sum(v for k, v in prof.items() if pick(k)):.2f}" for _, pick in PROFILE_GROUPS]
                    + ([f"{ours[step]:.2f}"] if native else []))
    header = [""] + [g for g, _ in PROFILE_GROUPS] + (["step, one native call per layer (as served)"] if native else [])
    return table(header, rows) + f"\n\n{provenance(data, 'offline_bf16_kernels.json')}\n"


def _quality_model(data: dict[str, Any]) -> str:
    """A quality record's model file, as its rows name it."""
    return os.path.basename(data["model"]) if data["model"] != "embedded default" else "default (SmolLM2-135M Q4_1)"


def _greedy_pair(pair: dict[str, Any]) -> str:
    return f"{pair['only_ours']} - {pair['only_theirs']} (noise {pair['noise']:.1f})"


def render_quality(results: str) -> str:
    """Per real file: greedy MT-Bench answers identical to fp32's, specserve's bf16 and int8
    activations and llama.cpp itself, with the paired counts (`bench quality --peer-llama-cpp`)."""
    rows, notes = [], []
    for name in TOP1_FILES:
        data = load(results, name)
        model = _quality_model(data)
        arms = [data[k]["greedy_vs_fp32"] for k in ("bfloat16", "int8_activations", "llama.cpp")]
        only = data["int8_gate"]["greedy_only"]
        prompts = len(arms[0]["identical_each"])
        rows.append([model, *(f"{sum(a['identical_each'])} of {prompts} ({a['mean_matching_prefix']:.0%})" for a in arms),
                     _greedy_pair({"only_ours": only["int8"], "only_theirs": only["bf16"],
                                   "noise": math.sqrt(only["int8"] + only["bf16"])}),
                     _greedy_pair(data["int8_activations"]["greedy_vs_llama_cpp"])])  # fmt: skip
        notes.append(f"{model}: {data['num_prompts']} MT-Bench first turns, {data['new_tokens']} new tokens. "
                     f"{provenance(data, name)}")
    head = ["model file", "greedy = fp32: specserve bf16 (mean share before the first difference)", "specserve int8",
            "llama.cpp", "int8 only - bf16 only", "int8 only - llama.cpp only"]
    return table(head, rows) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"


TOP1_FILES = ("quality_top1_smollm2.json", "quality_top1_qwen2.5-coder-0.5b.json", "quality_top1_gemma-3-270m.json")


def _scored(arm: dict[str, Any]) -> str:
    return f"{arm['top1_vs_fp32']:.2%} ({arm['perplexity']:.4f}, {arm['over_fp32_perplexity'] - 1:+.2%})"


def render_quality_top1(results: str) -> str:
    """Per real file: teacher-forced top-1 agreement with fp32 and perplexity, specserve's bf16 and
    int8 activations against llama.cpp itself on the same token ids."""
    rows, notes = [], []
    for name in TOP1_FILES:
        data = load(results, name)
        model = _quality_model(data)
        bf16, int8, peer = data["bfloat16"], data["int8_activations"], data["llama.cpp"]
        paired = int8["top1_vs_llama_cpp"]
        rows.append([model, f"{data['float32']['scored_tokens']:,}", f"{data['float32']['perplexity']:.4f}",
                     _scored(bf16), _scored(int8), _scored(peer),
                     f"{paired['only_ours']} - {paired['only_theirs']} (noise {paired['noise']:.0f})"])  # fmt: skip
        notes.append(f"{model}: {provenance(data, name)}")
    head = ["model file", "scored tokens", "fp32 perplexity", "specserve bf16: top-1 = fp32 (perplexity, vs fp32)",
            "specserve int8", "llama.cpp (its 8-bit activations)", "top-1 = fp32 by int8 only - by llama.cpp only"]
    return table(head, rows) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"


# `specserve bench stale-accept`'s record; its runs before issue 71 wrote seed_failure.json.
STALE_ACCEPT_RECORD, STALE_ACCEPT_OLD_RECORD = "stale_accept.json", "seed_failure.json"


def render_stale_accept(results: str) -> str:
    data, name = load_renamed(results, STALE_ACCEPT_RECORD, STALE_ACCEPT_OLD_RECORD)
    aliased, owned = data["aliased"], data["owned"]
    caught = [r for r in aliased if r["caught"]]
    sites = sorted({r["divergence"]["site"] for r in caught})
    agreed = [r["divergence"]["agreed"] for r in caught]
    late = [r["late_copies_rank1"] for r in owned]
    return (f"- The stale-accept race (`specserve bench stale-accept`: `SPECSERVE_FAULT_ALIAS_ACCEPT_BUFFERS=1 "
            f"specserve soak {' '.join(data['soak_flags'])}`, rank 1's host copies a step late): caught in "
            f"{len(caught)} of {len(aliased)} runs (exit code 3, `Found rank divergence ...` first at site "
            f"{', '.join(repr(s) for s in sites)} after {span(agreed, 'agreed events')}), "
            f"{span([r['seconds'] for r in aliased], 's')} from process start (model loading included). The same "
            f"lag with the fix (owned accept results): exit code 0 in {sum(r['exit_code'] == 0 for r in owned)} of "
            f"{len(owned)} runs, {sum(r['rank_divergences'] or 0 for r in owned)} rank divergences, every event "
            f"checked in {sum(r['events_checked'] == r['events_recorded'] for r in owned)} of {len(owned)}, rank 1's "
            f"late copies "
            f"{span(late, 'a run')}. {provenance(data, name)}\n")


def render_soak(results: str) -> str:
    data = load(results, "soak.json")
    s, f, c = data["summary"], data["faults"], data["config"]
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in f.items() if v is not None)
    minutes = data["budget"]["max_minutes"]
    return (f"- Soak (`specserve soak --max-minutes {minutes:g} {flags} ...`; TP {c['tp_size']}, "
            f"{c['speculative_algorithm']} with the {c['speculative_policy']} policy, HiCache "
            f"{'on' if c['enable_hierarchical_cache'] else 'off'}): {s['tokens_processed']:,} tokens processed, "
            f"{s['tokens_generated']:,} generated ({s['generated_tokens_per_s']:g} tokens/s), {s['requests']:,} "
            f"requests, {_soak_accept(s)}, {s['rank_divergences']} rank divergences and {s['hangs']} hangs "
            f"measured on every rank, {s['consensus_checks']:,} consensus checks covering {s['events_checked']:,} of "
            f"{s['events_recorded']:,} events. {provenance(data, 'soak.json')}\n")


def _soak_accept(summary: dict[str, Any]) -> str:
    if not summary["verify_steps"]:
        return "no step drafted (the policy chose NONE throughout)"
    return (f"accept length {summary['accept_length']:g} (1 + accepted drafts per step with drafts, over "
            f"{summary['verify_steps']:,} such steps)")


def _tp_arm(data: dict[str, Any], arm: str) -> str:
    g = data["generated_tokens_per_s"][arm]
    return f"{g['median']:g} ({g['min']:g}-{g['max']:g})"


def render_tp_cost(results: str) -> str:
    data = load(results, "tp_cost.json")
    runs = lambda arm: [r["generated_tokens_per_s"] for r in data["runs"] if r["arm"] == arm]  # noqa: E731
    tp, chk, ms = data["tp2_over_tp1"], data["checker_over_no_checker"], data["mean_check_ms"]
    return (f"- What TP 2 and the checker cost here (`python -m benchmarks tp-cost`: soak runs of {data['max_tokens']:,} "
            f"tokens each, {data['generated_tokens_per_s']['tp1']['runs']} interleaved runs an arm; generated "
            f"tokens/s, median (min-max)): TP 1 {_tp_arm(data, 'tp1')}, TP 2 {_tp_arm(data, 'tp2')} "
            f"({versus(tp['ratio'], runs('tp2'), runs('tp1'))} TP 1), TP 2 with the consensus checker "
            f"{_tp_arm(data, 'tp2_checker')} ({versus(chk['ratio'], runs('tp2_checker'), runs('tp2'))} without it); "
            f"a check (three small all-reduces and a hash, on its own thread) took {ms['median']:g} ms "
            f"(median of the runs' means), with {data['rank_divergences']} divergences. Two ranks share two cores "
            f"and every layer's two row-parallel linears run as a chain across the ranks (a gloo broadcast per "
            f"rank), so no TP gain is possible here; TP is for machines with a device per rank. "
            f"{provenance(data, 'tp_cost.json')}\n")


def _median_range(figure: dict[str, float], fmt: str, unit: str = "") -> str:
    """'median (min-max)' of one summarized figure."""
    return f"{figure['median']:{fmt}}{unit} ({figure['min']:{fmt}}-{figure['max']:{fmt}})"


def _ratio(figure: dict[str, float]) -> str:
    """A ratio's median and range; called within noise when the range spans 1."""
    text = _median_range(figure, ".2f", "x")
    return text + (", within noise" if figure["min"] <= 1.0 <= figure["max"] else "")


def _models_spec_table(data: dict[str, Any]) -> str:
    """Each model's default speculation against NONE, where the runs measured it."""
    models = {name: m for name, m in data["models"].items() if "default_identical_to_none" in m["summary"]}
    if not models:
        return ""
    cells = sorted({k for m in models.values() for k in m["summary"] if k.startswith("default_vs_none@")},
                   key=lambda k: (k.split("@")[1].split("/")[0], int(k.split("/bs")[1])))
    rows = []
    for name, model in models.items():
        s = model["summary"]
        identical = "yes" if s["default_identical_to_none"]["min"] == 1.0 else "**no**"
        rows.append([f"{_model_label(name)} ({_speculation(model)})"] + [_ratio(s[k]) if k in s else "" for k in cells] + [identical])
    header = ["model (default speculation)"] + [k.split("@")[1].replace("/bs", ", batch ") for k in cells]
    return (f"\n\nThe default speculation's tokens/s over NONE's ({data['spec_prompts']} MT-Bench first turns and "
            f"{data['spec_prompts']} HumanEval problems, greedy, {data['new_tokens']} new tokens, same run"
            f"{_spec_repeats(data)}):\n\n"
            + table(header + ["tokens identical to NONE"], rows) + "\n")


def _spec_repeats(data: dict[str, Any]) -> str:
    """How each run's ratio was formed (records before --spec-repeats ran one repeat each)."""
    n = data.get("spec_repeats", 1)
    return "" if n == 1 else f"; each run's ratio the median of {n} repeats in alternating order"


def _model_label(name: str) -> str:
    """A row's model as `--models` named it, a file path shortened to the file's stem (the row
    names the file itself)."""
    model, sep, rest = name.partition(", ")
    if os.sep in model:
        model = os.path.basename(model).removesuffix(".gguf")
    return model + sep + rest


def _speculation(model: dict[str, Any]) -> str:
    run = model["runs"][0]
    if "speculation" in run:
        return run["speculation"] + (", shipped drafter" if run.get("drafter") else "")
    return "adaptive, shipped drafter" if run.get("drafter") else "none"


def _memory(s: dict[str, Any]) -> str:
    """Resident memory as the file, the KV pool, torch's own runtime (where recorded) and the rest."""
    over = s["rss_over_file_and_kv_mib"]["median"]
    torch_part = s.get("torch_runtime_mib", {}).get("median")
    rest = f" + torch {torch_part:.0f} + {over - torch_part:.0f}" if torch_part is not None else f" + {over:.0f}"
    drafter = s.get("drafter_file_mib", {}).get("median", 0.0)
    weights = f"file {s['file_mib']['median']:.0f}" + (f" + drafter {drafter:.0f}" if drafter else "")
    return f"{s['rss_mib']['median']:.0f} MiB = {weights} + KV {s['kv_mib']['median']:.0f}{rest}"


def render_models(results: str) -> str:
    data = load(results, "models.json")
    rows = []
    native = all("decode_vs_native" in m["summary"] for m in data["models"].values())
    for name, model in data["models"].items():
        s = model["summary"]
        # Only whole calls against whole calls: the bare forward's step and prefill times (ours) are not
        # set against llama-cpp-python's Llama.eval, which includes its wrapper (native pp512 is a bare forward).
        row = [f"{_model_label(name)} (`{model['path']}`; speculation: {_speculation(model)})",
               _median_range(s["decode_tok_s"], ".1f"), _ratio(s["decode_vs_llama_cpp_python"])]
        # Not decode against native tg128: this record decodes with each model's default speculation,
        # llama-bench without any (models_small_native.json has the kernels alone against it).
        row += [_ratio(s["prefill_vs_native"])] if native else []
        row += [_median_range(s["verify_over_decode"], ".2f", "x"), _median_range(s["batch_over_batch1"], ".1f", "x"),
                _memory(s), _median_range(s["load_s"], ".1f", " s")]
        rows.append(row)
    header = ["model", "decode, batch 1 (tok/s)", "vs llama-cpp-python (whole generations, timing only)"]
    header += ["prefill vs native (pp512)"] if native else []
    header += ["6-row verify / decode step", f"batch {data['batch_size']} / batch 1", "resident memory", "load"]
    return table(header, rows) + (
        f"\n\nbf16, with int8 activations where the row says so (each file's default under `--cpu-activations auto`, "
        f"or `--activations` asked for them), each model with its default speculation, {data['new_tokens']} new tokens after a chat prompt (plain text for a base model) whose "
        "prefill counts in the batch-1 time (llama-bench's tg128 has no prompt"
        + (f"; the median of {data['batch1_generations']} generations, ours and llama-cpp-python's" if "batch1_generations" in data else "")
        + "; llama-cpp-python's generations in this record decoded token 0 at every step, its `scores` being filled "
        "only with `logits_all`: a timing, not a generation, fixed in specserve/bench/llamacpp.py since"
        + f"). {data['threads']} threads; median (lowest-highest) of "
        f"{data['runs']} interleaved runs, each ratio formed within its run; llama-cpp-python "
        f"{data['llama_cpp_python']}. {provenance(data, 'models.json')}\n") + _models_spec_table(data)


# The 1-8B records: the first run's files, and files measured later in a run of their own.
SIZE_RECORDS = ("models_at_size.json", "models_at_size_3b.json")


def render_models_at_size(results: str) -> str:
    """The 1-8B files (synthetic weights) against native llama.cpp: decode without the prompt and
    the share of the read bandwidth each side's weight stream uses, prefill, extra rows, memory."""
    records = {f: load(results, f) for f in SIZE_RECORDS if os.path.exists(os.path.join(results, f))}
    data = records[SIZE_RECORDS[0]]
    rows = []
    for record in records.values():
        for name, model in record["models"].items():
            s = model["summary"]
            rows.append([f"{_model_label(name)} (`{model['path']}`)", model["activations"],
                         _median_range(s["steady_decode_tok_s"], ".1f"), _median_range(s["native_tg128_tok_s"], ".1f"),
                         _ratio(s["decode_vs_native"]),
                         f"{s['decode_bandwidth_share']['median']:.0%} vs {s['native_bandwidth_share']['median']:.0%}",
                         _ratio(s["prefill_vs_native"]), _median_range(s["batch_over_batch1"], ".2f", "x"),
                         _median_range(s["verify_over_decode"], ".2f", "x"), _memory(s),
                         _median_range(s["load_s"], ".1f", " s")])  # fmt: skip
    header = ["file (synthetic weights)", "activations", "decode, batch 1 (tok/s)", "native tg128 (tok/s)",
              "decode vs native", "read bandwidth used, ours vs native", "prefill (512) vs native (pp512)",
              f"batch {data['batch_size']} / batch 1", "6-row verify / decode step", "resident memory", "load"]
    bandwidth = [r["specserve"]["read_bandwidth_gbs"] for d in records.values() for m in d["models"].values()
                 for r in m["runs"]]  # fmt: skip
    runs = sorted({d["runs"] for d in records.values()})
    sources = " ".join(f"{provenance(d, f)}" for f, d in records.items())
    return table(header, rows) + (
        f"\n\nSynthetic weights: each file has a real model's tensor table and metadata (`specserve bench synth-model`) "
        "and random values, so these are speed figures only, never quality or acceptance. Speculation "
        f"{'off' if data.get('speculation') == 'none' else 'at each model default'}; our decode "
        f"is {data['new_tokens']} tokens after a chat prompt, without the prompt's prefill (like llama-bench's tg128); "
        "the bandwidth share is the weights one step reads over the step's time, against the machine's read bandwidth "
        f"probed in the same run ({min(bandwidth):.0f}-{max(bandwidth):.0f} GB/s over the runs: the machine's own "
        f"bandwidth varies this much). {data['threads']} threads; median (lowest-highest) of "
        f"{' or '.join(str(r) for r in runs)} interleaved runs, "
        f"each ratio formed within its run; native llama.cpp is `llama-bench` built from llama-cpp-python 0.3.36's "
        f"source; the load column is the engine's build time: packing the file in `models_at_size.json`'s runs, mapping "
        f"the packed weights a first start kept (`--weight-cache`) in the later records'. {sources}\n")


def render_models_vs_ik(results: str, name: str = "models_vs_ik.json") -> str:
    """The default configuration against both peers on the same files, side by side in one run:
    native llama.cpp's llama-bench and ik_llama.cpp's (with its row repacking)."""
    data = load(results, name)
    probed = all("decode_vs_ik_per_bandwidth" in m["summary"] for m in data["models"].values())
    rows = []
    for label, model in data["models"].items():
        s = model["summary"]
        per_gbs = [f"{_ratio(s['decode_vs_native_per_bandwidth'])} / {_ratio(s['decode_vs_ik_per_bandwidth'])}"] if probed else []
        rows.append([f"{_model_label(label)} (`{model['path']}`)", model["activations"],
                     _median_range(s["steady_decode_tok_s"], ".1f"), _median_range(s["native_tg128_tok_s"], ".1f"),
                     _median_range(s["ik_tg128_tok_s"], ".1f"), _ratio(s["decode_vs_native"]), _ratio(s["decode_vs_ik"]),
                     *per_gbs, f"{s['prefill_tok_s']['median']:.0f} vs {s['native_pp512_tok_s']['median']:.0f} vs "
                     f"{s['ik_pp512_tok_s']['median']:.0f}", _ratio(s["prefill_vs_native"]), _ratio(s["prefill_vs_ik"]),
                     _median_range(s["verify_over_decode"], ".2f", "x")])  # fmt: skip
    header = ["file (synthetic weights)", "activations", "decode, batch 1 (tok/s)", "native tg128", "ik tg128",
              "decode vs native", "decode vs ik", *(["decode per GB/s of its probe: vs native / vs ik"] if probed else []),
              "prefill 512 tok/s: ours vs native vs ik", "prefill vs native", "prefill vs ik",
              f"{data.get('window', 6)}-row verify / decode step"]
    bandwidth_note = (
        " Per GB/s: each side's decode over the machine's read bandwidth probed beside it (ours right after our "
        "decode, each peer's the mean of probes just before and after its llama-bench run), since this machine's "
        "bandwidth moves with its neighbours' load from minute to minute.") if probed else ""
    return table(header, rows) + (
        f"\n\nSpeculation off on every side; our decode is {data['new_tokens']} tokens without the prompt's prefill "
        f"(like llama-bench's tg128). Native llama.cpp: `llama-bench {data['llama_bench_args']}` built from "
        f"llama-cpp-python 0.3.36's source; ik_llama.cpp: `llama-bench {data['ik_llama_bench_args']}` built by "
        f"`../shared/tools/build-ik-llama-bench`. {data['threads']} threads; median (lowest-highest) of {data['runs']} "
        f"interleaved runs, each ratio formed within its run.{bandwidth_note} {provenance(data, name)}\n")


def render_long_context(results: str, name: str = "models_long_context.json") -> str:
    """Batch-1 decode after 4k and 8k tokens of context, ours against both peers in one run."""
    data = load(results, name)
    rows = []
    for label, model in data["models"].items():
        s = model["summary"]
        for depth in data["depths"]:
            rows.append([f"`{model['path']}`", model["activations"], f"{depth:,}",
                         _median_range(s[f"decode_at_{depth}_tok_s"], ".1f"),
                         _median_range(s[f"native_decode_at_{depth}_tok_s"], ".1f"),
                         _median_range(s[f"ik_decode_at_{depth}_tok_s"], ".1f"),
                         _ratio(s[f"decode_at_{depth}_vs_native"]), _ratio(s[f"decode_at_{depth}_vs_ik"])])  # fmt: skip
    header = ["file (synthetic weights)", "activations", "context (tokens)", "decode (tok/s)", "native",
              "ik_llama.cpp", "vs native", "vs ik"]
    return table(header, rows) + (
        f"\n\n{data['depth_new_tokens']} tokens generated after the context on every side: ours from the prefix "
        "cache (the context prefilled once, then an N-token request's time beyond a 1-token one), native "
        f"`llama-bench -d DEPTH -n {data['depth_new_tokens']}`, ik_llama.cpp `llama-bench -gp DEPTH,"
        f"{data['depth_new_tokens']} {data['ik_llama_bench_args']}`; K/V bf16 on ours, f16 on theirs (each default). "
        f"{data['threads']} threads; median (lowest-highest) of {data['runs']} interleaved runs, each ratio within "
        f"its run. {provenance(data, name)}\n")


def render_batched(results: str, name: str = "models_vs_peers.json") -> str:
    """Aggregate decode at each batch size against llama-batched-bench's S_TG, and what a B-row step
    costs against a 1-row one, in one run."""
    from specserve.bench.offline import BATCHED_NEW_TOKENS, BATCHED_PROMPT_TOKENS

    data = load(results, name)
    rows = []
    for model in data["models"].values():
        s = model["summary"]
        for batch in data["batched"]:
            native = f"native_batched_{batch}_tok_s" in s  # with --llama-batched-bench
            rows.append([f"`{model['path']}`", model["activations"], str(batch),
                         _median_range(s[f"batched_{batch}_tok_s"], ".1f"),
                         _median_range(s[f"native_batched_{batch}_tok_s"], ".1f") if native else "not run",
                         _ratio(s[f"batched_{batch}_vs_native"]) if native else "",
                         _median_range(s[f"step_{batch}_rows_over_1"], ".2f", "x")])  # fmt: skip
    header = ["file (synthetic weights)", "activations", "batch", "aggregate decode (tok/s)",
              "native S_TG", "vs native", "step of B rows / 1 row (ours)"]
    return table(header, rows) + (
        f"\n\n{BATCHED_PROMPT_TOKENS}-token prompts, distinct, each decoding {BATCHED_NEW_TOKENS} tokens with the "
        "batch: ours with the prompts prefilled once and kept in the prefix cache, the N-token requests' time "
        "beyond 1-token ones (the first tokens cancel), "
        f"native `llama-batched-bench -npp {BATCHED_PROMPT_TOKENS} -ntg {BATCHED_NEW_TOKENS} -npl B` (its S_TG, "
        f"one run of each batch per round). Speculation {'off' if data['speculation'] == 'none' else 'at its default'}. "
        f"{data['threads']} threads; median (lowest-highest) of {data['runs']} interleaved runs, each ratio within "
        f"its run. {provenance(data, name)}\n")


def render_arithmetic(results: str, name: str = "models_vs_peers.json") -> str:
    """Decode, the verify window and prefill priced against the machine: int8 multiply-adds per
    cycle per core against VPDPBUSD's measured peak, weight bytes a second against the read bandwidth."""
    data = load(results, name)
    rows = []
    for model in data["models"].values():
        s, window = model["summary"], model["runs"][0]["specserve"]["window"]
        prefill = model["runs"][0]["specserve"]["prefill_len"]
        # Records before the head's share was kept count it for every prefill row: an upper bound.
        at_most = "head_macs" not in model["runs"][0]["specserve"]
        for shape, label in (("decode", "decode, 1 row"), ("window", f"verify window, {window} rows"),
                             ("prefill", f"prefill, {prefill} rows")):
            bound = "at most " if shape == "prefill" and at_most else ""
            streamed = f"{shape}_weight_gb_s" in s  # a mixture's window and prefill: no bytes figure
            rows.append([f"`{model['path']}`", label, bound + _median_range(s[f"{shape}_macs_per_cycle_per_core"], ".1f"),
                         bound + _median_range({k: 100 * v for k, v in s[f"{shape}_share_of_int8_peak"].items()}, ".1f", "%"),
                         _median_range(s[f"{shape}_weight_gb_s"], ".1f") if streamed else "",
                         _median_range({k: 100 * v for k, v in s[f"{shape}_bandwidth_share"].items()}, ".0f", "%")
                         if streamed else ""])
    first = next(iter(data["models"].values()))["summary"]
    header = ["file (synthetic weights)", "step", "int8 multiply-adds per cycle per core", "of VPDPBUSD's peak",
              "weights read (GB/s)", "of the read bandwidth"]
    return table(header, rows) + (
        f"\n\nThe peak and the clock are measured in each run on every thread at once (`csrc/probe.cpp`): "
        f"VPDPBUSD in independent chains, {_median_range(first['int8_macs_per_cycle_per_core_peak'], '.0f')} "
        f"multiply-adds per cycle per core, at {_median_range(first['clock_ghz'], '.2f', ' GHz')}. A step's "
        "multiply-adds are its linears' weights times its rows (the embedding lookup none; \"at most\": a record "
        "that counted the output head for every prefill row, where it runs for the last); its weight bytes "
        "the packed weights, read once a step whatever its rows. Read bandwidth as the decode figures' "
        f"(`bench/bandwidth.py`). {data['threads']} threads; median (lowest-highest) of {data['runs']} runs. "
        f"{provenance(data, name)}\n")


# The mixtures' records, newest first: a file re-measured in a newer record is rendered from it only
# (the Qwen3 file since its payload became zero-mean; gpt-oss's MXFP4 payload was symmetric before).
MOE_RECORDS = ("models_moe.json", "models_moe_540aed6.json")


def _moe_models(results: str) -> dict[str, tuple[str, dict[str, Any], dict[str, Any]]]:
    """Each mixture file's newest rows, one per activations: the record's model name -> (record
    file, record, model)."""
    rows: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {}
    seen: set[tuple[str, str]] = set()
    for file in MOE_RECORDS:
        if file != MOE_RECORDS[0] and not os.path.exists(os.path.join(results, file)):
            continue  # an older record is optional
        record = load(results, file)
        for name, model in record["models"].items():
            key = (os.path.basename(model["path"]), model["activations"])
            if key not in seen:
                seen.add(key)
                rows[name] = (file, record, model)
    return rows


def render_models_moe(results: str) -> str:
    """The mixtures (synthetic weights) against native llama.cpp: decode, prefill, extra rows and the
    experts a verify window reads against a decode row's, memory, load."""
    models = _moe_models(results)
    used = {file: record for file, record, _ in models.values()}
    data = used[MOE_RECORDS[0]]
    window = data.get("window", 6)
    rows = []
    for name, (_, _, model) in models.items():
        s = model["summary"]
        experts = (f"{s['decode_experts_per_layer']['median']:.1f} vs {s['verify_experts_per_layer']['median']:.1f}"
                   if "verify_experts_per_layer" in s else "not recorded")  # fmt: skip
        rows.append([f"{_model_label(name)} (`{model['path']}`)", model["activations"],
                     _median_range(s["steady_decode_tok_s"], ".1f"), _median_range(s["native_tg128_tok_s"], ".1f"),
                     _ratio(s["decode_vs_native"]), _ratio(s["prefill_vs_native"]),
                     _median_range(s["batch_over_batch1"], ".2f", "x"), _median_range(s["verify_over_decode"], ".2f", "x"),
                     experts, f"{s['rss_mib']['median']:.0f} MiB (file {s['file_mib']['median']:.0f}, KV "
                     f"{s['kv_mib']['median']:.0f})", _median_range(s["load_s"], ".1f", " s")])  # fmt: skip
    header = ["file (synthetic weights)", "activations", "decode, batch 1 (tok/s)", "native tg128 (tok/s)",
              "decode vs native", "prefill (512) vs native (pp512)", f"batch {data['batch_size']} / batch 1",
              f"{window}-row verify / decode step", f"experts read per layer, decode row vs {window}-row window",
              "resident set", "load"]  # fmt: skip
    bandwidth = [r["specserve"]["read_bandwidth_gbs"] for _, _, m in models.values() for r in m["runs"]]
    return table(header, rows) + (
        f"\n\nSynthetic weights (`specserve bench synth-model --shape`): speed figures only. Speculation off; our "
        f"decode is {data['new_tokens']} tokens without the prompt's prefill (like llama-bench's tg128); native "
        f"llama.cpp is `llama-bench {data.get('llama_bench_args', '')}` built from llama-cpp-python 0.3.36's source. "
        f"The experts column is the distinct experts per layer (mean over layers) a decode row and the verify window "
        f"route to (more rows read more experts, beside the window's cost). Read bandwidth probed in the runs: {min(bandwidth):.0f}-"
        f"{max(bandwidth):.0f} GB/s. {data['threads']} threads; median (lowest-highest) of {data['runs']} interleaved "
        f"runs, each ratio formed within its run; the load column maps the packed weights an earlier start kept "
        f"(`--weight-cache`), and the resident set counts those mapped pages only as far as the process touched "
        f"them (a token reads k of E experts). Each file's row from the newest record that measured it: "
        f"{' '.join(provenance(record, file) for file, record in used.items())}\n")


def render_moe_routing(results: str) -> str:
    """The distinct experts per layer a row and a window route to, per token kind and context."""
    data = load(results, "moe_routing.json")
    rows = [[kind, f"{v['row']:.1f}", f"{v['window']:.1f}"] for kind, v in data["figures"].items()]
    header = ["token ids, context", "one row", f"{data['window']}-row window"]
    return table(header, rows) + (
        f"\n\n`python -m benchmarks moe-routing --model-path {os.path.basename(data['model'])}` (synthetic weights): "
        f"distinct experts per layer, mean over layers, of {data['experts']} with {data['experts_per_token']} per "
        f"token (a window's rows routed apart would read up to {data['window'] * data['experts_per_token']}). "
        f"{provenance(data, 'moe_routing.json')}\n")


def render_models_small_native(results: str) -> str:
    """The small files against native llama-bench with the kernels of the 1-8B work (the lead kept)."""
    data = load(results, "models_small_native.json")
    rows = [[f"`{m['path']}`", m["activations"], _median_range(m["summary"]["steady_decode_tok_s"], ".1f"),
             _median_range(m["summary"]["native_tg128_tok_s"], ".1f"), _ratio(m["summary"]["decode_vs_native"]),
             _ratio(m["summary"]["prefill_vs_native"])] for m in data["models"].values()]  # fmt: skip
    header = ["file", "activations", "decode, batch 1 (tok/s)", "native tg128 (tok/s)", "decode vs native",
              "prefill (512) vs native (pp512)"]
    return table(header, rows) + (
        f"\n\n`specserve bench models --no-speculation --no-python-peer` on the real small files (each at its "
        f"default activations), {data['threads']} threads, median (lowest-highest) of {data['runs']} interleaved "
        f"runs, each ratio within its run. {provenance(data, 'models_small_native.json')}\n")


def _start_cells(server: dict[str, Any]) -> str:
    return (f"{server['first_token_s']['median']:.1f} / {server['full_speed_s']['median']:.1f} s "
            f"({server['rss_mib']['median']:.0f} MiB)")


def _speedups(up: dict[str, Any]) -> str:
    return f"{_median_range(up['first_token_s'], '.2f', 'x')} / {_median_range(up['full_speed_s'], '.2f', 'x')}"


def render_startup(results: str, file: str = "startup.json") -> str:
    """Per file and page-cache state: seconds to the first token and to the first full-speed token,
    specserve's restart against llama-server with and without its warm-up, as speed-ups."""
    data = load(results, file)
    rows = []
    for name, f in data["files"].items():
        first = f["specserve_first_start"]
        for state, by_server in f["states"].items():
            up = by_server["speedup"]
            rows.append([f"`{name}` ({f['file_mib']:.0f} MiB)", state, _start_cells(by_server["specserve"]),
                         _start_cells(by_server["llama-server"]), _start_cells(by_server["llama-server --no-warmup"]),
                         _speedups(up["llama-server"]), _speedups(up["llama-server --no-warmup"]),
                         f"{first['first_token_s']:.1f} / {first['full_speed_s']:.1f} s"])  # fmt: skip
    header = ["file (synthetic weights)", "page cache", "specserve restart: first / full-speed token (resident)",
              "llama-server", "llama-server --no-warmup", "speed-up vs llama-server: first / full-speed",
              "vs llama-server --no-warmup", "specserve first start (packs the file)"]
    gap = round((data["full_speed_gap"] - 1) * 100)
    lo, hi = data["steady_tokens"]
    return table(header, rows) + (
        f"\n\n`python -m benchmarks startup` (both servers at a {data['context']}-token KV, {data['threads']} threads, "
        f"speculation off): seconds from starting the process to the first streamed token of a {data['tokens']}-token "
        f"completion sent as soon as `/health` says 200, and to the first full-speed token (the first whose gap is "
        f"within {gap}% of the median gap of tokens {lo}-{hi}: a server that maps its weights lazily pays the page-in "
        "after its first token, one that warms up pays it before `/health`); resident memory of the server and its "
        "engine process after the request. Cold: the page cache dropped before the start; warm: the files that "
        "server reads read through just before it (llama-server's GGUF; specserve's GGUF, then its packed copy, "
        "so a file and a copy that do not both fit leave the copy cached). Speed-ups are llama-server's seconds over "
        "ours within each round (above 1x specserve is first). specserve's first start, once per file with the "
        "GGUF warm, packs the file for its kernels and keeps the packed weights (`--weight-cache`, in a fresh "
        f"folder); the restarts map them. Median (lowest-highest) of {data['rounds']} interleaved rounds. "
        f"{provenance(data, file)}\n")


def render_weight_stream(results: str) -> str:
    """Every linear of a batch-1 step in order: ms per role and weight kind, and GB/s against the
    read bandwidth probed in the same run."""
    data = load(results, "weight_stream.json")
    rows = []
    for rows_n, by_act in data["rows"].items():
        for act, sweep in by_act.items():
            for group in ("by_role", "by_kind"):
                for name, part in sweep[group].items():
                    rows.append([f"{rows_n}", act, name, f"{part['mib']:.0f}", f"{part['ms']:.2f}", f"{part['gb_s']:.1f}"])
            rows.append([f"{rows_n}", act, "**all**", f"{data['weights_mib']:.0f}", f"**{sweep['ms']:.2f}**",
                         f"**{sweep['gb_s']:.1f}** ({sweep['gb_s'] / data['read_bandwidth_gbs']:.0%} of the probe)"])
    return table(["rows", "activations", "linears", "MiB", "ms per step", "GB/s"], rows) + (
        f"\n\n`python -m benchmarks weight-stream --model-path {os.path.basename(data['model'])}` (synthetic weights): each linear called "
        "once per sweep in a step's order, each call timed; median of the sweeps, bf16 and int8 activations "
        f"alternating. Read bandwidth probed in the same run: {data['read_bandwidth_gbs']:.1f} GB/s. "
        f"{provenance(data, 'weight_stream.json')}\n")


def render_linear_rows(results: str) -> str:
    """Per linear: µs per call at each row count, bf16 and int8 activations, and bf16's GMAC/s."""
    data = load(results, "linear_rows.json")
    rows = [str(m) for m in data["rows"]]
    body = []
    for role, linear in data["linears"].items():
        for mode in ("bf16", "int8"):
            cells = [linear["by_rows"][m].get(mode) for m in rows]
            if all(c is None for c in cells):
                continue
            body.append([f"{role} [{linear['n']}x{linear['k']}, {linear['format']}] {mode}",
                         *("-" if c is None else f"{c['median_us']:.0f} ({c['min_us']:.0f}-{c['max_us']:.0f})"
                           for c in cells)])
        body.append([f"{role} bf16 GMAC/s", *(f"{linear['by_rows'][m]['bf16_gmac_s']:.0f}" for m in rows)])
    head = ["linear (µs per call, median (min-max) of " + str(data["calls"]) + ")", *(f"M = {m}" for m in rows)]
    cells = [c for linear in data["linears"].values() for c in linear["by_rows"].values() if "int8" in c]
    faster = sum(c["int8"]["max_us"] < c["bf16"]["min_us"] for c in cells)
    slower = sum(c["int8"]["min_us"] > c["bf16"]["max_us"] for c in cells)
    verdict = (f"int8 activations against bf16, (linear, M) cells: faster beyond the ranges in {faster}, slower "
               f"beyond them in {slower}, within noise in {len(cells) - faster - slower} of {len(cells)}.")
    return table(head, body) + f"\n\n{verdict} {provenance(data, 'linear_rows.json')}\n"
