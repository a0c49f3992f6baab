"""`specserve soak`: the configuration that exercises every concurrency feature at once, for a time or token budget.

Defaults: TP 2, DSPARK (block 5), the overlap loop, `shortest-prefill-first`, chunked prefill 512,
the rank consensus checker on, and greedy prompts with long shared prefixes (MT-Bench first turns
behind a few long shared preambles) and a mix of small and large `max_new_tokens`. Fault delays
and the alias fault come from the SPECSERVE_FAULT_* variables (or the flags below, which set them
for every rank).

It prints tokens processed, rank divergences, hangs and throughput. A divergence ends the process
through the consensus checker (exit code 3, a `Found rank divergence` line); a stuck collective
ends it through the collective timeout (a `collective timeout at site` line, non-zero exit). A run
that completes therefore had zero of both, which the last line states.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from specserve.args import ServerArgs

PREAMBLES = [
    "You are a meticulous assistant for a city library. Patrons ask about books, opening hours, events, "
    "membership rules and research help. Answer clearly, cite the relevant library policy when it applies, "
    "and keep a friendly tone. Library policies: loans last three weeks; renewals are allowed twice; "
    "late fees are waived for children; study rooms are booked online up to a week ahead. ",
    "You are a senior software engineer reviewing questions from a junior colleague. Explain your reasoning "
    "step by step, point out pitfalls, and prefer small, testable changes. The team uses Python, writes "
    "tests first, keeps functions short and documents every public interface. Be concrete and brief. ",
    "You are a travel planner. The traveller likes trains, museums and local food, dislikes long flights, "
    "and has a moderate budget. Suggest itineraries with times, costs and alternatives, and mention "
    "seasonal considerations, local customs and safety tips where useful. ",
]


def add_soak_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-minutes", type=float, default=None, help="stop after this long")
    p.add_argument("--max-tokens", type=int, default=None, help="stop after processing this many tokens")
    p.add_argument("--wave", type=int, default=8, help="requests submitted together")
    p.add_argument("--small-new-tokens", type=int, default=8)
    p.add_argument("--large-new-tokens", type=int, default=96)
    p.add_argument("--copy-delay-ms", type=int, default=None, help="sets SPECSERVE_FAULT_COPY_DELAY_MS")
    p.add_argument("--forward-delay-ms", type=int, default=None, help="sets SPECSERVE_FAULT_FORWARD_DELAY_MS")
    p.add_argument("--no-consensus-checker", action="store_true", help="do not set the checker's variable")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the final summary as JSON")


SOAK_DEFAULTS = dict(tp_size=2, speculative_algorithm="DSPARK", schedule_policy="shortest-prefill-first",
                     chunked_prefill_size=512)


def soak_prompts(seed: int) -> list[str]:
    from specserve.datasets import mtbench_first_turns

    rng = random.Random(seed)
    questions = [q["prompt"] for q in mtbench_first_turns()]
    return [rng.choice(PREAMBLES) + "\n\nQuestion: " + q for q in questions]


def run_soak(ns: argparse.Namespace, args: ServerArgs) -> int:
    if ns.max_minutes is None and ns.max_tokens is None:
        raise ValueError("soak: give --max-minutes or --max-tokens")
    for flag, var in ((ns.copy_delay_ms, "SPECSERVE_FAULT_COPY_DELAY_MS"),
                      (ns.forward_delay_ms, "SPECSERVE_FAULT_FORWARD_DELAY_MS")):
        if flag is not None:
            os.environ[var] = str(flag)  # read by every rank's engine when it is built
    if not ns.no_consensus_checker:
        os.environ.setdefault("SPECSERVE_ENABLE_RANK_CONSENSUS_CHECKER", "1")
    from specserve.engine import Engine

    prompts = soak_prompts(ns.seed)
    rng = random.Random(ns.seed)
    started = time.monotonic()
    print(f"soak: starting {args.tp_size} rank(s), {args.speculative_algorithm}, "
          f"{'normal' if args.disable_overlap_schedule else 'overlap'} loop", flush=True)
    engine = Engine(**vars(args))
    ready = time.monotonic()
    processed = generated = requests = 0
    accept_steps = accept_tokens = 0
    try:
        while not _budget_spent(ns, ready, processed):
            wave = [rng.choice(prompts) for _ in range(ns.wave)]
            params = [{"temperature": 0, "max_new_tokens": rng.choice((ns.small_new_tokens, ns.large_new_tokens))}
                      for _ in wave]
            for out in engine.generate(wave, sampling_params=params):
                meta = out["meta_info"]
                processed += meta["prompt_tokens"] + meta["completion_tokens"]
                generated += meta["completion_tokens"]
                accept_steps += meta.get("spec_verify_ct", 0)
                accept_tokens += meta["completion_tokens"] if meta.get("spec_verify_ct") else 0
            requests += len(wave)
            elapsed = time.monotonic() - ready
            print(f"soak: {elapsed:7.1f} s, {requests} requests, {processed} tokens processed, {generated} generated "
                  f"({generated / elapsed:.1f} tok/s)", flush=True)
        summary = {"tokens_processed": processed, "tokens_generated": generated, "requests": requests,
                   "seconds": round(time.monotonic() - ready, 1), "startup_seconds": round(ready - started, 1),
                   "generated_tokens_per_s": round(generated / max(time.monotonic() - ready, 1e-9), 2),
                   "accept_length": round(accept_tokens / accept_steps, 3) if accept_steps else None,
                   "rank_divergences": 0, "hangs": 0}
        if engine.consensus is not None:
            summary["consensus_checker"] = engine.consensus.overhead
    finally:
        engine.shutdown()
    print(json.dumps(summary) if ns.json else
          "soak: done: " + ", ".join(f"{k} {v}" for k, v in summary.items()), flush=True)
    return 0


def _budget_spent(ns: argparse.Namespace, ready: float, processed: int) -> bool:
    if ns.max_minutes is not None and time.monotonic() - ready >= ns.max_minutes * 60:
        return True
    return ns.max_tokens is not None and processed >= ns.max_tokens

