"""The `specserve` command: serve, generate, train-drafter, drafter-corpus, eval-drafter, init-drafter, eval-acceptance, profile-sps, bench."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, NoReturn, Optional, Sequence

from specserve.args import MAX_DRAFT_TOKENS, MAX_SEED, ServerArgs
from specserve.server.engine_process import HEARTBEAT_S

# The subcommands' own numeric flags: flag -> (allowed, check). ServerArgs checks its fields itself.
# A flag a command lacks is skipped, so each bound must hold for every command that has the flag.
_AT_LEAST_0 = (">= 0", lambda v: v >= 0)
_AT_LEAST_1 = (">= 1", lambda v: v >= 1)
_POSITIVE = ("> 0", lambda v: v > 0)
FLAG_BOUNDS: dict[str, tuple[str, Callable[[float], bool]]] = {
    "seed": ("in [0, 2^64)", lambda v: 0 <= v <= MAX_SEED), "temperature": _AT_LEAST_0,
    "max_new_tokens": _AT_LEAST_0, "new_tokens": _AT_LEAST_1, "max_tokens": _AT_LEAST_1, "batch_size": _AT_LEAST_1,
    "num_prompts": _AT_LEAST_0, "num_texts": _AT_LEAST_1, "prefill_len": _AT_LEAST_1, "hf_prompts": _AT_LEAST_0, "num_questions": _AT_LEAST_1, "answer_tokens": _AT_LEAST_1,
    "device_tokens": (">= 16", lambda v: v >= 16), "repeats": _AT_LEAST_1, "prefix_len": _AT_LEAST_0,
    "window": (f"in [1, {MAX_DRAFT_TOKENS + 1}]", lambda v: 1 <= v <= MAX_DRAFT_TOKENS + 1),
    "wave": _AT_LEAST_1, "small_new_tokens": _AT_LEAST_1, "large_new_tokens": _AT_LEAST_1,
    "copy_delay_ms": _AT_LEAST_0, "forward_delay_ms": _AT_LEAST_0, "copy_lag_ms": _AT_LEAST_0, "max_minutes": _POSITIVE,
    "random_input_words": _AT_LEAST_1, "runs": _AT_LEAST_1, "clean_tokens": _AT_LEAST_1, "request_rate": _POSITIVE, "warmup": _AT_LEAST_0, "timeout": _POSITIVE,
    "topk": _AT_LEAST_1, "num_layers": _AT_LEAST_1, "markov_rank": _AT_LEAST_1, "num_context_layers": _AT_LEAST_1,
    "block_size": (f"in [1, {MAX_DRAFT_TOKENS}]", lambda v: 1 <= v <= MAX_DRAFT_TOKENS),
    "mask_token_id": _AT_LEAST_0, "draft_vocab_size": _AT_LEAST_0, "steps": _AT_LEAST_1, "seqs_per_step": _AT_LEAST_1,
    "anchors_per_seq": _AT_LEAST_0, "lr": _POSITIVE, "checkpoint_every": _AT_LEAST_1, "held_out": _AT_LEAST_0,
    # serve
    "port": ("in [1, 65535]", lambda v: 1 <= v <= 65535), "max_queued_requests": _AT_LEAST_1,
    "max_request_bytes": _AT_LEAST_1, "shutdown_timeout": _AT_LEAST_0, "engine_step_timeout": _POSITIVE,
    "engine_heartbeat_timeout": (f"> {HEARTBEAT_S:g} (the heartbeat interval)", lambda v: v > HEARTBEAT_S),
    "dp_size": _AT_LEAST_1, "num_conversations": _AT_LEAST_1, "concurrency": _AT_LEAST_1,
    "first_tokens": _AT_LEAST_1, "second_tokens": _AT_LEAST_1, "router_health_check_interval": _AT_LEAST_1, "replica_unhealthy_timeout": _POSITIVE,
    # bench load
    "minutes": _POSITIVE, "clients": _AT_LEAST_1, "rss_baseline_s": _AT_LEAST_0, "max_rss_growth": _POSITIVE,
    "hostile_share": _AT_LEAST_0, "disconnect_share": _AT_LEAST_0, "abort_share": _AT_LEAST_0,
}


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (`specserve <cmd>: error: ...`, exit code 2) and no usage dump;
    subcommand parsers are of the same class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def check_flag_bounds(ns: argparse.Namespace) -> None:
    """Raise ValueError naming the first subcommand flag outside its range (see FLAG_BOUNDS)."""
    for dest, (allowed, ok) in FLAG_BOUNDS.items():
        value = getattr(ns, dest, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not ok(value):
            raise ValueError(f"--{dest.replace('_', '-')} must be {allowed}, got {value}")


def _prog(ns: argparse.Namespace) -> str:
    return " ".join(["specserve", ns.command] + ([ns.bench_command] if ns.command == "bench" else []))


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion offline and print it")
    gen.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print the whole output dict as JSON")
    _add_sampling_args(gen)
    ServerArgs.add_cli_args(gen)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, /generate, /metrics)")
    from specserve.server.launch import add_serve_args
    from specserve.server.replicas import add_data_parallel_args

    add_serve_args(srv)
    add_data_parallel_args(srv)
    ServerArgs.add_cli_args(srv)
    srv.set_defaults(log_level="info")  # the start-up block and the ready line

    soak = sub.add_parser("soak", help="the production-like configuration (TP 2, DSPARK, overlap, checker) for a budget")
    from specserve.bench.soak import SOAK_DEFAULTS, add_soak_args

    add_soak_args(soak)
    ServerArgs.add_cli_args(soak)
    soak.set_defaults(**SOAK_DEFAULTS)

    trn = sub.add_parser("train-drafter", help="train a DSpark drafter by self-distillation on ShareGPT prompts")
    from specserve.train.run import add_train_args

    add_train_args(trn)
    dc = sub.add_parser("drafter-corpus", help="extend the drafter's training corpus (token-id shards) or show it")
    from specserve.train.corpus_cli import add_corpus_args

    add_corpus_args(dc)
    evd = sub.add_parser("eval-drafter", help="a drafter's accept length as served and at every anchor, on the "
                                              "corpus's dev / held-out sets or benchmarks")
    from specserve.train.eval_drafter import add_eval_drafter_args

    add_eval_drafter_args(evd)
    init = sub.add_parser("init-drafter", help="write a randomly initialised DSpark drafter for a target model")
    init.add_argument("--out", required=True, help="directory to write config.json and model.safetensors to")
    init.add_argument("--model-path", default=None, help="target model (default: the embedded one)")
    init.add_argument("--num-layers", type=int, default=1)
    init.add_argument("--block-size", type=int, default=5, help="gamma: drafts per step")
    init.add_argument("--markov-rank", type=int, default=64)
    init.add_argument("--num-context-layers", type=int, default=3, help="target layers feeding the drafter")
    init.add_argument("--mask-token-id", type=int, default=0)
    init.add_argument("--seed", type=int, default=0)

    prof = sub.add_parser("profile-sps", help="record verify steps/s against batch verify tokens (compact mode)")
    from specserve.bench.profile_sps import add_profile_args

    add_profile_args(prof)
    ServerArgs.add_cli_args(prof)

    ev = sub.add_parser("eval-acceptance", help="accept length, per-position acceptance and tokens/s on a prompt set")
    from specserve.bench.eval_acceptance import add_eval_args

    add_eval_args(ev)
    ServerArgs.add_cli_args(ev)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    off = bench_sub.add_parser("offline", help="decode speed vs Hugging Face transformers on the same GGUF")
    from specserve.bench.offline import add_bench_args

    add_bench_args(off)
    ServerArgs.add_cli_args(off)
    spec = bench_sub.add_parser("spec", help="NONE vs NGRAM and DSPARK (fixed) vs the default policy on MT-Bench and HumanEval, with HF peers")
    from specserve.bench.spec import add_spec_bench_args

    add_spec_bench_args(spec)
    ServerArgs.add_cli_args(spec)
    tspeed = bench_sub.add_parser("train-speed", help="drafter training positions/s by batch shape, and where a step goes")
    from specserve.train.train_speed import add_train_speed_args

    add_train_speed_args(tspeed)
    dsrc = bench_sub.add_parser("drafter-sources", help="dev accept length gained per machine-hour by each source "
                                "of drafter training data, against more training on data already used")
    from specserve.train.source_value import add_source_value_args

    add_source_value_args(dsrc)
    dshape = bench_sub.add_parser("drafter-shapes", help="drafter shapes trained from scratch on the same data and "
                                  "minutes: dev accept length, drafting cost and batch-1 speed")
    from specserve.train.shape_ablation import add_shape_ablation_args

    add_shape_ablation_args(dshape)
    dstep = bench_sub.add_parser("dspark-step", help="where a DSPARK verify step's time goes, against a plain decode step")
    from specserve.bench.dspark_step import add_dspark_step_args

    add_dspark_step_args(dstep)
    ServerArgs.add_cli_args(dstep)
    srvb = bench_sub.add_parser("serving", help="drive OpenAI-compatible servers at a concurrency sweep and compare")
    from specserve.bench.serving import add_serving_bench_args

    add_serving_bench_args(srvb)
    load = bench_sub.add_parser("load", help="many streaming clients with disconnects, aborts and hostile requests "
                                "against a live server: no 5xx, no leaked KV, bounded memory")
    from specserve.bench.load import add_load_bench_args

    add_load_bench_args(load)
    rtr = bench_sub.add_parser("router", help="2 replicas behind SGLang's router on MT-Bench conversations: "
                               "cache-aware vs round-robin hit rate and TTFT, 1 vs 2 replicas throughput")
    from specserve.bench.router import add_router_bench_args

    add_router_bench_args(rtr)
    hic = bench_sub.add_parser("hicache", help="MT-Bench second turns with a small device pool: radix-only vs HiCache")
    from specserve.bench.hicache import add_hicache_bench_args

    add_hicache_bench_args(hic)
    ServerArgs.add_cli_args(hic)
    qual = bench_sub.add_parser("quality", help="bf16 against fp32 on the same weights: perplexity and greedy match rate")
    from specserve.bench.quality import add_quality_bench_args

    add_quality_bench_args(qual)
    ServerArgs.add_cli_args(qual)
    kpaths = bench_sub.add_parser("kernel-paths", help="decode and prefill tokens/s through each CPU kernel path "
                                  "this machine runs (AVX512-BF16, AVX2, generic), same tokens required")
    from specserve.bench.kernel_paths import add_kernel_paths_bench_args

    add_kernel_paths_bench_args(kpaths)
    gram = bench_sub.add_parser("grammar", help="grammar library costs (llguidance vs XGrammar) and structured "
                                "output under speculation against NONE")
    from specserve.bench.grammar import add_grammar_bench_args

    add_grammar_bench_args(gram)
    ovl = bench_sub.add_parser("overlap", help="overlap loop vs normal loop decode throughput")
    from specserve.bench.overlap import add_overlap_bench_args

    add_overlap_bench_args(ovl)
    ServerArgs.add_cli_args(ovl)
    seed = bench_sub.add_parser("seed-failure", help="the seed's failure (aliased accept buffers, rank 1 a step late) "
                                "caught by the consensus checker, and the same runs with the fix")
    from specserve.bench.seed_failure import add_seed_failure_args

    add_seed_failure_args(seed)
    tpc = bench_sub.add_parser("tp-cost", help="TP 1 vs TP 2, with and without the consensus checker: soak runs "
                               "of one token budget, interleaved")
    from specserve.bench.tp_cost import add_tp_cost_args

    add_tp_cost_args(tpc)
    rep = bench_sub.add_parser("report", help="render the README's figures from the committed result files (--check: "
                               "fail on a disagreement)")
    from specserve.bench.report import add_report_args

    add_report_args(rep)
    return parser


def _generate(ns: argparse.Namespace) -> int:
    from specserve.engine import Engine

    args = ServerArgs.from_cli_args(ns)
    params = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature, "top_p": ns.top_p,
              "top_k": ns.top_k, "min_p": ns.min_p, "seed": ns.seed, "stop": ns.stop or []}
    from specserve.sampling_params import SamplingParams

    SamplingParams.from_dict(params)  # fail fast, before the model loads
    with Engine(**vars(args)) as engine:
        if ns.chat:
            ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": ns.prompt}])
            out = engine.generate(input_ids=ids, sampling_params=params)
        else:
            out = engine.generate(ns.prompt, sampling_params=params)
    print(json.dumps(out, indent=2) if ns.json else out["text"])
    return 0


def _init_drafter(ns: argparse.Namespace) -> int:
    from specserve.args import MAX_DRAFT_TOKENS
    from specserve.models.dspark import DsparkConfig, init_drafter, save_drafter
    from specserve.models.loader import load_model_config

    if not 1 <= ns.block_size <= MAX_DRAFT_TOKENS:
        raise ValueError(f"--block-size must be in [1, {MAX_DRAFT_TOKENS}], got {ns.block_size}")
    if ns.num_layers < 1 or ns.markov_rank < 1 or ns.num_context_layers < 1:
        raise ValueError("--num-layers, --markov-rank and --num-context-layers must be >= 1")
    target = load_model_config(ns.model_path)
    cfg = DsparkConfig.for_target(target, ns.num_layers, ns.block_size, ns.markov_rank, ns.num_context_layers,
                                  ns.mask_token_id)
    cfg.extra = {"init": "random", "seed": ns.seed, "target": ns.model_path or "default"}
    cfg.validate_for(target)
    save_drafter(ns.out, cfg, init_drafter(cfg, ns.seed))
    print(f"wrote a random DSpark drafter ({cfg.num_layers} layer(s), block {cfg.block_size}) to {ns.out}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the subcommand they were given to, like every other error
        print(f"{_prog(ns)}: error: unrecognized arguments: {' '.join(unknown)}", file=sys.stderr)
        return 2
    try:
        check_flag_bounds(ns)
        if ns.command == "generate":
            return _generate(ns)
        if ns.command == "serve":
            from specserve.server.launch import run_server
            from specserve.server.replicas import check_data_parallel_args, run_data_parallel

            args = ServerArgs.from_cli_args(ns)
            check_data_parallel_args(ns, args)
            return run_data_parallel(ns, args) if ns.dp_size > 1 else run_server(ns, args)
        if ns.command == "soak":
            from specserve.bench.soak import run_soak

            return run_soak(ns, ServerArgs.from_cli_args(ns))
        if ns.command == "train-drafter":
            from specserve.train.run import run_train_drafter

            return run_train_drafter(ns)
        if ns.command == "drafter-corpus":
            from specserve.train.corpus_cli import run_drafter_corpus

            return run_drafter_corpus(ns)
        if ns.command == "eval-drafter":
            from specserve.train.eval_drafter import run_eval_drafter

            return run_eval_drafter(ns)
        if ns.command == "eval-acceptance":
            from specserve.bench.eval_acceptance import run_eval_acceptance

            return run_eval_acceptance(ns, ServerArgs.from_cli_args(ns))
        if ns.command == "init-drafter":
            return _init_drafter(ns)
        if ns.command == "profile-sps":
            from specserve.bench.profile_sps import run_profile_sps

            return run_profile_sps(ns, ServerArgs.from_cli_args(ns))
        if ns.command == "bench" and ns.bench_command == "offline":
            from specserve.bench.offline import run_offline_bench

            return run_offline_bench(ns, ServerArgs.from_cli_args(ns))
        if ns.command == "bench" and ns.bench_command == "drafter-sources":
            from specserve.train.source_value import run_source_value

            return run_source_value(ns)
        if ns.command == "bench" and ns.bench_command == "drafter-shapes":
            from specserve.train.shape_ablation import run_shape_ablation

            return run_shape_ablation(ns)
        if ns.command == "bench" and ns.bench_command == "spec":
            from specserve.bench.spec import run_spec_bench

            return run_spec_bench(ns, ServerArgs.from_cli_args(ns))
        if ns.command == "bench" and ns.bench_command == "train-speed":
            from specserve.train.train_speed import run_train_speed

            return run_train_speed(ns)
        if ns.command == "bench" and ns.bench_command == "dspark-step":
            from specserve.bench.dspark_step import run_dspark_step_bench

            return run_dspark_step_bench(ns, ServerArgs.from_cli_args(ns))
        if ns.command == "bench" and ns.bench_command == "serving":
            from specserve.bench.serving import run_serving_bench

            return run_serving_bench(ns)
        if ns.command == "bench" and ns.bench_command == "load":
            from specserve.bench.load import run_load_bench

            return run_load_bench(ns)
        if ns.command == "bench" and ns.bench_command == "router":
            from specserve.bench.router import run_router_bench

            return run_router_bench(ns)
        if ns.command == "bench" and ns.bench_command == "hicache":
            from specserve.bench.hicache import run_hicache_bench

            return run_hicache_bench(ns, ServerArgs.from_cli_args(ns))
        if ns.command == "bench" and ns.bench_command == "quality":
            from specserve.bench.quality import run_quality_bench

            return run_quality_bench(ns, ServerArgs.from_cli_args(ns))
        if ns.command == "bench" and ns.bench_command == "tp-cost":
            from specserve.bench.tp_cost import run_tp_cost_bench

            return run_tp_cost_bench(ns)
        if ns.command == "bench" and ns.bench_command == "seed-failure":
            from specserve.bench.seed_failure import run_seed_failure_bench

            return run_seed_failure_bench(ns)
        if ns.command == "bench" and ns.bench_command == "report":
            from specserve.bench.report import run_report

            return run_report(ns)
        if ns.command == "bench" and ns.bench_command == "kernel-paths":
            from specserve.bench.kernel_paths import run_kernel_paths_bench

            return run_kernel_paths_bench(ns)
        if ns.command == "bench" and ns.bench_command == "grammar":
            from specserve.bench.grammar import run_grammar_bench

            return run_grammar_bench(ns)
        if ns.command == "bench" and ns.bench_command == "overlap":
            from specserve.bench.overlap import run_overlap_bench

            return run_overlap_bench(ns, ServerArgs.from_cli_args(ns))
    except ValueError as exc:  # a bad flag or setting: argparse's one line, before any model loads
        print(f"{_prog(ns)}: error: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {ns.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
