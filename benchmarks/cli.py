"""`python -m benchmarks NAME`: the experiments, ablations and the documents' renderer.

They are not part of the installed package (a user runs `specserve bench offline|spec|serving|load|
quality|models|stale-accept`); they live here, beside the tests that check them, and run from a
checkout with the engine installed (`bash scripts/setup.sh --test`).
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from specserve.cli import Command, main as specserve_main

COMMANDS: tuple[Command, ...] = (
    Command(
        "train-speed",
        "drafter training positions/s by batch shape, and where a step goes",
        "benchmarks.train_speed:add_train_speed_args",
        "benchmarks.train_speed:run_train_speed",
    ),
    Command(
        "drafter-sources",
        "dev accept length gained per machine-hour by each source of drafter "
        "training data, against more training on data already used",
        "benchmarks.source_value:add_source_value_args",
        "benchmarks.source_value:run_source_value",
    ),
    Command(
        "drafter-shapes",
        "drafter shapes trained from scratch on the same data and minutes: dev "
        "accept length, drafting cost and batch-1 speed",
        "benchmarks.shape_ablation:add_shape_ablation_args",
        "benchmarks.shape_ablation:run_shape_ablation",
    ),
    Command(
        "dspark-step",
        "where a DSPARK verify step's time goes, against a plain decode step",
        "benchmarks.dspark_step:add_dspark_step_args",
        "benchmarks.dspark_step:run_dspark_step_bench",
        engine_flags=True,
    ),
    Command(
        "standalone-cost",
        "a STANDALONE step at batch 1 against a plain decode step per target file, and the acceptance "
        "at which the draft model pays (composed)",
        "benchmarks.standalone_cost:add_standalone_cost_args",
        "benchmarks.standalone_cost:run_standalone_cost",
        engine_flags=True,
    ),
    Command(
        "host-waits",
        "where each speculation configuration's launches still wait on the device (counts, greedy and sampled)",
        "benchmarks.host_waits:add_host_waits_args",
        "benchmarks.host_waits:run_host_waits",
    ),
    Command(
        "router",
        "2 replicas behind SGLang's router on MT-Bench conversations: cache-aware vs "
        "round-robin hit rate and TTFT, 1 vs 2 replicas throughput",
        "benchmarks.router:add_router_bench_args",
        "benchmarks.router:run_router_bench",
    ),
    Command(
        "hicache",
        "MT-Bench second turns with a small device pool: radix-only vs HiCache",
        "benchmarks.hicache:add_hicache_bench_args",
        "benchmarks.hicache:run_hicache_bench",
        engine_flags=True,
    ),
    Command(
        "weight-stream",
        "every linear of a batch-1 step in order: ms and GB/s per role and weight kind, against the read bandwidth",
        "benchmarks.weight_stream:add_weight_stream_args",
        "benchmarks.weight_stream:run_weight_stream",
    ),
    Command(
        "moe-routing",
        "a mixture's distinct experts per layer, a row against a window, random ids and text, two contexts",
        "benchmarks.moe_routing:add_moe_routing_args",
        "benchmarks.moe_routing:run_moe_routing",
    ),
    Command(
        "startup",
        "seconds from starting the server to its first token, against native llama-server on the same file",
        "benchmarks.startup:add_startup_args",
        "benchmarks.startup:run_startup",
    ),
    Command(
        "prefetch",
        "the decode and verify steps with the kernels' weight prefetching off and on, alternating runs",
        "benchmarks.prefetch:add_prefetch_bench_args",
        "benchmarks.prefetch:run_prefetch_bench",
    ),
    Command(
        "linear-rows",
        "time per linear against its row count, bf16 against int8 activations (what a verify row costs)",
        "benchmarks.linear_rows:add_linear_rows_bench_args",
        "benchmarks.linear_rows:run_linear_rows_bench",
        engine_flags=True,
    ),
    Command(
        "kernel-paths",
        "decode and prefill tokens/s through each CPU kernel path this machine runs "
        "(AVX512-BF16, AVX2, generic), same tokens required",
        "benchmarks.kernel_paths:add_kernel_paths_bench_args",
        "benchmarks.kernel_paths:run_kernel_paths_bench",
    ),
    Command(
        "grammar",
        "grammar library costs (llguidance vs XGrammar) and structured output under speculation against NONE",
        "benchmarks.grammar:add_grammar_bench_args",
        "benchmarks.grammar:run_grammar_bench",
    ),
    Command(
        "overlap",
        "overlap loop vs normal loop decode throughput",
        "benchmarks.overlap:add_overlap_bench_args",
        "benchmarks.overlap:run_overlap_bench",
        engine_flags=True,
    ),
    Command(
        "tp-cost",
        "TP 1 vs TP 2, with and without the consensus checker: soak runs of one token budget, interleaved",
        "benchmarks.tp_cost:add_tp_cost_args",
        "benchmarks.tp_cost:run_tp_cost_bench",
    ),
    Command(
        "report",
        "render the documents' figures from the committed result files (--check: fail on a disagreement)",
        "benchmarks.report:add_report_args",
        "benchmarks.report:run_report",
    ),
    Command(
        "rescore-line",
        "score every extension of the shipped drafter line (from git history) on the line's whole held-out set",
        "benchmarks.line_score:add_rescore_line_args",
        "benchmarks.line_score:run_rescore_line",
    ),
)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return specserve_main(argv, COMMANDS, prog="python -m benchmarks", description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
