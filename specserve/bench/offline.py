"""`specserve bench offline`: decode speed of specserve vs Hugging Face transformers, side by side.

Both run greedy on the same GGUF, same dtype, same prompts, in one process run; the report gives
tokens/s and ratios. Batch 1 measures per-token latency, batch N measures throughput.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from typing import Any

import torch

from specserve.args import ServerArgs

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


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--skip-hf", action="store_true", help="measure specserve only")
    p.add_argument("--hf-batch", action="store_true", help="also run transformers at the batch size (slow)")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def _chat_ids(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]) for i in range(n)]


def bench_specserve(args: ServerArgs, ns: argparse.Namespace) -> dict[str, Any]:
    from specserve.engine import Engine

    engine = Engine(**vars(args))
    one = _chat_ids(engine.tokenizer, 1)
    batch = _chat_ids(engine.tokenizer, ns.batch_size)
    params = {"temperature": 0, "max_new_tokens": ns.new_tokens, "ignore_eos": True}
    engine.generate(input_ids=one[0], sampling_params={**params, "max_new_tokens": 8})  # warm-up
    engine.tree.reset()
    t = time.perf_counter()
    out = engine.generate(input_ids=one[0], sampling_params=params)
    b1 = out["meta_info"]["completion_tokens"] / (time.perf_counter() - t)
    engine.tree.reset()
    t = time.perf_counter()
    outs = engine.generate(input_ids=batch, sampling_params=params)
    bn = sum(o["meta_info"]["completion_tokens"] for o in outs) / (time.perf_counter() - t)
    engine.shutdown()
    return {"batch1_tok_s": b1, f"batch{ns.batch_size}_tok_s": bn}


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


def run_offline_bench(ns: argparse.Namespace, args: ServerArgs) -> int:
    from specserve.engine.builder import resolve_dtype
    from specserve.models.loader import resolve_model_path

    path = resolve_model_path(args.model_path)
    dtype = resolve_dtype(args.dtype)
    report: dict[str, Any] = {"model": path, "dtype": str(dtype), "new_tokens": ns.new_tokens,
                              "batch_size": ns.batch_size, "threads": torch.get_num_threads()}
    report["specserve"] = bench_specserve(args, ns)
    print("specserve:", json.dumps(report["specserve"]))
    if not ns.skip_hf:
        report["transformers"] = bench_transformers(dtype, ns, path)
        print("transformers:", json.dumps(report["transformers"]))
        ours, theirs = report["specserve"], report["transformers"]
        report["ratios"] = {k: ours[k] / theirs[k] for k in theirs if k in ours}
    bn = report["specserve"][f"batch{ns.batch_size}_tok_s"]
    report["specserve_batch_over_batch1"] = bn / report["specserve"]["batch1_tok_s"]
    print(json.dumps(report, indent=2))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0
