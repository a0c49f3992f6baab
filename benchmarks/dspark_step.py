"""`python -m benchmarks dspark-step`: where a DSPARK verify step's time goes, against a plain decode step.

Two engines on the same prompts, greedy, at each batch size: NONE (plain decode steps) and DSPARK
with the policy turned off (every step drafts gamma tokens, verified whole). Each part of a DSPARK
step is timed by wrapping its entry point for the run: planning, the drafter's block pass, its
head over the draft vocabulary, the Markov head, the context injection of committed rows and the
`read_accept` clones; the target's verify forward with the folded accept is what remains. The
drafting share is drafting / plain decode step (the issue's target: at most 15% at batch 1).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from typing import Any, Callable

from specserve.args import ServerArgs, number_list
from specserve.datasets import mtbench_first_turns

DRAFTING = ("block_hidden", "draft_head", "markov_decode")


def add_dspark_step_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--num-prompts", type=int, default=8, help="MT-Bench first turns per batch size")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--draft-weights", default="bf16,q8",
                   help="comma-separated --speculative-draft-weights modes, one DSPARK engine each, same run")
    p.add_argument("--out", default=None, help="write the breakdown as JSON here")


def _timed(totals: dict[str, float], name: str, fn: Callable, inside: dict[str, bool] | None = None) -> Callable:
    """fn, adding its seconds to totals[name] and its calls to totals[name + "_count"]; with
    `inside`, only calls made while inside["verify"] (a verify step) count."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if inside is None or inside["verify"]:
                totals[name] += time.perf_counter() - start
                totals[name + "_count"] += 1
    return wrapper


def instrument(engine) -> dict[str, float]:
    """Wrap the parts of a verify step on this engine's objects; returns the running totals."""
    totals: dict[str, float] = defaultdict(float)
    inside = {"verify": False}
    drafter = engine.dspark_drafter()
    assert drafter is not None, "dspark-step: the engine has no DSPARK drafter"

    def verify_step(verify):
        def marked(step, *rest):
            inside["verify"] = True
            try:
                return verify(step, *rest)
            finally:
                inside["verify"] = False
        return _timed(totals, "verify_step", marked)

    def epilogue(make_epilogue):  # read_accept: the verify epilogue's, made at the first verify step
        def made(width):
            out = make_epilogue(width)
            if "read_accept" not in vars(out):
                out.read_accept = _timed(totals, "read_accept", out.read_accept, inside)
            return out
        return made

    engine.instrument("verify", verify_step)
    engine.instrument("plan", lambda plan: _timed(totals, "plan", plan))  # just before the verify (ModelRunner._step)
    engine.instrument("verify_epilogue", epilogue)
    drafter.block_hidden = _timed(totals, "block_hidden", drafter.block_hidden, inside)
    drafter.lm_head.forward = _timed(totals, "draft_head", drafter.lm_head.forward, inside)
    drafter.markov_decode = _timed(totals, "markov_decode", drafter.markov_decode, inside)
    drafter.inject = _timed(totals, "inject", drafter.inject, inside)  # the committed rows of verify steps
    return totals


def instrument_plain(engine) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    engine.instrument("decode", lambda decode: _timed(totals, "decode_step", decode))
    return totals


def run_dspark_step_bench(ns: argparse.Namespace, args: ServerArgs) -> int:
    from specserve.bench.offline import prompt_ids
    from specserve.bench.provenance import provenance
    from specserve.engine import Engine

    base = {k: v for k, v in vars(args).items() if not k.startswith("speculative_")}
    modes = [m.strip() for m in ns.draft_weights.split(",") if m.strip()]
    questions = mtbench_first_turns()[:ns.num_prompts]
    report: dict[str, Any] = {**provenance(args.speculative_draft_model_path), "new_tokens": ns.new_tokens,
                              "num_prompts": len(questions), "draft_weights": {m: {"batch_sizes": {}} for m in modes}}
    plain = Engine(**base, speculative_algorithm="NONE")
    specs = {m: Engine(**base, speculative_algorithm="DSPARK", speculative_policy="fixed", speculative_draft_weights=m,
                       speculative_draft_model_path=args.speculative_draft_model_path) for m in modes}
    prompts = prompt_ids(plain.tokenizer, [q["prompt"] for q in questions])
    plain_totals, spec_totals = instrument_plain(plain), {m: instrument(e) for m, e in specs.items()}
    params = {"temperature": 0, "max_new_tokens": ns.new_tokens}
    for bs in number_list("--batch-sizes", ns.batch_sizes):
        for totals in (plain_totals, *spec_totals.values()):
            totals.clear()
        metas: dict[str, list[dict]] = {m: [] for m in modes}
        for i in range(0, len(prompts), bs):  # interleaved: each chunk through every engine in turn
            plain.reset_prefix_cache()
            plain.generate(input_ids=prompts[i:i + bs], sampling_params=params)
            for m, engine in specs.items():
                engine.reset_prefix_cache()
                metas[m] += [o["meta_info"] for o in engine.generate(input_ids=prompts[i:i + bs], sampling_params=params)]
        for m in modes:
            report["draft_weights"][m]["batch_sizes"][bs] = breakdown(dict(plain_totals), dict(spec_totals[m]))
            report["draft_weights"][m]["batch_sizes"][bs]["accept_length"] = accept_length(metas[m])
        print(json.dumps({bs: {m: report["draft_weights"][m]["batch_sizes"][bs] for m in modes}}, indent=2), flush=True)
    for engine in (plain, *specs.values()):
        engine.shutdown()
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def accept_length(metas: list[dict]) -> float:
    """1 + accepted drafts per verify step, over every request (the fixed policy drafts every step)."""
    steps = sum(m["spec_verify_ct"] for m in metas)
    return round(1 + sum(m["spec_num_correct_drafts"] for m in metas) / max(steps, 1), 4)


def breakdown(plain: dict[str, float], spec: dict[str, float]) -> dict[str, Any]:
    """Milliseconds per step for each part, and shares of the plain decode step."""
    decode_ms = 1e3 * plain["decode_step"] / max(plain["decode_step_count"], 1)
    n = max(spec.get("verify_step_count", 0), 1)
    parts = {k: 1e3 * v / n for k, v in spec.items() if not k.endswith("_count")}
    parts["verify_step"] += parts.get("plan", 0.0)  # the step plans, then verifies: both are its cost
    parts["target_verify_and_accept"] = parts["verify_step"] - sum(
        parts.get(k, 0.0) for k in ("plan", "read_accept", "inject") + DRAFTING)
    drafting = sum(parts.get(k, 0.0) for k in DRAFTING)
    return {"plain_decode_step_ms": round(decode_ms, 3), "plain_decode_steps": int(plain["decode_step_count"]),
            "verify_steps": n, "verify_step_parts_ms": {k: round(v, 3) for k, v in sorted(parts.items())},
            "drafting_ms": round(drafting, 3), "drafting_share_of_decode_step": round(drafting / decode_ms, 3),
            "injection_share_of_decode_step": round(parts.get("inject", 0.0) / decode_ms, 3),
            "verify_step_vs_decode_step": round(parts["verify_step"] / decode_ms, 3)}
