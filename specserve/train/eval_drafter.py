"""`specserve eval-drafter`: a drafter's acceptance where serving earns it, and where training scores it.

One run per prompt set: the engine serves the prompts with DSPARK (fixed policy, gamma drafts every
step, static verify, greedy), which gives the served accept length and each request's accepted
drafts per step. Then, on the same responses, `serving_walk` recomputes every anchor's block from
one prefill and reports the walk at serving's anchors (equal to the served steps in fp32) and the
mean over every anchor (what a random-anchor training estimate converges to).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Optional

from specserve.train import serving_walk

PROMPT_SETS = ("dev", "heldout", "mt-bench", "humaneval")


def add_eval_drafter_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", default=None, help="drafter directory (default: the shipped one)")
    p.add_argument("--prompts", default="dev", help="comma-separated: dev, heldout (the corpus's chat sets), "
                                                    "mt-bench, humaneval, or .jsonl files")
    p.add_argument("--num-prompts", type=int, default=0, help="first N of each set (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--data", default=None, help="corpus folder holding the dev and held-out sets")
    p.add_argument("--model-path", default=None)
    p.add_argument("--out", default=None, help="JSON results")
    p.add_argument("--record", action="store_true", help="add the served figures to the drafter's train_state.json "
                                                         "(its latest extension) and model card")


def load_prompt_set(name: str, data: Optional[str]) -> list[str]:
    from specserve.datasets import load_prompts
    from specserve.train.corpus_cli import DEFAULT_DATA_DIR
    from specserve.train.sources import evaluation_sets

    if name in ("dev", "heldout"):
        return evaluation_sets(data or DEFAULT_DATA_DIR)[name]
    return [q["prompt"] for q in load_prompts(name)]


@dataclass
class Served:
    """One prompt as the engine served it: prompt ids, response ids, accepted drafts per step."""

    prompt_ids: list[int]
    output_ids: list[int]
    steps: list[int]


def serve(engine, prompts: list[str], max_new_tokens: int) -> tuple[list[Served], float]:
    """Greedy responses from a DSPARK engine (fixed policy), with the served steps; and the wall time."""
    tok = engine.tokenizer
    inputs = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    started = time.perf_counter()
    results = engine.generate(input_ids=inputs, sampling_params={"temperature": 0, "max_new_tokens": max_new_tokens})
    return ([Served(ids, list(r["output_ids"]), list(r["meta_info"].get("spec_accepted_drafts_per_step", [])))
             for ids, r in zip(inputs, results)], time.perf_counter() - started)


def walk(engine, served: list[Served]) -> dict:
    """Every anchor's block on the served responses; the walk at serving's anchors against the served steps."""
    from specserve.train.corpus import capture
    from specserve.train.serving_walk import AcceptTally, dense_accepts

    drafter = engine.dspark_drafter()
    assert drafter is not None, "eval-drafter: the engine has no DSPARK drafter"
    tally, matched = AcceptTally(drafter.block_size), 0
    for s in served:
        seq = capture(engine.target_model, [(s.prompt_ids, s.output_ids)], list(drafter.config.target_layer_ids), 1)[0]
        accepts = dense_accepts(drafter, seq.hidden.to(drafter.dtype), seq.ids, len(s.prompt_ids))
        steps = serving_walk.serving_walk(accepts, len(s.prompt_ids), len(s.prompt_ids) + len(s.output_ids))
        tally.add(accepts, steps)
        matched += steps == s.steps
    report = tally.summary()
    n_steps = sum(len(s.steps) for s in served)
    report["served"] = {"accept_length": 1 + sum(sum(s.steps) for s in served) / max(n_steps, 1), "steps": n_steps,
                        "first_draft_accepted": sum(a > 0 for s in served for a in s.steps) / max(n_steps, 1),
                        "completion_tokens": sum(len(s.output_ids) for s in served)}
    report["requests"] = len(served)
    report["walk_equals_served"] = matched
    return report


def evaluate_drafter(engine, prompts: list[str], max_new_tokens: int) -> dict:
    """Serve `prompts` on a DSPARK engine (fixed policy), then walk the same responses."""
    served, seconds = serve(engine, prompts, max_new_tokens)
    report = walk(engine, served)
    report["served"]["wall_s"] = round(seconds, 2)
    return report


def run_eval_drafter(ns: argparse.Namespace) -> int:
    from specserve.engine import Engine

    engine = Engine(model_path=ns.model_path, dtype=ns.dtype, speculative_algorithm="DSPARK",
                    speculative_policy="fixed", speculative_draft_model_path=ns.drafter,
                    max_running_requests=ns.batch_size, random_seed=0)
    reports = {}
    try:
        for name in [n.strip() for n in ns.prompts.split(",") if n.strip()]:
            prompts = load_prompt_set(name, ns.data)
            if ns.num_prompts:
                prompts = prompts[:ns.num_prompts]
            reports[name] = evaluate_drafter(engine, prompts, ns.max_new_tokens)
            print(json.dumps({name: reports[name]}), flush=True)
    finally:
        engine.shutdown()
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"drafter": ns.drafter or "shipped", "dtype": ns.dtype, "max_new_tokens": ns.max_new_tokens,
                       "sets": reports}, f, indent=1)
    if ns.record:
        from specserve.assets import default_drafter_path
        from specserve.train.model_card import record_served

        record_served(ns.drafter or default_drafter_path(), reports,
                      {"max_new_tokens": ns.max_new_tokens, "dtype": ns.dtype})
    return 0

