"""Shared parts of the drafter experiments (`bench drafter-sources`, `bench drafter-shapes`): train
one arm through `train-drafter` and score a drafter as served on the dev prompts."""

from __future__ import annotations

import time

from specserve.train.model_card import read_train_state


def train_parser():
    """The `specserve train-drafter` argument parser."""
    import argparse

    from specserve.train.run import add_train_args

    parser = argparse.ArgumentParser(prog="specserve train-drafter")
    add_train_args(parser)
    return parser


def train_arm(argv: list[str]) -> dict:
    """Run `specserve train-drafter ARGV` in this process; the extension it recorded."""
    from specserve.train.run import run_train_drafter

    ns = train_parser().parse_args(argv)
    run_train_drafter(ns)
    return read_train_state(ns.out)["extensions"][-1]


def dev_score(drafter: str, data: str, num_prompts: int, max_new_tokens: int, batch_size: int = 16) -> dict:
    """The drafter served on the first `num_prompts` dev prompts (all for 0): DSPARK fixed policy,
    static verify, greedy, bf16; the served walk and the every-anchor mean (`eval_drafter`)."""
    from specserve.engine import Engine
    from specserve.train.eval_drafter import evaluate_drafter, load_prompt_set

    prompts = load_prompt_set("dev", data)
    prompts = prompts[:num_prompts] if num_prompts else prompts
    engine = Engine(speculative_algorithm="DSPARK", speculative_policy="fixed", speculative_draft_model_path=drafter,
                    max_running_requests=batch_size, random_seed=0)
    try:
        started = time.perf_counter()
        report = evaluate_drafter(engine, prompts, max_new_tokens)
        report["eval_s"] = round(time.perf_counter() - started, 1)
        return report
    finally:
        engine.shutdown()
