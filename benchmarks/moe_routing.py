"""`python -m benchmarks moe-routing`: the distinct experts a mixture's rows route to, per layer
(mean over layers), one row against a window of rows, for random token ids and for text, in two
contexts: after a few cached rows whose K/V is zero (a new engine's pool: the rows see mostly each
other) and after a 256-token text prefill (a shared context to attend to).

On a synthetic file (random weights) it tells whether the payload routes like a real model, whose
rows spread over many experts, and how far a shared context pulls random-weight rows together (a
random attention spreads its weight over the whole context, so every row reads nearly the same
average), which is the context `specserve bench models` times its verify window in.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

CONTEXTS = {"8 cached rows, zero K/V": 8, "after a 256-token text prefill": 256}


def add_moe_routing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", required=True, help="a mixture-of-experts GGUF file")
    p.add_argument("--window", type=int, default=4, help="rows of the window")
    p.add_argument("--seed", type=int, default=1, help="the random token ids' seed")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def routing(engine, ids: list[int], prefix_len: int) -> dict[str, float]:
    from specserve.bench.offline import distinct_experts

    return {"row": distinct_experts(engine, ids[:1], prefix_len), "window": distinct_experts(engine, ids, prefix_len)}


def prefill_text(engine, tokens: list[int]) -> None:
    """The text's K/V written to the slots a later pass's prefix reads (`Engine.forward_rows`)."""
    with engine.forward_rows(len(tokens), 0, input_ids=tokens, last_logit_only=True) as forward:
        forward()


def run_moe_routing(ns: argparse.Namespace) -> int:
    from specserve.bench.offline import _long_ids
    from specserve.bench.provenance import emit_report, provenance
    from specserve.engine.engine import Engine

    report: dict[str, Any] = {"model": ns.model_path, "window": ns.window, "seed": ns.seed, "figures": {}}
    with Engine(model_path=ns.model_path, dtype="bfloat16", speculative_algorithm="NONE", max_total_tokens=1024) as engine:
        config = engine.target_model.config
        report |= {"experts": config.num_experts, "experts_per_token": config.num_experts_per_tok}
        kinds = {"random ids": np.random.default_rng(ns.seed).integers(0, config.vocab_size, size=ns.window).tolist(),
                 "text": _long_ids(engine.tokenizer, ns.window)}  # fmt: skip
        for context, prefix_len in CONTEXTS.items():  # the zero-K/V context first: a new engine's pool
            if prefix_len == CONTEXTS["after a 256-token text prefill"]:
                prefill_text(engine, _long_ids(engine.tokenizer, prefix_len))
            for kind, ids in kinds.items():
                report["figures"][f"{kind}, {context}"] = routing(engine, ids, prefix_len)
    report |= provenance(None)
    emit_report(report, ns.out)
    return 0
