"""`specserve soak`: the configuration that exercises every concurrency feature at once, for a time or token budget.

Defaults: TP 2, DSPARK (block 5), the overlap loop, `shortest-prefill-first`, chunked prefill 512,
the rank consensus checker on, and greedy prompts with long shared prefixes (MT-Bench first turns
behind a few long shared preambles) and a mix of small and large `max_new_tokens`. Fault delays
and the alias fault come from the SPECSERVE_FAULT_* variables (or the flags below, which set them
for every rank).

It prints tokens processed, rank divergences, hangs and throughput. A divergence ends the process
through the consensus checker (exit code 3, a `Found rank divergence` line); a stuck collective
ends it through the collective timeout (a `collective timeout at site` line, non-zero exit); a dead
checker thread fails the engine's next step. The figures of a run that completes are measured on
every rank at shutdown (Engine.rank_figures): divergences found, collective timeouts (hangs), the
checker's rounds and events recorded and checked, and whether its thread was alive. The soak
fails (exit 1, `soak: FAILED`) unless every rank's checker was alive, ran rounds, and checked every
event it recorded. Figures that were not measured (one rank, or no checker) are null, never 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any, Optional

from specserve.errors import ConfigError
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
    p.add_argument("--copy-lag-ms", type=int, default=None,
                   help="sets SPECSERVE_FAULT_COPY_LAG_MS: each step's host copy waits for the next step")
    p.add_argument("--copy-lag-ranks", default=None,
                   help="sets SPECSERVE_FAULT_COPY_LAG_RANKS: the ranks that lag, e.g. 1 (default: all)")
    p.add_argument("--no-consensus-checker", action="store_true",
                   help="leave the checker to SPECSERVE_ENABLE_RANK_CONSENSUS_CHECKER (off: divergences null)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the final summary as JSON")
    p.add_argument("--out", default=None, help="write the summary, the flags and the provenance to this JSON file")


# The fixed policy: every step drafts, so every step runs the verify and accept path the stale-accept race lives
# in (the adaptive policy chooses NONE at most of the soak's batch sizes on a CPU and would exercise none).
SOAK_DEFAULTS = dict(tp_size=2, speculative_algorithm="DSPARK", speculative_policy="fixed",
                     schedule_policy="shortest-prefill-first", chunked_prefill_size=512)


def soak_prompts(seed: int) -> list[str]:
    from specserve.datasets import mtbench_first_turns

    rng = random.Random(seed)
    questions = [q["prompt"] for q in mtbench_first_turns()]
    return [rng.choice(PREAMBLES) + "\n\nQuestion: " + q for q in questions]


def run_soak(ns: argparse.Namespace, args: ServerArgs) -> int:
    if ns.max_minutes is None and ns.max_tokens is None:
        raise ConfigError("soak: give --max-minutes or --max-tokens")
    for flag, var in ((ns.copy_delay_ms, "SPECSERVE_FAULT_COPY_DELAY_MS"),
                      (ns.forward_delay_ms, "SPECSERVE_FAULT_FORWARD_DELAY_MS"),
                      (ns.copy_lag_ms, "SPECSERVE_FAULT_COPY_LAG_MS"),
                      (ns.copy_lag_ranks, "SPECSERVE_FAULT_COPY_LAG_RANKS")):
        if flag is not None:
            os.environ[var] = str(flag)  # read by every rank's engine when it is built
    if not ns.no_consensus_checker:  # on, whatever the environment says: the figures depend on it
        os.environ["SPECSERVE_ENABLE_RANK_CONSENSUS_CHECKER"] = "1"
    from specserve.engine import Engine

    prompts = soak_prompts(ns.seed)
    rng = random.Random(ns.seed)
    started = time.monotonic()
    print(f"soak: starting {args.tp_size} rank(s), {args.speculative_algorithm}, "
          f"{'normal' if args.disable_overlap_schedule else 'overlap'} loop", flush=True)
    engine = Engine(**vars(args))
    ready = time.monotonic()
    processed = generated = requests = 0
    verify_steps = accepted_drafts = 0
    try:
        while not _budget_spent(ns, ready, processed):
            wave = [rng.choice(prompts) for _ in range(ns.wave)]
            params = [{"temperature": 0, "max_new_tokens": rng.choice((ns.small_new_tokens, ns.large_new_tokens))}
                      for _ in wave]
            for out in engine.generate(wave, sampling_params=params):
                meta = out["meta_info"]
                processed += meta["prompt_tokens"] + meta["completion_tokens"]
                generated += meta["completion_tokens"]
                verify_steps += meta.get("spec_verify_ct", 0)  # steps with drafts only, as the README defines
                accepted_drafts += meta.get("spec_num_correct_drafts", 0)
            requests += len(wave)
            elapsed = time.monotonic() - ready
            print(f"soak: {elapsed:7.1f} s, {requests} requests, {processed} tokens processed, {generated} generated "
                  f"({generated / elapsed:.1f} tok/s)", flush=True)
        finished = time.monotonic()
    finally:
        engine.shutdown()  # the ranks' figures are gathered in the shutdown step
    summary = {"tokens_processed": processed, "tokens_generated": generated, "requests": requests,
               "seconds": round(finished - ready, 1), "startup_seconds": round(ready - started, 1),
               "generated_tokens_per_s": round(generated / max(finished - ready, 1e-9), 2),
               "accept_length": round(1 + accepted_drafts / verify_steps, 3) if verify_steps else None,
               "verify_steps": verify_steps, "accepted_drafts": accepted_drafts}
    checker_on = args.tp_size > 1 and (not ns.no_consensus_checker or engine.scheduler.consensus is not None)
    figures, problems = measured_figures(engine.rank_figures, checker_on)
    problems += speculation_problems(args, verify_steps)
    summary.update(figures)
    print(json.dumps(summary) if ns.json else
          "soak: done: " + ", ".join(f"{k} {v}" for k, v in summary.items()), flush=True)
    if ns.out:
        write_result(ns, args, summary, problems)
    if problems:
        print("soak: FAILED: " + "; ".join(problems), flush=True)
        return 1
    return 0


def write_result(ns: argparse.Namespace, args: ServerArgs, summary: dict[str, Any], problems: list[str]) -> None:
    from specserve.bench.provenance import provenance

    faults = {k: getattr(ns, k) for k in ("copy_delay_ms", "forward_delay_ms", "copy_lag_ms", "copy_lag_ranks")}
    config = {k: getattr(args, k) for k in ("tp_size", "speculative_algorithm", "speculative_policy", "dtype",
                                            "enable_hierarchical_cache", "max_total_tokens", "disable_overlap_schedule")}
    record = {**provenance(args.speculative_draft_model_path if args.speculating else None),
              "budget": {"max_minutes": ns.max_minutes, "max_tokens": ns.max_tokens}, "faults": faults,
              "config": config, "consensus_checker": not ns.no_consensus_checker, "summary": summary,
              "problems": problems}
    with open(ns.out, "w") as f:
        json.dump(record, f, indent=1)


def measured_figures(ranks: Optional[list[dict]], checker_on: bool) -> tuple[dict[str, Any], list[str]]:
    """The summary's divergence and hang figures from every rank's shutdown figures, and what
    makes them untrustworthy (any problem fails the soak)."""
    if ranks is None:
        return ({"rank_divergences": None, "hangs": None},
                ["no figures from the ranks: the shutdown step failed (see the log above)"])
    problems = []
    hangs = sum(r["collective_timeouts"] for r in ranks)
    if hangs:
        problems.append(f"{hangs} collective timeout(s)")
    if not checker_on:  # not measured: null, not 0
        return {"rank_divergences": None, "hangs": hangs if len(ranks) > 1 else None}, problems
    checkers = {r["rank"]: r["consensus"] for r in ranks}
    for rank, c in checkers.items():
        if c is None:
            problems.append(f"rank {rank} ran without the consensus checker")
        elif not c["alive"]:
            problems.append(f"the consensus checker of rank {rank} was not alive at the end ({c['error']})")
        elif c["checks"] == 0 or c["events_recorded"] == 0 or c["events_checked"] != c["events_recorded"]:
            problems.append(f"the consensus checker of rank {rank} checked {c['events_checked']} of "
                            f"{c['events_recorded']} events in {c['checks']} rounds")
    present = [c for c in checkers.values() if c is not None]
    divergences = sum(c["divergences"] for c in present)
    if divergences:
        problems.append(f"{divergences} rank divergence(s)")
    rank0 = checkers.get(0) or {}
    return {"rank_divergences": divergences, "hangs": hangs, "consensus_checks": rank0.get("checks"),
            "events_recorded": rank0.get("events_recorded"), "events_checked": rank0.get("events_checked"),
            "checker_alive": bool(present) and len(present) == len(checkers) and all(c["alive"] for c in present),
            "consensus_per_rank": ranks}, problems


def speculation_problems(args: ServerArgs, verify_steps: int) -> list[str]:
    """A soak that was to draft every step but ran no verify step tested nothing of the accept path."""
    if args.speculating and args.speculative_policy == "fixed" and verify_steps == 0:
        return [f"{args.speculative_algorithm} with the fixed policy ran no verify step: the soak exercised "
                "nothing of speculation"]
    return []


def _budget_spent(ns: argparse.Namespace, ready: float, processed: int) -> bool:
    if ns.max_minutes is not None and time.monotonic() - ready >= ns.max_minutes * 60:
        return True
    return ns.max_tokens is not None and processed >= ns.max_tokens

