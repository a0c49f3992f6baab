"""`specserve bench quality`: the bf16 kernels' quality gate against the fp32 reference, with bf16
and with int8 activations.

On the same GGUF weights: perplexity of real assistant answers (ShareGPT exchanges from the end
of the file, chat-templated, scored on the answer tokens only) in fp32 and in bf16, and the
greedy match rate of bf16 against fp32 on MT-Bench first turns (the share of outputs that are
identical, and the mean share of tokens before the first difference). Teacher-forced, on the same
answers: each variant's top-1 agreement with fp32 (the share of positions whose most likely next
token is fp32's). `--peer-llama-cpp` scores llama.cpp itself the same way (llama-cpp-python with
every position's logits, the same file and token ids) and takes its greedy answers to the same
prompts: the quality its users already accept, which `--cpu-activations auto`'s rule is set
against (models/activations.py).
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import torch

from specserve.args import ServerArgs
from specserve.datasets import mtbench_first_turns, sharegpt_exchanges
from specserve.kv.pool import KVPool, ReqToTokenPool
from specserve.models.forward_batch import ForwardBatch


def add_quality_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-texts", type=int, default=24, help="ShareGPT exchanges scored for perplexity")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per scored exchange (cut at the end)")
    p.add_argument("--num-prompts", type=int, default=32, help="MT-Bench first turns for the greedy match rate")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--reference", choices=("float32", "bf16"), default="float32",
                   help="what int8 activations are judged against: an fp32 run (the full gate) or, where fp32 "
                        "weights do not fit in memory (7B and up), bf16 activations on the same file")
    p.add_argument("--peer-llama-cpp", action="store_true",
                   help="score llama.cpp too (llama-cpp-python) on the same file and token ids: its perplexity, its "
                        "top-1 agreement with fp32 (every position's logits) and its greedy answers against fp32's")



def all_logits(model, ids: list[int]) -> torch.Tensor:
    """float32 logits of every position of one sequence, in one prefill over a private pool."""
    cfg, n = model.config, len(ids)
    kv = KVPool(n, cfg.num_layers, model.layers[0].self_attn.num_kv_heads, cfg.head_dim, model.dtype)
    table = ReqToTokenPool(1, n)
    table.write(0, 0, list(range(1, n + 1)))
    meta = model.ops.attention_metadata(table.table, [0], [n], [n], "cpu")
    fb = ForwardBatch(torch.tensor(ids), torch.arange(n), torch.arange(1, n + 1), meta, torch.arange(n))
    return model(fb, kv)


def scored_texts(tokenizer, count: int, max_tokens: int) -> list[tuple[list[int], int]]:
    """(token ids, index of the first answer token) per exchange: the question as a chat turn, or
    for a base model without a chat template (Gemma 3 270M) as plain text and a blank line."""
    from specserve.bench.offline import prompt_ids

    out = []
    plain = getattr(tokenizer, "chat_template", True) is None
    for human, answer in sharegpt_exchanges(count):
        prompt = prompt_ids(tokenizer, [human + "\n\n" if plain else human])[0]
        ids = (prompt + tokenizer.encode(answer, add_special_tokens=False))[:max_tokens]
        if len(ids) > len(prompt) + 8:
            out.append((ids, len(prompt)))
    return out


def teacher_forced(logits_of, texts: list[tuple[list[int], int]]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Perplexity of the answer tokens, and each answer position's top-1 token, the real text fed
    in at every position (so one model's miss does not move the other's context)."""
    nll, count, top1 = 0.0, 0, []
    for ids, start in texts:
        logits = logits_of(ids)[start - 1:-1].double()
        target = torch.tensor(ids[start:])
        nll -= torch.log_softmax(logits, dim=-1).gather(1, target.unsqueeze(1)).sum().item()
        count += len(target)
        top1.append(logits.argmax(dim=-1))
    return {"perplexity": math.exp(nll / count), "scored_tokens": count}, top1


