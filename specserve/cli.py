"""The `specserve` command: serve, generate, soak, train-drafter, drafter-corpus, eval-drafter,
init-drafter, eval-acceptance, profile-sps, and the user benchmarks (`bench offline`, `spec`, `serving`,
`load`, `quality`, `models`, `stale-accept`, `synth-model`). Experiments live in the repository's `benchmarks/`."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, Optional, Sequence

from specserve.args import ServerArgs
from specserve.errors import ConfigError, InvalidRequestError
from specserve.flag_bounds import check_flag_bounds
from specserve.sampling_params import (
    BOOLEAN,
    GRAMMAR,
    INTEGER,
    NUMBER,
    SAMPLING_FIELDS,
    STOP,
    TEXT,
    TOKEN_BIAS,
    TOKEN_IDS,
    SamplingField,
    SamplingParams,
)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (`specserve <cmd>: error: ...`, exit code 2) and no usage dump;
    subcommand parsers are of the same class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _prog(ns: argparse.Namespace, prog: str = "specserve") -> str:
    return " ".join([prog, ns.command] + ([ns.bench_command] if ns.command == "bench" else []))


# argparse's arguments for a sampling flag of each kind, given the flag's default.
_FLAG_KINDS: dict[str, Callable[[Any], dict[str, Any]]] = {
    INTEGER: lambda default: {"type": int, "default": default},
    NUMBER: lambda default: {"type": float, "default": default},
    BOOLEAN: lambda default: {"action": argparse.BooleanOptionalAction, "default": default},
    TEXT: lambda default: {"default": default},
    GRAMMAR: lambda default: {"default": default},
    STOP: lambda default: {"action": "append", "default": None},  # repeatable
    TOKEN_IDS: lambda default: {"action": "append", "type": int, "default": None},
    TOKEN_BIAS: lambda default: {"type": json.loads, "default": None},  # as JSON: {"50256": -100}
}


def _add_sampling_args(p: argparse.ArgumentParser, fields: Sequence[SamplingField] = SAMPLING_FIELDS) -> None:
    """A flag for each sampling field declared with one (sampling_params.py): `--top-k`, ..."""
    for spec in fields:
        if spec.flag:
            kind = _FLAG_KINDS[spec.kind](spec.default if spec.flag_default is None else spec.flag_default)
            repeat = " (repeatable)" if kind.get("action") == "append" else ""
            p.add_argument("--" + spec.name.replace("_", "-"), help=spec.help + repeat, **kind)


def sampling_flags(ns: argparse.Namespace, fields: Sequence[SamplingField] = SAMPLING_FIELDS) -> dict[str, Any]:
    """The sampling params the flags give (a flag not given: the field's default)."""
    given = {spec.name: getattr(ns, spec.name) for spec in fields if spec.flag}
    return {name: value for name, value in given.items() if value is not None}


@dataclass(frozen=True)
class Command:
    """One subcommand, registered once: its help, where its flags and its entry point live
    ("module:function", imported when the parser is built or the command runs), whether it also
    takes the engine's flags (ServerArgs; then it runs as run(ns, ServerArgs.from_cli_args(ns))) and
    the name of a dict of flag defaults it overrides ("module:NAME")."""

    name: str  # "serve", or "bench offline" for a benchmark
    help: str
    add_args: Optional[str]
    run: str
    engine_flags: bool = False
    defaults: Optional[str] = None


COMMANDS: tuple[Command, ...] = (
    Command(
        "generate",
        "generate a completion offline and print it",
        "specserve.cli:_add_generate_args",
        "specserve.cli:_generate",
        engine_flags=True,
    ),
    Command(
        "serve",
        "OpenAI-compatible HTTP server (chat, completions, /generate, /metrics)",
        "specserve.cli:_add_serve_args",
        "specserve.cli:_serve",
        engine_flags=True,
        defaults="specserve.cli:SERVE_DEFAULTS",
    ),
    Command(
        "soak",
        "the production-like configuration (TP 2, DSPARK, overlap, checker) for a budget",
        "specserve.bench.soak:add_soak_args",
        "specserve.bench.soak:run_soak",
        engine_flags=True,
        defaults="specserve.bench.soak:SOAK_DEFAULTS",
    ),
    Command(
        "train-drafter",
        "train a DSpark drafter by self-distillation on ShareGPT prompts",
        "specserve.train.run:add_train_args",
        "specserve.train.run:run_train_drafter",
    ),
    Command(
        "drafter-corpus",
        "extend the drafter's training corpus (token-id shards) or show it",
        "specserve.train.corpus_cli:add_corpus_args",
        "specserve.train.corpus_cli:run_drafter_corpus",
    ),
    Command(
        "eval-drafter",
        "a drafter's accept length as served and at every anchor, on the corpus's dev / held-out sets or benchmarks",
        "specserve.train.eval_drafter:add_eval_drafter_args",
        "specserve.train.eval_drafter:run_eval_drafter",
    ),
    Command(
        "init-drafter",
        "write a randomly initialised DSpark drafter for a target model",
        "specserve.cli:_add_init_drafter_args",
        "specserve.cli:_init_drafter",
    ),
    Command(
        "profile-sps",
        "record verify steps/s against batch verify tokens (compact mode)",
        "specserve.bench.profile_sps:add_profile_args",
        "specserve.bench.profile_sps:run_profile_sps",
        engine_flags=True,
    ),
    Command(
        "eval-acceptance",
        "accept length, per-position acceptance and tokens/s on a prompt set",
        "specserve.bench.eval_acceptance:add_eval_args",
        "specserve.bench.eval_acceptance:run_eval_acceptance",
        engine_flags=True,
    ),
    Command(
        "bench offline",
        "decode speed vs Hugging Face transformers on the same GGUF",
        "specserve.bench.offline:add_bench_args",
        "specserve.bench.offline:run_offline_bench",
        engine_flags=True,
    ),
    Command(
        "bench spec",
        "NONE vs NGRAM and DSPARK (fixed) vs the default policy on MT-Bench and HumanEval, with HF peers",
        "specserve.bench.spec:add_spec_bench_args",
        "specserve.bench.spec:run_spec_bench",
        engine_flags=True,
    ),
    Command(
        "bench serving",
        "drive OpenAI-compatible servers at a concurrency sweep and compare",
        "specserve.bench.serving:add_serving_bench_args",
        "specserve.bench.serving:run_serving_bench",
    ),
    Command(
        "bench load",
        "many streaming clients with disconnects, aborts and hostile requests against a live "
        "server: no 5xx, no leaked KV, bounded memory",
        "specserve.bench.load:add_load_bench_args",
        "specserve.bench.load:run_load_bench",
    ),
    Command(
        "bench quality",
        "bf16 against fp32 on the same weights: perplexity and greedy match rate",
        "specserve.bench.quality:add_quality_bench_args",
        "specserve.bench.quality:run_quality_bench",
        engine_flags=True,
    ),
    Command(
        "bench models",
        "every model the engine serves against llama.cpp on the same file: decode, prefill, "
        "batch, resident memory and load time, interleaved runs",
        "specserve.bench.models:add_models_bench_args",
        "specserve.bench.models:run_models_bench",
    ),
    Command(
        "bench stale-accept",
        "the stale-accept race (aliased accept buffers, rank 1 a step late) caught by the "
        "consensus checker, and the same runs with the fix",
        "specserve.bench.stale_accept:add_stale_accept_args",
        "specserve.bench.stale_accept:run_stale_accept_bench",
    ),
    Command(
        "bench seed-failure",
        "deprecated: bench stale-accept (the same run)",
        "specserve.bench.stale_accept:add_stale_accept_args",
        "specserve.bench.stale_accept:run_under_old_name",
    ),
    Command(
        "bench synth-model",
        "a full-size GGUF with a real model's header or a published config's shapes and random "
        "weights (synthetic: for speed only), into the model cache",
        "specserve.bench.synth_model:add_synth_model_args",
        "specserve.bench.synth_model:run_synth_model",
    ),
)
SERVE_DEFAULTS = {"log_level": "info"}  # the start-up block and the ready line


def _resolve(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def build_parser(
    commands: Sequence[Command] = (), prog: str = "specserve", description: str = "", only: Optional[str] = None
) -> argparse.ArgumentParser:
    """The parser of `commands` (default: specserve's own); "bench NAME" commands go under `bench`.
    With `only`, the other commands are listed by name and help but their flags are not built:
    building them imports their modules (torch among them), a second of `specserve serve`'s start."""
    commands = commands or COMMANDS
    parser = _Parser(prog=prog, description=description or __doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    if any(c.name.startswith("bench ") for c in commands):
        bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    for command in commands:
        group, _, name = command.name.rpartition(" ")
        p = (bench if group == "bench" else sub).add_parser(name, help=command.help)
        if only is not None and command.name != only:
            continue
        if command.add_args:
            _resolve(command.add_args)(p)
        if command.engine_flags:
            ServerArgs.add_cli_args(p)
        if command.defaults:
            p.set_defaults(**_resolve(command.defaults))
    return parser


def named_command(argv: Sequence[str], commands: Sequence[Command] = ()) -> Optional[str]:
    """The command `argv` names ("serve", "bench offline"), or None when it names none."""
    words = [a for a in argv if not a.startswith("-")][:2]
    name = " ".join(words) if words[:1] == ["bench"] else " ".join(words[:1])
    return name if any(c.name == name for c in commands or COMMANDS) else None


def find_command(ns: argparse.Namespace, commands: Sequence[Command] = ()) -> Command:
    name = f"bench {ns.bench_command}" if ns.command == "bench" else ns.command
    return next(c for c in commands or COMMANDS if c.name == name)


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print the whole output dict as JSON")
    _add_sampling_args(p)


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    from specserve.server.launch import add_serve_args
    from specserve.server.replicas import add_data_parallel_args

    add_serve_args(p)
    add_data_parallel_args(p)


def _serve(ns: argparse.Namespace, args: ServerArgs) -> int:
    from specserve.server.launch import run_server
    from specserve.server.replicas import check_data_parallel_args, run_data_parallel

    check_data_parallel_args(ns, args)
    return run_data_parallel(ns, args) if ns.dp_size > 1 else run_server(ns, args)


def _add_init_drafter_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="directory to write config.json and model.safetensors to")
    p.add_argument("--model-path", default=None, help="target model (default: the embedded one)")
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--block-size", type=int, default=5, help="gamma: drafts per step")
    p.add_argument("--markov-rank", type=int, default=64)
    p.add_argument("--num-context-layers", type=int, default=3, help="target layers feeding the drafter")
    p.add_argument("--mask-token-id", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)


def _generate(ns: argparse.Namespace, args: ServerArgs) -> int:
    params = sampling_flags(ns)
    SamplingParams.from_dict(params)  # fail fast, before the model (and torch) loads
    from specserve.engine import Engine

    with Engine(**vars(args)) as engine:
        if ns.chat:
            ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": ns.prompt}])
            out = engine.generate(input_ids=ids, sampling_params=params)
        else:
            out = engine.generate(ns.prompt, sampling_params=params)
    print(json.dumps(out, indent=2) if ns.json else out["text"])
    return 0


def _init_drafter(ns: argparse.Namespace) -> int:
    from specserve.args_checks import MAX_DRAFT_TOKENS
    from specserve.models.dspark import DsparkConfig
    from specserve.models.dspark_checkpoint import init_drafter, save_drafter
    from specserve.models.loader import load_model_config

    if not 1 <= ns.block_size <= MAX_DRAFT_TOKENS:
        raise ConfigError(f"--block-size must be in [1, {MAX_DRAFT_TOKENS}], got {ns.block_size}")
    if ns.num_layers < 1 or ns.markov_rank < 1 or ns.num_context_layers < 1:
        raise ConfigError("--num-layers, --markov-rank and --num-context-layers must be >= 1")
    target = load_model_config(ns.model_path)
    cfg = DsparkConfig.for_target(
        target, ns.num_layers, ns.block_size, ns.markov_rank, ns.num_context_layers, ns.mask_token_id
    )
    cfg.extra = {"init": "random", "seed": ns.seed, "target": ns.model_path or "default"}
    cfg.validate_for(target)
    save_drafter(ns.out, cfg, init_drafter(cfg, ns.seed))
    print(f"wrote a random DSpark drafter ({cfg.num_layers} layer(s), block {cfg.block_size}) to {ns.out}")
    return 0


def main(
    argv: Optional[Sequence[str]] = None, commands: Sequence[Command] = (), prog: str = "specserve", description: str = ""
) -> int:
    """Run one command of `commands` (default: specserve's own; benchmarks/ passes its experiments)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(commands, prog, description, only=named_command(argv, commands))
    ns, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the subcommand they were given to, like every other error
        print(f"{_prog(ns, prog)}: error: unrecognized arguments: {' '.join(unknown)}", file=sys.stderr)
        return 2
    # Two kinds of failure: a bad flag, setting or file (ConfigError; a bad sampling flag is an
    # InvalidRequestError) is argparse's one line and exit 2, before or after the model loads;
    # anything else during the run is a failure with its traceback and a non-zero exit.
    try:
        check_flag_bounds(ns)
        command = find_command(ns, commands)
        run = _resolve(command.run)
        return run(ns, ServerArgs.from_cli_args(ns)) if command.engine_flags else run(ns)
    except (ConfigError, InvalidRequestError) as exc:
        print(f"{_prog(ns, prog)}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
