"""`python -m benchmarks host-waits`: where each configuration's launches still wait on the device.

For each speculation configuration, one engine (overlap loop) with the host-wait detector counting
(SPECSERVE_HOST_WAITS=count, runtime/host_waits.py) generates greedy and sampled answers to chat
prompts; reported per configuration and mode: the launches, the waits counted inside them, the
waits per launch, and each wait's operation and line, most frequent first. Zero is what the overlap
loop needs on CUDA; a non-zero line is the next thing to move onto the device. Counts, not timings.
"""

from __future__ import annotations

import argparse
import collections
import os
from typing import Any

from specserve.bench.provenance import emit_report, provenance

CONFIGS: dict[str, dict[str, Any]] = {
    "NONE": {"speculative_algorithm": "NONE"},
    "NGRAM": {"speculative_algorithm": "NGRAM", "speculative_policy": "fixed"},
    "SUFFIX": {"speculative_algorithm": "SUFFIX", "speculative_policy": "fixed"},
    "DSPARK-static": {"speculative_algorithm": "DSPARK", "speculative_policy": "fixed"},
    "DSPARK-compact": {"speculative_algorithm": "DSPARK", "speculative_policy": "fixed",
                       "speculative_verify_mode": "compact"},
    "DEFAULT": {},  # the adaptive policy over DSPARK, NGRAM and SUFFIX
}
CONTENTS = ["Count from 1 to 20, separated by commas.", "What is the capital of France?",
            "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.", "Write a haiku about rain."]
MODES = {"greedy": {"temperature": 0}, "sampled": {"temperature": 0.8, "top_p": 0.9, "seed": 7},
         "penalised": {"temperature": 0.8, "seed": 7, "frequency_penalty": 0.5, "presence_penalty": 0.3},
         "logprobs": {"temperature": 0, "logprobs": True, "top_logprobs": 2}}


def add_host_waits_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"some of {', '.join(CONFIGS)}")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--cpu-choices", action="store_true",
                   help="CPU's choices (planned windows packed, SUFFIX walked on the host, plans from the last step: "
                        "all wait) instead of CUDA's and the opt-in lagged plans")
    p.add_argument("--out", default=None)


def run_host_waits(args: argparse.Namespace) -> int:
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"host-waits: unknown configs {unknown}; choose from {', '.join(CONFIGS)}")
    previous = os.environ.get("SPECSERVE_HOST_WAITS")
    os.environ["SPECSERVE_HOST_WAITS"] = "count"
    try:
        results = [row for name in names for row in _census(name, args)]
    finally:
        os.environ.pop("SPECSERVE_HOST_WAITS") if previous is None else os.environ.update(SPECSERVE_HOST_WAITS=previous)
    report = {**provenance(), "new_tokens": args.new_tokens, "dtype": args.dtype,
              "static_windows": not args.cpu_choices, "suffix_on_device": not args.cpu_choices,
              "lagged_plans": not args.cpu_choices, "results": results}
    emit_report(report, args.out)
    return 0


def _census(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from specserve import Engine

    engine = Engine(dtype=args.dtype, max_total_tokens=8192, **CONFIGS[name])
    launches = collections.Counter()

    def counting(launch):
        def counted(step):
            launches[step.mode.value] += 1
            return launch(step)
        return counted

    engine.instrument("launch", counting)
    # CUDA's choices unless asked; lagged plans: the adaptive policy plans from commits two launches back
    cuda = not args.cpu_choices
    engine.set_step_choices(static_windows=cuda, lagged_plans=cuda, drafts_on_device=cuda)
    engine.take_host_waits()  # the detector is on (SPECSERVE_HOST_WAITS=count), and nothing counted yet
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CONTENTS]
    rows = []
    try:
        for mode, params in MODES.items():
            engine.reset_prefix_cache()
            engine.take_host_waits()
            launches.clear()
            overlapped = engine.loop.overlapped_steps
            engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": args.new_tokens})
            waits = engine.take_host_waits()
            sites = collections.Counter(f"{w.op} at {w.site}" for w in waits).most_common()
            total = sum(launches.values())
            rows.append({"config": name, "mode": mode, "launches": dict(launches), "waits": len(waits),
                         "waits_per_launch": len(waits) / total if total else 0.0,
                         "overlapped_steps": engine.loop.overlapped_steps - overlapped,
                         "sites": [{"where": s, "count": n} for s, n in sites]})
    finally:
        engine.shutdown()
    return rows