def top1_agreement(reference: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    """The share of positions where both put the same token first."""
    same = sum(int((a == b).sum()) for a, b in zip(reference, other))
    return same / sum(len(a) for a in reference)


def top1_paired(reference: list[torch.Tensor], ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> dict[str, Any]:
    """Positions where only ours puts the reference's token first, and where only theirs does: the
    paired count that says whether a difference in agreement is more than noise (about the square
    root of their sum, as for a sign test)."""
    only_ours = sum(int(((o == r) & (t != r)).sum()) for r, o, t in zip(reference, ours, theirs))
    only_theirs = sum(int(((o != r) & (t == r)).sum()) for r, o, t in zip(reference, ours, theirs))
    return {"only_ours": only_ours, "only_theirs": only_theirs, "noise": math.sqrt(only_ours + only_theirs)}


def match_rate(reference: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    prefix = []
    for a, b in zip(reference, other):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(same / max(len(a), 1))
    each = [a == b for a, b in zip(reference, other)]
    return {"identical_outputs": sum(each) / len(each), "mean_matching_prefix": sum(prefix) / len(prefix),
            "identical_each": each}  # per prompt, for the int8 gate's paired test


def greedy_paired(report: dict[str, Any], theirs: str) -> dict[str, Any]:
    """Prompts whose greedy answer equals fp32's for int8 activations only, and for `theirs` only,
    with the paired noise (about the square root of their sum)."""
    ours_each = report["int8_activations"]["greedy_vs_fp32"]["identical_each"]
    theirs_each = report[theirs]["greedy_vs_fp32"]["identical_each"]
    only_ours = sum(o and not t for o, t in zip(ours_each, theirs_each))
    only_theirs = sum(t and not o for o, t in zip(ours_each, theirs_each))
    return {"only_ours": only_ours, "only_theirs": only_theirs, "noise": math.sqrt(only_ours + only_theirs)}


# The variants compared with float32 (the reference): bf16 activations, and int8 activations
# (--cpu-activations int8), both on the same packed weights.
VARIANTS = {"bfloat16": {"dtype": "bfloat16", "cpu_activations": "bf16"},
            "int8_activations": {"dtype": "bfloat16", "cpu_activations": "int8"}}


def _llama_cpp_arm(args: ServerArgs, texts: list[tuple[list[int], int]], prompts: list[list[int]], new_tokens: int,
                   stop_ids: tuple[int, ...]) -> tuple[dict[str, Any], list[torch.Tensor], list[list[int]]]:
    """llama.cpp on the same file and the same token ids, as its users run it (its CPU matmuls
    quantize activations to 8 bits): scored teacher-forced, and its greedy answers."""
    from specserve.bench.llamacpp import greedy_outputs, teacher_forced_logits
    from specserve.models.loader import resolve_model_path

    path, threads = resolve_model_path(args.model_path), torch.get_num_threads()
    logits_of = teacher_forced_logits(path, threads, n_ctx=max(len(ids) for ids, _ in texts))
    scored, top1 = teacher_forced(logits_of, texts)
    print(f"llama.cpp: perplexity {scored['perplexity']:.4f}", flush=True)
    return scored, top1, greedy_outputs(path, threads, prompts, new_tokens, stop_ids)


def until_stop(outputs: list[list[int]], stop_ids: tuple[int, ...]) -> list[list[int]]:
    """Each answer up to its first end-of-sequence token (left out), so an engine that returns the
    token and one that does not compare alike."""
    return [next((o[:i] for i, t in enumerate(o) if t in stop_ids), o) for o in outputs]


def run_quality_bench(ns: argparse.Namespace, args: ServerArgs) -> int:
    from specserve.bench.offline import prompt_ids
    from specserve.bench.provenance import provenance
    from specserve.engine import Engine
    from specserve.bench.int8_gate import int8_verdict, int8_verdict_vs_bf16

    report: dict[str, Any] = {**provenance(), "threads": torch.get_num_threads(), "num_prompts": ns.num_prompts,
                              "new_tokens": ns.new_tokens, "num_texts": ns.num_texts, "max_tokens": ns.max_tokens,
                              "model": args.model_path or "embedded default"}  # fmt: skip
    greedy = {"temperature": 0, "max_new_tokens": ns.new_tokens}
    outputs, top1 = {}, {}
    runs = VARIANTS if ns.reference == "bf16" else {"float32": {"dtype": "float32"}, **VARIANTS}
    for name, settings in runs.items():
        with Engine(**vars(args.replace(**settings, speculative_algorithm="NONE"))) as engine:
            texts = scored_texts(engine.tokenizer, ns.num_texts, ns.max_tokens)
            prompts = prompt_ids(engine.tokenizer, [q["prompt"] for q in mtbench_first_turns()[:ns.num_prompts]])
            report[name], top1[name] = teacher_forced(lambda ids: all_logits(engine.target_model, ids), texts)
            stop_ids = tuple(engine.tokenizer.eos_token_ids)
            answers = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=greedy)]
            outputs[name] = until_stop(answers, stop_ids)
        print(f"{name}: perplexity {report[name]['perplexity']:.4f}", flush=True)
    if ns.peer_llama_cpp:
        report["llama.cpp"], top1["llama.cpp"], answers = _llama_cpp_arm(args, texts, prompts, ns.new_tokens, stop_ids)
        outputs["llama.cpp"] = until_stop(answers, stop_ids)
    if "float32" in top1:
        for name in top1.keys() - {"float32"}:
            report[name]["top1_vs_fp32"] = top1_agreement(top1["float32"], top1[name])
            report[name]["over_fp32_perplexity"] = report[name]["perplexity"] / report["float32"]["perplexity"]
            if "llama.cpp" in top1 and name != "llama.cpp":
                report[name]["top1_vs_llama_cpp"] = top1_paired(top1["float32"], top1[name], top1["llama.cpp"])
    if ns.reference == "bf16":
        report["int8_activations"]["greedy_vs_bf16"] = match_rate(outputs["bfloat16"], outputs["int8_activations"])
        report["int8_gate"] = int8_verdict_vs_bf16(report)
    else:
        for name in outputs.keys() - {"float32"}:
            report[name]["greedy_vs_fp32"] = match_rate(outputs["float32"], outputs[name])
        if "llama.cpp" in outputs:  # the int8 gate's greedy count, llama.cpp in bf16's place
            report["int8_activations"]["greedy_vs_llama_cpp"] = greedy_paired(report, "llama.cpp")
        report["int8_activations"]["greedy_vs_bf16"] = match_rate(outputs["bfloat16"], outputs["int8_activations"])
        report["int8_gate"] = int8_verdict(report)
        report["int8_gate_vs_bf16"] = int8_verdict_vs_bf16(report)  # the cheap gate's verdict beside the full one
    print(json.dumps(report, indent=2))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0
