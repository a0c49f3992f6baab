"""`specserve bench offline`: decode speed of specserve against its peers, side by side.

Peers (`--peer`, repeatable): Hugging Face transformers (`generate`, same dtype) and llama.cpp
through llama-cpp-python. All run greedy on the same GGUF and the same token ids in one process
run; the report gives tokens/s and ratios. Batch 1 measures per-token latency, batch N
throughput; against llama.cpp it also compares one forward step over 1 new token (decode) and
over a 6-row verify window after the same 256-token prefix, and prefill tokens/s.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from specserve.bench.profile_sps import median_call_s
from specserve.args import ServerArgs, number_list
from specserve.bench.llamacpp import BATCH1_RUNS
from specserve.engine.memory import weights_bytes

PROMPTS = [
    "Explain how a hash table works.",
    "Write a short story about a robot who learns to paint.",
    "What are the main causes of climate change?",
    "Describe the water cycle in simple terms.",
    "Give me three tips for learning a new language.",
    "How does a bicycle stay upright?",
    "Summarize the plot of Romeo and Juliet.",
    "What is the difference between a virus and a bacterium?",
]


BATCHED_PROMPT_TOKENS, BATCHED_NEW_TOKENS = 128, 32  # the batched decode's shape: llama-batched-bench's -npp, -ntg


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--peer", action="append", choices=["transformers", "llama.cpp"], default=None,
                   help="peers to measure (repeatable; default: transformers)")
    p.add_argument("--skip-hf", action="store_true", help="measure no peer (same as giving no --peer and skipping transformers)")
    p.add_argument("--prefix-len", type=int, default=256, help="context before the timed decode and verify steps")
    p.add_argument("--window", type=int, default=6, help="rows of the timed verify step")
    p.add_argument("--prefill-len", type=int, default=512, help="tokens of the timed prefill")
    p.add_argument("--repeats", type=int, default=10, help="timed passes per step shape (median kept)")
    p.add_argument("--hf-batch", action="store_true", help="also run transformers at the batch size (slow)")
    p.add_argument("--depths", default="",
                   help="context depths (tokens) at which batch-1 decode is also timed, e.g. 4096,8192 "
                        "(like llama-bench -d)")
    p.add_argument("--batched", default="",
                   help="batch sizes at which aggregate decode is also timed, e.g. 1,4,16: that many distinct "
                        f"{BATCHED_PROMPT_TOKENS}-token prompts decoding {BATCHED_NEW_TOKENS} tokens together "
                        f"(like llama-batched-bench -npp {BATCHED_PROMPT_TOKENS} -ntg {BATCHED_NEW_TOKENS})")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def _chat_ids(tokenizer, n: int) -> list[list[int]]:
    return prompt_ids(tokenizer, [PROMPTS[i % len(PROMPTS)] for i in range(n)])


def prompt_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text as a user's chat turn (request_ids)."""
    return [request_ids(tokenizer, [{"role": "user", "content": t}]) for t in texts]


def request_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """A chat request's prompt ids; for a base model without a chat template (Gemma 3 270M), its
    turns' text."""
    if getattr(tokenizer, "chat_template", True) is None:
        return tokenizer.encode("\n\n".join(m["content"] for m in messages))
    return tokenizer.apply_chat_template(messages)


