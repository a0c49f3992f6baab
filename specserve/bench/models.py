"""`specserve bench models`: every model the engine serves, against llama.cpp on the same file and
threads, in one run. Each run measures every model in turn (interleaved), each in a fresh process:
`specserve bench offline --peer llama.cpp` (batch-1 decode, the 1-row decode and 6-row verify
steps, 512-token prefill, batch N, resident memory and load time, then llama-cpp-python on the
same token ids), `specserve bench spec` (the model's default speculation against NONE on MT-Bench
first turns and HumanEval, greedy, at batch 1 and 16; skipped with --spec-prompts 0) and, with
`--llama-bench`, native llama.cpp's `llama-bench` (tg128 and pp512; build it with
scripts/llama_bench.sh), and with `--ik-llama-bench` ik_llama.cpp's, the same way with `-rtr 1`. The summary gives each figure's median and range over the runs;
a ratio is formed within each run (same machine state) before its median is taken.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import shlex
import subprocess
import sys
import tempfile
from typing import Any

from specserve.bench.llamacpp import INSTALL
from specserve.errors import ConfigError

DEFAULT_MODELS = ("default", "qwen2.5-coder-0.5b-instruct-q4_k_m", "gemma-3-270m-q4_k_m")
RUN_TIMEOUT_S = 1800


def add_models_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help="comma-separated model files or packaged names ('default': the embedded model)")
    p.add_argument("--runs", type=int, default=3, help="interleaved runs over all models")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32, help="the batch compared with batch 1")
    p.add_argument("--window", type=int, default=6, help="rows of the verify step timed against a decode step")
    p.add_argument("--llama-bench", default=None, help="a native llama-bench binary (scripts/llama_bench.sh builds one)")
    p.add_argument("--llama-bench-args", default="",
                   help="more llama-bench flags, e.g. '-lm none' to read the file into memory as specserve does "
                        "(like for like where two mappings of a large file would not both fit the page cache)")  # fmt: skip
    p.add_argument("--ik-llama-bench", default=None,
                   help="ik_llama.cpp's llama-bench too (../shared/tools/build-ik-llama-bench builds it), on the same "
                        "files and threads: the fastest CPU peer")
    p.add_argument("--ik-llama-bench-args", default="-rtr 1",
                   help="ik_llama.cpp's flags (default -rtr 1: its run-time row repacking, as its users run it)")
    p.add_argument("--depths", default="",
                   help="context depths (tokens), e.g. 4096,8192: batch-1 decode after that much context on every "
                        "side (ours from the prefix cache, llama-bench -d, ik_llama.cpp's -gp DEPTH,32)")
    p.add_argument("--batched", default="",
                   help="batch sizes, e.g. 1,4,16: aggregate decode of that many 128-token prompts decoding 32 "
                        "tokens together (ours: whole requests less 1-token ones; --llama-batched-bench's S_TG)")
    p.add_argument("--llama-batched-bench", default=None,
                   help="native llama-batched-bench (scripts/llama_cpp_build.sh WORK llama-batched-bench), run at "
                        "the --batched sizes: -npp 128 -ntg 32 -npl B")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--activations", default="auto",
                   help="comma-separated --cpu-activations modes, each model measured in each (auto: the file's "
                        "default; e.g. bf16,int8)")
    p.add_argument("--spec-prompts", type=int, default=16,
                   help="MT-Bench first turns and as many HumanEval problems for default speculation vs NONE (0: skip)")
    p.add_argument("--spec-batch-sizes", default="1,16", help="batch sizes of the speculation comparison")
    p.add_argument("--spec-repeats", type=int, default=2,
                   help="repeats of NONE and the default in each run, in alternating order (the ratio: their median)")
    p.add_argument("--no-speculation", dest="speculation", action="store_false",
                   help="every model with --speculative-algorithm NONE (the kernels alone, like llama-bench)")
    p.add_argument("--no-python-peer", dest="python_peer", action="store_false",
                   help="skip llama-cpp-python (then --llama-bench is the only peer)")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def _offline(model: str, activations: str, ns: argparse.Namespace, folder: str) -> dict[str, Any]:
    peer = ["--peer", "llama.cpp"] if ns.python_peer else []
    return _bench_subcommand(["offline", "--skip-hf", *peer, "--batch-size", str(ns.batch_size),
                              "--window", str(ns.window), "--depths", ns.depths, "--batched", ns.batched],
                             model, activations, ns, folder)


def _spec(model: str, activations: str, ns: argparse.Namespace, folder: str) -> dict[str, Any]:
    """`bench spec` with NONE and DEFAULT only, `--spec-repeats` alternating repeats in one process."""
    report = _bench_subcommand(["spec", "--configs", "NONE,DEFAULT", "--repeats", str(ns.spec_repeats), "--batch-sizes",
                                ns.spec_batch_sizes, "--num-prompts", str(ns.spec_prompts), "--humaneval-prompts",
                                str(ns.spec_prompts), "--hf-prompts", "0"], model, activations, ns, folder)
    return {"table": [{k: row[k] for k in ("workload", "batch_size", "config", "tokens_per_s", "ratio_to_none",
                                           "accept_length", "identical_to_none", "drafter_steps")}
                      for row in report["table"]]}


def _bench_subcommand(args: list[str], model: str, activations: str, ns: argparse.Namespace, folder: str) -> Any:
    """`specserve bench <args>` on one model in a fresh process; its JSON report."""
    out = os.path.join(folder, f"{args[0]}.json")
    cmd = [sys.executable, "-m", "specserve.cli", "bench", *args, "--new-tokens", str(ns.new_tokens),
           "--num-threads", str(ns.threads), "--cpu-activations", activations, "--out", out]
    if model != "default":
        cmd += ["--model-path", model]
    if not ns.speculation:
        cmd += ["--speculative-algorithm", "NONE"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"bench {args[0]} on {model} failed:\n{proc.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def spec_figures(spec: dict[str, Any]) -> dict[str, float]:
    """The default's speed over NONE per workload and batch size, and whether its tokens were NONE's
    (1.0 or 0.0, so that the summary's lowest says whether any run differed)."""
    rows = [r for r in spec["table"] if r["config"] == "DEFAULT"]
    figures = {f"default_vs_none@{r['workload']}/bs{r['batch_size']}": r["ratio_to_none"] for r in rows}
    figures["default_identical_to_none"] = float(all(r["identical_to_none"] for r in rows))
    return figures


def _llama_bench_tests(binary: str, path: str, threads: int, test_args: list[str], extra: str) -> list[dict[str, Any]]:
    """One llama-bench run on `path` (`test_args`: what it times; `extra`: more flags): its JSON tests."""
    cmd = [binary, "-m", path, "-t", str(threads), *test_args, "-o", "json", *shlex.split(extra)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench {' '.join(test_args)} on {path} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def _native(binary: str, path: str, threads: int, extra: str = "") -> dict[str, float]:
    """llama-bench's tg128 and pp512 tokens/s (mean of its 3 repetitions); `extra`: more flags. With
    the machine's read bandwidth probed just before and just after it (their mean): this machine's
    bandwidth moves with its neighbours' load from minute to minute, so a batch-1 decode is compared
    with ours at the bandwidth each one had, as well as raw."""
    from specserve.bench.bandwidth import gguf_step_bytes, read_bandwidth_gbs

    result = {"step_bytes": float(gguf_step_bytes(path))}
    before = read_bandwidth_gbs(threads=threads)  # on the threads ours was probed with
    for test in _llama_bench_tests(binary, path, threads, ["-n", "128", "-p", "512", "-r", "3"], extra):
        name = "tg128_tok_s" if test["n_gen"] else "pp512_tok_s"
        result[name] = float(test["avg_ts"])
    result["read_bandwidth_gbs"] = (before + read_bandwidth_gbs(threads=threads)) / 2
    return result


DEPTH_NEW_TOKENS = 32  # tokens generated after the context on every side


def _peer_at_depths(binary: str, path: str, threads: int, depths: list[int], extra: str, ik: bool) -> dict[str, float]:
    """A llama-bench's batch-1 decode tokens/s after each context depth (the mean of 2 repetitions;
    the context's prefill untimed): native `-d DEPTH -n 32`, ik_llama.cpp's `-gp DEPTH,32`."""
    result = {}
    for depth in depths:
        at = ["-gp", f"{depth},{DEPTH_NEW_TOKENS}", "-n", "0"] if ik else ["-d", str(depth), "-n", str(DEPTH_NEW_TOKENS)]
        result[str(depth)] = float(_llama_bench_tests(binary, path, threads, [*at, "-p", "0", "-r", "2"], extra)[0]["avg_ts"])
    return result


def _depth_peers(ns: argparse.Namespace, path: str, depths: list[int]) -> dict[str, dict[str, float]]:
    """Each llama-bench given, at every depth asked for."""
    peers = {}
    if depths and ns.llama_bench:
        peers["native_depths"] = _peer_at_depths(ns.llama_bench, path, ns.threads, depths, ns.llama_bench_args, False)
    if depths and ns.ik_llama_bench:
        peers["ik_depths"] = _peer_at_depths(ns.ik_llama_bench, path, ns.threads, depths, ns.ik_llama_bench_args, True)
    return peers


def _batched_peer(binary: str, path: str, threads: int, batches: list[int]) -> dict[str, float]:
    """llama-batched-bench's aggregate decode tokens/s (S_TG) at each batch size, its prompts and
    generations the shape of ours (offline.BATCHED_*), the K/V sized for the largest batch."""
    from specserve.bench.offline import BATCHED_NEW_TOKENS, BATCHED_PROMPT_TOKENS

    context = max(batches) * (BATCHED_PROMPT_TOKENS + BATCHED_NEW_TOKENS) + 256
    cmd = [binary, "-m", path, "-t", str(threads), "-tb", str(threads), "-c", str(context),
           "-npp", str(BATCHED_PROMPT_TOKENS), "-ntg", str(BATCHED_NEW_TOKENS), "-npl", ",".join(map(str, batches)),
           "--output-format", "jsonl"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-batched-bench on {path} failed:\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {str(row["pl"]): float(row["speed_tg"]) for row in rows}


def _batched_figures(run: dict[str, Any]) -> dict[str, float]:
    """Per batch size: our aggregate decode tokens/s, native's S_TG and ours over it; and each
    batch's step time over batch 1's (a B-row step priced against a 1-row one), within the run."""
    ours, figures = run["specserve"].get("batched_decode_tok_s", {}), {}
    for batch, rate in ours.items():
        figures[f"batched_{batch}_tok_s"] = rate
        if "1" in ours:
            figures[f"step_{batch}_rows_over_1"] = ours["1"] * int(batch) / rate
        if batch in run.get("native_batched", {}):
            figures[f"native_batched_{batch}_tok_s"] = run["native_batched"][batch]
            figures[f"batched_{batch}_vs_native"] = rate / run["native_batched"][batch]
    return figures


def _arithmetic_figures(run: dict[str, Any]) -> dict[str, float]:
    """Decode, the verify window and prefill as int8 multiply-adds per cycle per core, as a share of
    VPDPBUSD's measured peak (bench/arithmetic.py), and as weight bytes per second, a share of the
    read bandwidth; recorded since the probes were (an AVX-512 machine, packed weights), and priced
    for int8 activations only (bf16 ones multiply with VDPBF16PS). A prefill computes the output
    head for its last row only; a record without the head's share counts it for every row (an upper
    bound, `prefill_head_counted_per_row`)."""
    from specserve.bench.arithmetic import macs_per_cycle_per_core, share_of_int8_peak

    ours = run["specserve"]
    if run.get("activations") != "int8" or not ours.get("linear_macs_per_row") or not ours.get("int8_dot_per_s") \
            or "window" not in ours:
        return {}
    macs, window, prefill = ours["linear_macs_per_row"], ours["window"], ours["prefill_len"]
    head = ours.get("head_macs", 0)
    step_s = {"decode": ours["decode_1_row_ms"] / 1e3, "window": ours[f"verify_{window}_rows_ms"] / 1e3,
              "prefill": prefill / ours["prefill_tok_s"]}
    step_macs = {"decode": macs, "window": window * macs, "prefill": prefill * (macs - head) + head}
    figures = {"clock_ghz": ours["clock_ghz"], "int8_macs_per_cycle_per_core_peak": ours["int8_macs_per_cycle_per_core_peak"],
               "prefill_head_counted_per_row": float("head_macs" not in ours)}
    # A mixture's window and prefill read more experts than a row's share: no bytes figure for them.
    streamed = ("decode",) if "verify_experts_per_layer" in ours else ("decode", "window", "prefill")
    for shape, seconds in step_s.items():
        rate = step_macs[shape] / seconds
        figures[f"{shape}_macs_per_cycle_per_core"] = macs_per_cycle_per_core(rate, ours)
        figures[f"{shape}_share_of_int8_peak"] = share_of_int8_peak(rate, ours)
        if "weights_streamed_mib" in ours and shape in streamed:  # a dense step reads the weights once
            figures[f"{shape}_weight_gb_s"] = ours["weights_streamed_mib"] * 2**20 / seconds / 1e9
            figures[f"{shape}_bandwidth_share"] = figures[f"{shape}_weight_gb_s"] / ours["read_bandwidth_gbs"]
    return figures


def _depth_figures(run: dict[str, Any]) -> dict[str, float]:
    """Per depth: our decode tokens/s there, each peer's, and ours over theirs (within the run)."""
    figures = {}
    for depth, ours in run["specserve"].get("decode_at_depth_tok_s", {}).items():
        figures[f"decode_at_{depth}_tok_s"] = ours
        for key, peer in (("native", "native_depths"), ("ik", "ik_depths")):
            if peer in run:
                figures[f"{key}_decode_at_{depth}_tok_s"] = run[peer][depth]
                figures[f"decode_at_{depth}_vs_{key}"] = ours / run[peer][depth]
    return figures


def _per_bandwidth_figures(ours: dict[str, Any], peer: dict[str, float], key: str) -> dict[str, float]:
    """A peer's read bandwidth around its llama-bench run, and our batch-1 decode over its tg128 with
    each divided by the bandwidth probed beside it: tokens per GB/s, the comparison the neighbours'
    load does not move (recorded since the peers' probes were)."""
    if "read_bandwidth_gbs" not in peer or "read_bandwidth_gbs" not in ours or "decode_tok_s" not in ours:
        return {}
    ours_per_gbs = ours["decode_tok_s"] / ours["read_bandwidth_gbs"]
    return {f"{key}_read_bandwidth_gbs": peer["read_bandwidth_gbs"],
            f"decode_vs_{key}_per_bandwidth": ours_per_gbs / (peer["tg128_tok_s"] / peer["read_bandwidth_gbs"])}


def _figures(run: dict[str, Any], batch_size: int) -> dict[str, float]:
    """One run's figures of one model, ratios formed within the run."""
    ours = run["specserve"]
    figures = {
        "decode_tok_s": ours["batch1_tok_s"], "decode_step_ms": ours["decode_1_row_ms"],
        "verify_over_decode": ours["verify_over_decode"], "prefill_tok_s": ours["prefill_tok_s"],
        "batch_over_batch1": ours[f"batch{batch_size}_tok_s"] / ours["batch1_tok_s"],
        "rss_mib": ours["rss_mib"], "file_mib": ours["file_mib"], "kv_mib": ours["kv_mib"], "load_s": ours["load_s"],
        # The drafter's weights file counts with the model's (recorded since it was measured apart).
        "drafter_file_mib": ours.get("drafter_file_mib", 0.0),
    }
    peer = run.get("llama.cpp")
    if peer:  # llama-cpp-python in the same process shape (absent with --no-python-peer)
        figures |= {"llama_cpp_python_tok_s": peer["batch1_tok_s"],
                    "decode_vs_llama_cpp_python": ours["batch1_tok_s"] / peer["batch1_tok_s"],
                    "llama_cpp_decode_step_ms": peer["decode_1_row_ms"],
                    "decode_step_speedup": peer["decode_1_row_ms"] / ours["decode_1_row_ms"],
                    "prefill_vs_llama_cpp_python": ours["prefill_tok_s"] / peer["prefill_tok_s"]}
    figures["rss_over_file_and_kv_mib"] = ours["rss_mib"] - ours["file_mib"] - figures["drafter_file_mib"] - ours["kv_mib"]
    if "torch_runtime_mib" in ours:  # since the breakdown was recorded
        figures["torch_runtime_mib"] = ours["torch_runtime_mib"]
    if "decode_tok_s" in ours:  # since the steady decode rate and the bandwidth probe were recorded
        figures |= {"steady_decode_tok_s": ours["decode_tok_s"], "read_bandwidth_gbs": ours["read_bandwidth_gbs"],
                    "decode_bandwidth_share": ours["decode_bandwidth_share"]}
    native = run.get("native")
    if native:
        # llama-bench's tg excludes the prompt: against it, our decode without the prefill where recorded
        decode = ours.get("decode_tok_s", ours["batch1_tok_s"])
        figures |= {"native_tg128_tok_s": native["tg128_tok_s"], "native_pp512_tok_s": native["pp512_tok_s"],
                    "decode_vs_native": decode / native["tg128_tok_s"],
                    "prefill_vs_native": ours["prefill_tok_s"] / native["pp512_tok_s"]}
        if "step_bytes" in native and "read_bandwidth_gbs" in ours:  # against its own probe where it has one
            bandwidth = native.get("read_bandwidth_gbs", ours["read_bandwidth_gbs"])
            figures["native_bandwidth_share"] = native["step_bytes"] * native["tg128_tok_s"] / (bandwidth * 1e9)
        figures |= _per_bandwidth_figures(ours, native, "native")
    ik = run.get("ik_llama.cpp")
    if ik:
        decode = ours.get("decode_tok_s", ours["batch1_tok_s"])
        figures |= {"ik_tg128_tok_s": ik["tg128_tok_s"], "ik_pp512_tok_s": ik["pp512_tok_s"],
                    "decode_vs_ik": decode / ik["tg128_tok_s"], "prefill_vs_ik": ours["prefill_tok_s"] / ik["pp512_tok_s"]}
        figures |= _per_bandwidth_figures(ours, ik, "ik")
    if "verify_experts_per_layer" in ours:  # a mixture: the experts a verify window reads, against a decode row's
        figures |= {"decode_experts_per_layer": ours["decode_experts_per_layer"],
                    "verify_experts_per_layer": ours["verify_experts_per_layer"]}
    if run.get("spec"):
        figures |= spec_figures(run["spec"])
    return figures | _depth_figures(run) | _batched_figures(run) | _arithmetic_figures(run)


def summarize(runs: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Median, lowest and highest of each figure over the runs."""
    return {key: {"median": statistics.median(r[key] for r in runs), "min": min(r[key] for r in runs),
                  "max": max(r[key] for r in runs)} for key in runs[0]}


def run_models_bench(ns: argparse.Namespace) -> int:
    from specserve.bench.llamacpp import BATCH1_RUNS
    from specserve.bench.provenance import emit_report, provenance
    from specserve.args import number_list
    from specserve.args_checks import CPU_ACTIVATIONS
    from specserve.models.activations import choose_cpu_activations
    from specserve.models.loader import resolve_model_path

    models = [m.strip() for m in ns.models.split(",") if m.strip()]
    paths = {m: resolve_model_path(None if m == "default" else m) for m in models}
    if not ns.python_peer and not (ns.llama_bench or ns.llama_batched_bench):
        raise ConfigError("bench models --no-python-peer needs --llama-bench or --llama-batched-bench: a peer to "
                          "compare with")
    if ns.python_peer and importlib.util.find_spec("llama_cpp") is None:  # fail before minutes of ours
        raise ConfigError(f"bench models compares against llama.cpp and needs llama-cpp-python: {INSTALL}")
    if ns.llama_bench and not os.access(ns.llama_bench, os.X_OK):
        raise ConfigError(f"--llama-bench: {ns.llama_bench!r} is not an executable (scripts/llama_bench.sh builds one)")
    if ns.ik_llama_bench and not os.access(ns.ik_llama_bench, os.X_OK):
        raise ConfigError(f"--ik-llama-bench: {ns.ik_llama_bench!r} is not an executable "
                          "(../shared/tools/build-ik-llama-bench builds one)")
    modes = [a.strip() for a in ns.activations.split(",") if a.strip()]
    if not modes or any(a not in CPU_ACTIVATIONS for a in modes):
        raise ConfigError(f"--activations: a comma-separated list of {', '.join(CPU_ACTIVATIONS)}, got {ns.activations!r}")
    depths = number_list("--depths", ns.depths)
    batches = number_list("--batched", ns.batched)
    if ns.llama_batched_bench and not (batches and os.access(ns.llama_batched_bench, os.X_OK)):
        raise ConfigError(f"--llama-batched-bench: {ns.llama_batched_bench!r} must be an executable, run at --batched "
                          "sizes (scripts/llama_cpp_build.sh WORK llama-batched-bench builds one)")
    # auto as the engine resolves it (models/activations.py), each resolved choice once
    resolved = {m: list(dict.fromkeys(choose_cpu_activations(a, "cpu", "auto")[0] for a in modes)) for m in models}
    entries = {(m, a): m if a == "bf16" else f"{m}, int8 activations" for m in models for a in resolved[m]}
    raw: dict[str, list[dict[str, Any]]] = {name: [] for name in entries.values()}
    for run in range(ns.runs):
        for model in models:
            native = _native(ns.llama_bench, paths[model], ns.threads, ns.llama_bench_args) if ns.llama_bench else None
            ik = _native(ns.ik_llama_bench, paths[model], ns.threads, ns.ik_llama_bench_args) if ns.ik_llama_bench else None
            peer_extras = _depth_peers(ns, paths[model], depths)
            if ns.llama_batched_bench:
                peer_extras["native_batched"] = _batched_peer(ns.llama_batched_bench, paths[model], ns.threads, batches)
            for activations in resolved[model]:
                with tempfile.TemporaryDirectory() as folder:
                    result = _offline(model, activations, ns, folder)
                    if ns.spec_prompts > 0:
                        result["spec"] = _spec(model, activations, ns, folder)
                result |= {"activations": activations} | ({"native": native} if native else {})
                result |= ({"ik_llama.cpp": ik} if ik else {}) | peer_extras
                raw[entries[model, activations]].append(result)
                print(f"run {run + 1}/{ns.runs} {entries[model, activations]}: "
                      + json.dumps(_figures(result, ns.batch_size)), flush=True)
    report: dict[str, Any] = {"runs": ns.runs, "speculation": "default" if ns.speculation else "none", "new_tokens": ns.new_tokens, "batch_size": ns.batch_size, "window": ns.window,
                              "threads": ns.threads, "spec_prompts": ns.spec_prompts, "spec_repeats": ns.spec_repeats,
                              "llama_bench_args": ns.llama_bench_args, "depths": depths, "batched": batches,
                              "depth_new_tokens": DEPTH_NEW_TOKENS if depths else None,
                              "ik_llama_bench_args": ns.ik_llama_bench_args if ns.ik_llama_bench else None,
                              "batch1_generations": BATCH1_RUNS, **provenance(None)}
    first = next(iter(raw.values()))[0]
    report["llama_cpp_python"] = first["llama.cpp"].get("version", "?") if ns.python_peer else None
    report["models"] = {name: {"path": os.path.basename(paths[m]), "activations": a,
                               "summary": summarize([_figures(r, ns.batch_size) for r in raw[name]]), "runs": raw[name]}
                        for (m, a), name in entries.items()}
    emit_report(report, ns.out)
    return 0
