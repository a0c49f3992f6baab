"""`specserve bench spec`: speculative decoding on MT-Bench first turns, side by side in one run.

For each algorithm (none, NGRAM, DSPARK) and batch size it generates greedily for the 80 MT-Bench
first turns (prompts submitted in groups of the batch size) and reports accept length, decode
tokens/s and the ratio to non-speculative decoding. Peers: Hugging Face transformers greedy and
its prompt-lookup decoding (the model-free speculative baseline) at batch 1 on the first
`--hf-prompts` prompts. It also times the six `read_accept` clones against the whole verify step.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from typing import Any, Optional

import torch

from specserve.args import ServerArgs
from specserve.datasets import mtbench_first_turns

def add_spec_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--algorithms", default="NONE,NGRAM,DSPARK", help="comma-separated, NONE is the baseline")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--hf-prompts", type=int, default=8, help="prompts for the transformers peers (0: skip)")
    p.add_argument("--out", default=None, help="write the results as JSON here")


class VerifyTimer:
    """Times whole verify steps and the read_accept clones inside them (wall clock, this process)."""

    def __init__(self, runner):
        self.verify_s, self.clone_s, self.steps = 0.0, 0.0, 0
        verify, read = runner._verify, runner.read_accept

        def timed_verify(spec):
            start = time.perf_counter()
            out = verify(spec)
            self.verify_s += time.perf_counter() - start
            self.steps += 1
            return out

        def timed_read(bs):
            start = time.perf_counter()
            out = read(bs)
            self.clone_s += time.perf_counter() - start
            return out

        runner._verify, runner.read_accept = timed_verify, timed_read


def run_specserve(args: ServerArgs, algorithm: str, prompts: list[list[int]], bs: int, new_tokens: int) -> dict[str, Any]:
    from specserve.engine import Engine

    spec = {} if algorithm == "NONE" else {"speculative_algorithm": algorithm}
    if algorithm != "DSPARK":
        args = args.replace(speculative_draft_model_path=None)
    engine = Engine(**{**vars(args), "speculative_algorithm": "NONE", **spec})
    timer = VerifyTimer(engine.runner) if algorithm != "NONE" else None
    params = {"temperature": 0, "max_new_tokens": new_tokens}
    engine.generate(input_ids=prompts[0], sampling_params={**params, "max_new_tokens": 8})  # warm-up
    engine.tree.reset()
    if timer:
        timer.verify_s = timer.clone_s = timer.steps = 0
    outs, start = [], time.perf_counter()
    for i in range(0, len(prompts), bs):
        outs += engine.generate(input_ids=prompts[i:i + bs], sampling_params=params)
        engine.tree.reset()  # no cross-group prefix reuse: every group prefills its prompts
    wall = time.perf_counter() - start
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    verify_ct = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    result = {"algorithm": algorithm, "batch_size": bs, "completion_tokens": tokens, "wall_s": round(wall, 2),
              "tokens_per_s": round(tokens / wall, 2), "outputs": [o["output_ids"] for o in outs]}
    if verify_ct:
        decode_tokens = tokens - len(outs)  # the first token of each request comes from prefill
        result["accept_length"] = round(decode_tokens / verify_ct, 3)
        result["verify_steps"] = verify_ct
        result["read_accept_share_of_verify"] = timer.clone_s / timer.verify_s if timer.verify_s else None
        result["verify_step_ms"] = round(1000 * timer.verify_s / max(timer.steps, 1), 2)
    engine.shutdown()
    del engine
    gc.collect()
    return result


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
    return {"algorithm": "hf-prompt-lookup" if prompt_lookup else "hf-greedy", "batch_size": 1,
            "completion_tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 2)}


def run_spec_bench(ns: argparse.Namespace, args: ServerArgs) -> int:
    from specserve.tokenizer.tokenizer import load_tokenizer
    from specserve.models.loader import resolve_model_path

    algorithms = [a.strip().upper() for a in ns.algorithms.split(",") if a.strip()]
    if "DSPARK" in algorithms and not args.speculative_draft_model_path:
        raise ValueError("speculative_draft_model_path: DSPARK needs a drafter (`specserve init-drafter --out DIR`)")
    sizes = [int(b) for b in ns.batch_sizes.split(",")]
    questions = mtbench_first_turns()[:ns.num_prompts]
    tokenizer = load_tokenizer(resolve_model_path(args.model_path))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q["prompt"]}]) for q in questions]
    results = []
    for bs in sizes:
        for algorithm in algorithms:
            r = run_specserve(args, algorithm, prompts, bs, ns.new_tokens)
            results.append(r)
            print(_line(r), flush=True)
    gamma = args.speculative_dspark_block_size
    if ns.hf_prompts > 0:
        for lookup in (None, gamma or 5):
            r = run_hf(prompts[:ns.hf_prompts], ns.new_tokens, lookup)
            results.append(r)
            print(_line(r), flush=True)
    report = summarize(results)
    print(json.dumps(report["ratios"], indent=2))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"results": [{k: v for k, v in r.items() if k != "outputs"} for r in results],
                       **report}, f, indent=2)
    return 0


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Speedups over NONE at the same batch size, and whether greedy outputs matched it."""
    base = {r["batch_size"]: r for r in results if r["algorithm"] == "NONE"}
    ratios = {}
    for r in results:
        b = base.get(r["batch_size"])
        if b is None or r is b or "outputs" not in r:
            continue
        key = f"{r['algorithm']}@bs{r['batch_size']}"
        ratios[key] = {"speedup": round(r["tokens_per_s"] / b["tokens_per_s"], 3),
                       "accept_length": r.get("accept_length"),
                       "identical_outputs": r["outputs"] == b["outputs"]}
    return {"ratios": ratios}


def _line(r: dict[str, Any]) -> str:
    extra = ""
    if "accept_length" in r:
        extra = (f"  accept {r['accept_length']:.2f}  verify {r['verify_step_ms']:.1f} ms"
                 f"  read_accept {100 * (r['read_accept_share_of_verify'] or 0):.3f}% of verify")
    return (f"{r['algorithm']:>16} bs{r['batch_size']:<3} {r['completion_tokens']:6d} tok {r['wall_s']:8.1f} s "
            f"{r['tokens_per_s']:8.1f} tok/s{extra}")