def _long_ids(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(" ".join(PROMPTS))
    return ids[:n]


def _median_pass_s(engine, ids: list[int], prefix_len: int, repeats: int, last_logit_only: bool) -> float:
    """Median seconds of one target forward over `ids` as new rows after `prefix_len` cached ones."""
    with engine.forward_rows(len(ids), prefix_len, input_ids=ids, last_logit_only=last_logit_only) as forward:
        return median_call_s(forward, repeats)


def distinct_experts(engine, ids: list[int], prefix_len: int) -> float:
    """A mixture's distinct experts per layer (mean over layers) that one forward over `ids` (new rows
    after `prefix_len` cached ones) routes its rows to: the layers op by op, each mixture's input
    routed again (the native layers route the same inputs alike: they give the per-op bits)."""
    from specserve.models.moe import SparseMoeBlock, route

    model = engine.target_model
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    counts: list[int] = []

    def count(block: SparseMoeBlock, args: tuple) -> None:
        _, experts = route(block.router_logits(args[0]), block.top_k, block.normalize, block.softmax_after_topk)
        counts.append(int(torch.unique(experts).numel()))

    native, model.native = model.native, None
    hooks = [b.register_forward_pre_hook(count) for b in blocks]
    try:
        with engine.forward_rows(len(ids), prefix_len, input_ids=ids) as forward:
            forward()
    finally:
        model.native = native
        for h in hooks:
            h.remove()
    return statistics.mean(counts)


def step_shapes(engine, ns: argparse.Namespace) -> dict[str, float]:
    """Decode (1 row) vs verify (`--window` rows) step time, and prefill tokens/s, of the target."""
    window = _long_ids(engine.tokenizer, ns.window)
    decode = _median_pass_s(engine, window[:1], ns.prefix_len, ns.repeats, last_logit_only=False)
    verify = _median_pass_s(engine, window, ns.prefix_len, ns.repeats, last_logit_only=False)
    prefill = _median_pass_s(engine, _long_ids(engine.tokenizer, ns.prefill_len), 0, max(2, ns.repeats // 3), True)
    result = {"decode_1_row_ms": 1e3 * decode, f"verify_{ns.window}_rows_ms": 1e3 * verify,
              "verify_over_decode": verify / decode, "prefill_tok_s": ns.prefill_len / prefill, "window": ns.window,
              "prefill_len": ns.prefill_len}
    model = engine.target_model
    if model.config.is_moe:  # more rows touch more experts: what a verify window reads
        result["decode_experts_per_layer"] = distinct_experts(engine, window[:1], ns.prefix_len)
        result["verify_experts_per_layer"] = distinct_experts(engine, window, ns.prefix_len)
    if model.ops.name == "cpu-kernels":  # where the step goes, kernel by kernel: the layers op by op
        from specserve.bench.step_profile import profile_step

        native, model.native = model.native, None
        try:
            for name, ids in (("decode", window[:1]), ("verify", window)):
                with engine.forward_rows(len(ids), ns.prefix_len, input_ids=ids) as forward:
                    result[f"{name}_profile_ms"] = profile_step(forward, ns.repeats)
        finally:
            model.native = native
    return result


def bench_specserve(args: ServerArgs, ns: argparse.Namespace) -> dict[str, Any]:
    from specserve.bench.arithmetic import head_macs, machine_arithmetic, row_macs
    from specserve.engine import Engine
    from specserve.kernels.dispatch import path_name

    start = time.perf_counter()
    engine = Engine(**vars(args))
    load_s = time.perf_counter() - start
    one = _chat_ids(engine.tokenizer, 1)
    batch = _chat_ids(engine.tokenizer, ns.batch_size)
    params = {"temperature": 0, "max_new_tokens": ns.new_tokens, "ignore_eos": True}
    engine.generate(input_ids=one[0], sampling_params={**params, "max_new_tokens": 8})  # warm-up
    memory = memory_mib(engine)  # loaded and warm, before the peers load anything
    b1_runs = []
    for _ in range(BATCH1_RUNS):  # the prompt's prefix is dropped from the cache before each
        engine.reset_prefix_cache()
        t = time.perf_counter()
        out = engine.generate(input_ids=one[0], sampling_params=params)
        b1_runs.append(out["meta_info"]["completion_tokens"] / (time.perf_counter() - t))
    b1 = statistics.median(b1_runs)
    decode = decode_rate(engine, one[0], params)
    engine.reset_prefix_cache()
    t = time.perf_counter()
    outs = engine.generate(input_ids=batch, sampling_params=params)
    bn = sum(o["meta_info"]["completion_tokens"] for o in outs) / (time.perf_counter() - t)
    engine.reset_prefix_cache()
    shapes = step_shapes(engine, ns)
    depths = {str(d): decode_at_depth(engine, d, params) for d in number_list("--depths", ns.depths)}
    batched = {str(b): batched_decode(engine, b, params) for b in number_list("--batched", ns.batched)}
    kernel_path, model = path_name() if engine.args.device == "cpu" else "none", engine.target_model
    arithmetic = {"linear_macs_per_row": row_macs(model), "head_macs": head_macs(model),
                  **machine_arithmetic()} if kernel_path != "none" else {}
    layers = "native" if getattr(model, "native", None) is not None else "op by op"
    engine.shutdown()
    return {"batch1_tok_s": b1, "batch1_tok_s_runs": b1_runs, **decode, f"batch{ns.batch_size}_tok_s": bn, **shapes,
            "cpu_kernel_path": kernel_path, "decoder_layers": layers, "load_s": load_s, **memory, **arithmetic,
            **({"decode_at_depth_tok_s": depths} if depths else {}),
            **({"batched_decode_tok_s": batched} if batched else {})}


def decode_rate(engine, prompt: list[int], params: dict[str, Any]) -> dict[str, Any]:
    """Batch-1 decode tokens/s without the prompt's prefill, like `llama-bench`'s tg: (N - 1) tokens
    over the time a whole N-token request takes beyond a 1-token one (the prefill and the first
    token), each the median of BATCH1_RUNS requests with the prompt dropped from the cache first;
    with the weights each step streams and the machine's read bandwidth (bench/bandwidth.py), the
    share of it the decode uses."""
    from specserve.bench.arithmetic import step_weight_bytes
    from specserve.bench.bandwidth import read_bandwidth_gbs, share_of_bandwidth

    rate = _decode_rate_beyond_first(engine, prompt, params, from_cold=True)
    streamed = step_weight_bytes(engine.target_model)
    bandwidth = read_bandwidth_gbs()
    return {"decode_tok_s": rate, "weights_streamed_mib": streamed / 2**20, "read_bandwidth_gbs": bandwidth,
            "decode_bandwidth_share": share_of_bandwidth(streamed, rate, bandwidth)}


def decode_at_depth(engine, depth: int, params: dict[str, Any]) -> float:
    """Batch-1 decode tokens/s after `depth` tokens of context, like `llama-bench -d`: the context
    prefilled once and kept in the prefix cache, then (N - 1) tokens over the time an N-token
    request takes beyond a 1-token one (each the median of BATCH1_RUNS), both starting from the
    cached context."""
    prompt = _long_ids(engine.tokenizer, depth)
    engine.reset_prefix_cache()
    engine.generate(input_ids=prompt, sampling_params={**params, "max_new_tokens": 1})  # the context, cached

    rate = _decode_rate_beyond_first(engine, prompt, params, from_cold=False)
    engine.reset_prefix_cache()
    return rate


def batched_decode(engine, batch: int, params: dict[str, Any]) -> float:
    """Aggregate decode tokens/s of `batch` distinct prompts decoding together, like
    llama-batched-bench's S_TG: batch * (N - 1) tokens over the N-token requests' time beyond
    1-token ones (medians of BATCH1_RUNS), the prompts cached first so that no prefill is timed."""
    prompts = [_long_ids(engine.tokenizer, BATCHED_PROMPT_TOKENS + i)[i:] for i in range(batch)]  # no shared prefix
    engine.reset_prefix_cache()
    engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": 1})  # the prompts, cached
    rate = _decode_rate_beyond_first(engine, prompts, {**params, "max_new_tokens": BATCHED_NEW_TOKENS}, from_cold=False)
    engine.reset_prefix_cache()
    return rate


def _decode_rate_beyond_first(engine, prompt: list, params: dict[str, Any], from_cold: bool) -> float:
    """(N - 1) tokens per row over an N-token request's time beyond a 1-token one (medians of
    BATCH1_RUNS); the prompt (ids, or a batch of them) dropped from the cache first or kept."""

    def seconds(new_tokens: int) -> float:
        runs = []
        for _ in range(BATCH1_RUNS):
            if from_cold:
                engine.reset_prefix_cache()
            t = time.perf_counter()
            engine.generate(input_ids=prompt, sampling_params={**params, "max_new_tokens": new_tokens})
            runs.append(time.perf_counter() - t)
        return statistics.median(runs)

    n, rows = params["max_new_tokens"], len(prompt) if prompt and isinstance(prompt[0], list) else 1
    return rows * (n - 1) / (seconds(n) - seconds(1))


def memory_mib(engine) -> dict[str, float]:
    """This process's resident memory, the model file's size, the drafter's file's (where one is
    loaded) and the KV pools' (the target's and the drafter's), in MiB, and what a process that has
    only imported torch holds (the part any PyTorch engine pays)."""
    from specserve.bench.load import _rss
    from specserve.models.loader import resolve_model_path

    kv = engine.kv_pool_bytes()
    return {"rss_mib": _rss(os.getpid()) / 2**20, "file_mib": weights_bytes(resolve_model_path(engine.args.model_path)) / 2**20,
            "drafter_file_mib": _drafter_bytes(engine) / 2**20, "kv_mib": kv / 2**20, "torch_runtime_mib": torch_runtime_mib()}


def _drafter_bytes(engine) -> int:
    """The loaded DSpark drafter's weights file size (0 without one)."""
    if engine.dspark_drafter() is None:
        return 0
    return weights_bytes(engine.args.speculative_draft_model_path)


# Run in a fresh interpreter: nothing but torch imported before reading its resident memory.
_TORCH_ONLY_RSS = """
import torch
with open("/proc/self/status") as f:
    print(next(line.split()[1] for line in f if line.startswith("VmRSS:")))
"""


def torch_runtime_mib() -> float:
    """Resident memory of a fresh Python process after `import torch` (and nothing else), in MiB."""
    proc = subprocess.run([sys.executable, "-c", _TORCH_ONLY_RSS], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"measuring torch's resident memory failed:\n{proc.stderr[-2000:]}")
    return int(proc.stdout.split()[-1]) / 1024


def bench_llama_cpp_peer(args: ServerArgs, ns: argparse.Namespace, path: str) -> dict[str, Any]:
    from specserve.bench.llamacpp import bench_llama_cpp
    from specserve.tokenizer.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    long = _long_ids(tok, max(ns.prefix_len + ns.window, ns.prefill_len))
    return bench_llama_cpp(path, torch.get_num_threads(), _chat_ids(tok, 1)[0], ns.new_tokens, long[:ns.prefix_len],
                           _long_ids(tok, ns.window), long[:ns.prefill_len], ns.repeats)


def bench_transformers(dtype: torch.dtype, ns: argparse.Namespace, model_path: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = os.path.dirname(model_path), os.path.basename(model_path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=dtype).eval()
    kwargs = dict(do_sample=False, max_new_tokens=ns.new_tokens, min_new_tokens=ns.new_tokens, pad_token_id=tok.eos_token_id)
    ids = torch.tensor([_chat_ids(_SpecTok(tok), 1)[0]])
    with torch.inference_mode():
        model.generate(ids, **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})
        t = time.perf_counter()
        out = model.generate(ids, **kwargs)
        b1 = (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t)
    result = {"batch1_tok_s": b1}
    if ns.hf_batch:
        tok.padding_side = "left"
        texts = [tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], tokenize=False,
                                         add_generation_prompt=True) for i in range(ns.batch_size)]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            t = time.perf_counter()
            out = model.generate(**enc, **kwargs)
            result[f"batch{ns.batch_size}_tok_s"] = ns.batch_size * (out.shape[1] - enc.input_ids.shape[1]) / (time.perf_counter() - t)
    del model
    gc.collect()
    return result


class _SpecTok:
    """Adapter so the HF tokenizer renders the same chat ids as specserve's."""

    def __init__(self, tok):
        self.tok = tok

    def apply_chat_template(self, messages):
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def cpu_description() -> dict[str, Any]:
    """The CPU a figure comes from: model name and whether it has AMX / AVX512-BF16."""
    from specserve.kernels.dispatch import cpu_flags, cpu_model

    flags, name = cpu_flags(), cpu_model()
    return {"model": name, "amx": "amx_tile" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "threads": torch.get_num_threads()}


def speculation_label(args: ServerArgs) -> str:
    """What the engine speculates with, as a table says it: 'none', or the policy and its drafters."""
    if not args.speculating:
        return "none"
    drafters = args.policy_drafters() if args.speculative_policy == "adaptive" else (args.speculative_algorithm,)
    return f"{args.speculative_policy} over {', '.join(str(d) for d in drafters)}"


def run_offline_bench(ns: argparse.Namespace, args: ServerArgs) -> int:
    from specserve.engine.builder import resolve_dtype
    from specserve.models.loader import resolve_model_path

    path = resolve_model_path(args.model_path)
    dtype = resolve_dtype(args.dtype)
    report: dict[str, Any] = {"model": path, "dtype": str(dtype), "new_tokens": ns.new_tokens,
                              "batch_size": ns.batch_size, "threads": torch.get_num_threads()}
    report["cpu"] = cpu_description()
    from specserve.bench.provenance import provenance

    report.update(provenance(args.speculative_draft_model_path if args.speculating else None))
    report["speculation"] = speculation_label(args)
    report["specserve"] = bench_specserve(args, ns)
    print("specserve:", json.dumps(report["specserve"]))
    peers = [] if ns.skip_hf and not ns.peer else (ns.peer or ["transformers"])
    for peer in peers:
        result = bench_transformers(dtype, ns, path) if peer == "transformers" else bench_llama_cpp_peer(args, ns, path)
        report[peer] = result
        print(f"{peer}:", json.dumps(result))
        ours = report["specserve"]
        report[f"ratios_vs_{peer}"] = {k: ours[k] / v for k, v in result.items()
                                       if k in ours and isinstance(v, (int, float)) and v}
    bn = report["specserve"][f"batch{ns.batch_size}_tok_s"]
    report["specserve_batch_over_batch1"] = bn / report["specserve"]["batch1_tok_s"]
    print(json.dumps(report, indent=2))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0
