"""`python -m benchmarks drafter-shapes`: drafter shapes side by side, each trained from scratch on the
same shards for the same minutes, so the shipped shape is chosen by measurement.

Every arm is a set of `train-drafter` shape flags (layers, context layers, Markov rank, draft
vocabulary, block size). After training, each drafter is served on the dev prompts (accept length
as served and at every anchor, DSPARK fixed, bf16, greedy) and timed at batch 1: the drafter's part
of a verify step (its block pass, head and Markov head) and the whole step, against a plain decode
step of the same engine build, and the end-to-end tokens/s against NONE on the same prompts.

Runs accumulate: with `--out` naming the results of an earlier run of the same settings on the same
machine, this run's arms are added to it, and each arm's speed-up is against the NONE timing of its
own run (`plain_runs[arm["plain_run"]]`), since a shared host's speed moves between runs. With
`--work` naming an earlier run's folder, an arm already trained there with the same settings is
served again instead of trained again (`--retrain` to train it anyway).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import tempfile
import time

from specserve.errors import ConfigError
from specserve.train.corpus_cli import DEFAULT_DATA_DIR

DEFAULT_SHAPE_ARMS = ("base=;layers2=--num-layers 2;context1=--num-context-layers 1;context5=--num-context-layers 5;"
                      "markov16=--markov-rank 16;markov256=--markov-rank 256;vocab8k=--draft-vocab-size 8192;"
                      "vocab32k=--draft-vocab-size 32768;block4=--block-size 4;block8=--block-size 8")
SHAPE_FLAGS = {"--num-layers", "--num-context-layers", "--markov-rank", "--draft-vocab-size", "--block-size"}


def add_shape_ablation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arms", default=DEFAULT_SHAPE_ARMS, help="NAME=FLAGS;... with train-drafter shape flags "
                                                              "(empty FLAGS: the defaults)")
    p.add_argument("--only", default=None, help="comma-separated arm names to run (default: all)")
    p.add_argument("--sources", default="sharegpt-greedy")
    p.add_argument("--shards", default="0-1", help="the same shards for every arm")
    p.add_argument("--minutes", type=float, default=8.0, help="training minutes per arm")
    p.add_argument("--dev-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--speed-prompts", type=int, default=6, help="dev prompts timed one at a time")
    p.add_argument("--speed-tokens", type=int, default=96)
    p.add_argument("--data", default=DEFAULT_DATA_DIR)
    p.add_argument("--work", default=None, help="folder for the arms' drafters (default: a temporary one)")
    p.add_argument("--out", default=None, help="JSON results (rewritten after each arm; an earlier run's file of "
                                              "the same settings is added to)")
    p.add_argument("--retrain", action="store_true", help="train every arm, even one already trained in --work")


def parse_shape_arms(spec: str, only: str | None = None) -> list[tuple[str, list[str]]]:
    """"NAME=FLAGS;..." as (name, flags); only shape flags are allowed, so arms differ in shape alone."""
    arms = []
    for part in (p.strip() for p in spec.split(";") if p.strip()):
        name, sep, flags = part.partition("=")
        argv = shlex.split(flags)
        bad = [a for a in argv[::2] if a not in SHAPE_FLAGS]
        if not sep or not name or bad or len(argv) % 2:
            raise ConfigError(f"--arms: {part!r} is not NAME=FLAGS with shape flags ({', '.join(sorted(SHAPE_FLAGS))})")
        arms.append((name, argv))
    if only:
        wanted = [n.strip() for n in only.split(",")]
        unknown = set(wanted) - {n for n, _ in arms}
        if unknown:
            raise ConfigError(f"--only: no arm named {', '.join(sorted(unknown))}")
        arms = [a for a in arms if a[0] in wanted]
    return arms


def run_shape_ablation(ns: argparse.Namespace) -> int:
    from benchmarks.arms import dev_score

    arms = parse_shape_arms(ns.arms, ns.only)
    work = ns.work or tempfile.mkdtemp(prefix="drafter-shapes-")
    results, plain = _earlier_results(ns), _plain_speed(ns)
    results["plain_runs"].append(plain)
    plain_run = len(results["plain_runs"]) - 1
    for name, flags in arms:
        out = os.path.join(work, name)
        ext, reused = _trained_arm(out, name, flags, ns)
        dev = dev_score(out, ns.data, ns.dev_prompts, ns.max_new_tokens)
        speed = _drafter_speed(out, ns)
        results["arms"][name] = {
            "flags": " ".join(flags), "steps": ext["run_steps"], "positions_per_s": ext["positions_per_s"],
            "teacher_forced": ext["held_out_teacher_forced"]["after"]["accept_length"],
            "dev_accept_length": dev["served"]["accept_length"], "dev_first_draft": dev["served"]["first_draft_accepted"],
            "dev_every_anchor": dev["every_anchor"]["accept_length"], "batch1": speed, "plain_run": plain_run,
            "batch1_speedup_vs_none": round(speed["tokens_per_s"] / plain["tokens_per_s"], 3),
            "trained_in_an_earlier_run": reused}
        print(json.dumps({name: results["arms"][name]}), flush=True)
        if ns.out:
            with open(ns.out, "w") as f:
                json.dump(results, f, indent=1)
    return 0


def _settings(ns: argparse.Namespace) -> dict:
    from specserve.kernels.dispatch import machine_description

    return {"shards": ns.shards, "sources": ns.sources, "minutes": ns.minutes, "machine": machine_description(),
            "dev_prompts": ns.dev_prompts, "max_new_tokens": ns.max_new_tokens}


def _earlier_results(ns: argparse.Namespace) -> dict:
    """The results of `--out` when an earlier run there had these settings; else a new record."""
    settings = _settings(ns)
    if ns.out and os.path.exists(ns.out):
        with open(ns.out) as f:
            earlier = json.load(f)
        if all(earlier.get(k) == v for k, v in settings.items()):
            return earlier
        print(f"drafter-shapes: {ns.out} holds a run of other settings; starting a new record", flush=True)
    return {**settings, "plain_runs": [], "arms": {}}


def _trained_arm(out: str, name: str, flags: list[str], ns: argparse.Namespace) -> tuple[dict, bool]:
    """The arm's training record: the one in `out` when an earlier run trained this arm there with
    the same settings (and --retrain is off), else a fresh from-scratch training run."""
    from benchmarks.arms import train_arm, train_parser
    from specserve.train.model_card import read_train_state

    argv = ["--out", out, "--data", ns.data, "--sources", ns.sources, "--shards", ns.shards,
            "--max-minutes", str(ns.minutes), "--steps", "1000000", "--checkpoint-every", "1000000",
            "--note", f"drafter-shapes arm {name}", *flags]
    if not ns.retrain and os.path.exists(os.path.join(out, "train_state.json")):
        ext = read_train_state(out)["extensions"][-1]
        if trained_as_asked(ext, vars(train_parser().parse_args(argv))):
            return ext, True
    return train_arm(argv), False


def trained_as_asked(ext: dict, args: dict) -> bool:
    """Whether a recorded training run is the from-scratch run these train-drafter args ask for."""
    return ext["started_from"] == "scratch" and all(ext["args"].get(k) == args[k] for k in _SAME_FOR_REUSE)


# What an earlier run's arm must share with this one to be reused: data, budget and shape.
_SAME_FOR_REUSE = {"sources", "shards", "max_minutes", "num_layers", "num_context_layers", "markov_rank",
                   "draft_vocab_size", "block_size", "seed", "seqs_per_step", "anchors_per_seq", "lr", "topk"}


def _speed_prompts(engine, ns: argparse.Namespace) -> list[list[int]]:
    from specserve.train.eval_drafter import load_prompt_set

    prompts = load_prompt_set("dev", ns.data)[-ns.speed_prompts:]
    return [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]


def _timed_generate(engine, ns: argparse.Namespace, totals: dict) -> tuple[int, float]:
    """Completion tokens and seconds for the speed prompts, one request at a time, after one untimed
    warm-up (whose step timings are dropped from `totals`)."""
    prompts = _speed_prompts(engine, ns)
    params = {"temperature": 0, "max_new_tokens": ns.speed_tokens}
    engine.generate(input_ids=prompts[0], sampling_params=params)
    totals.clear()
    tokens, started = 0, time.perf_counter()
    for ids in prompts:
        engine.reset_prefix_cache()
        tokens += len(engine.generate(input_ids=ids, sampling_params=params)["output_ids"])
    return tokens, time.perf_counter() - started


def _plain_speed(ns: argparse.Namespace) -> dict:
    from benchmarks.dspark_step import instrument_plain
    from specserve.engine import Engine

    with Engine(speculative_algorithm="NONE", random_seed=0) as engine:
        totals = instrument_plain(engine)
        tokens, seconds = _timed_generate(engine, ns, totals)
    return {"tokens_per_s": round(tokens / seconds, 2),
            "decode_step_ms": round(1e3 * totals["decode_step"] / max(totals["decode_step_count"], 1), 3)}


def _drafter_speed(drafter: str, ns: argparse.Namespace) -> dict:
    """Batch-1 tokens/s and the verify step's parts (ms per step) with this drafter."""
    from benchmarks.dspark_step import DRAFTING, instrument
    from specserve.engine import Engine

    with Engine(speculative_algorithm="DSPARK", speculative_policy="fixed", speculative_draft_model_path=drafter,
                random_seed=0) as engine:
        totals = instrument(engine)
        tokens, seconds = _timed_generate(engine, ns, totals)
    steps = max(totals["verify_step_count"], 1)
    return {"tokens_per_s": round(tokens / seconds, 2),
            "verify_step_ms": round(1e3 * totals["verify_step"] / steps, 3),
            "drafting_ms": round(1e3 * sum(totals[k] for k in DRAFTING) / steps, 3)}
