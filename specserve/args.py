"""ServerArgs: the single source of CLI flags, Engine keywords and their defaults."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from specserve.errors import ConfigError
from specserve.names import DRAFTERS, LOOKUP_DRAFTERS, MODEL_DRAFTERS, Algorithm
from specserve.paths import check_writable_dir

SCHEDULE_POLICIES = ("fcfs", "lpm", "shortest-prefill-first")
DTYPES = ("auto", "float32", "bfloat16")
CPU_ACTIVATIONS = ("auto", "bf16", "int8")  # auto: resolved per model file when the engine builds (models/int8_gate.py)
MAX_DRAFT_TOKENS = 15
DEFAULT_BLOCK_SIZE = 5
SPEC_ALGORITHMS = (None, *Algorithm)
VERIFY_MODES = ("static", "compact")
SPEC_POLICIES = ("adaptive", "fixed")
VERIFY_MODE_ENV = "SPECSERVE_RAGGED_VERIFY_MODE"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DEFAULT_STORAGE_MAX_BYTES = 4 << 30
MAX_SEED = 2**64 - 1


def flag(default: Any, help: str, **metadata: Any) -> Any:
    """A ServerArgs field: its default, the CLI help and the rest of its argparse metadata (choices)."""
    return field(default=default, metadata={"help": help, **metadata})


@dataclass(frozen=True)
class ServerArgs:
    """Every engine setting. CLI flag `--foo-bar` is field `foo_bar`; Engine keywords use the same names."""

    model_path: Optional[str] = flag(None, "GGUF file or HF llama/qwen2 directory (default: the embedded SmolLM2-135M)")
    tokenizer_path: Optional[str] = flag(None, "tokenizer.json directory or GGUF file (default: from the model)")
    chat_template: Optional[str] = flag(None, "Jinja chat template file, in place of the model's own (or for one without)")
    dtype: str = flag("auto", "float32 | bfloat16 | auto (bfloat16 on CPU)", choices=DTYPES)
    quantization: str = flag(
        "auto",
        "auto: serve GGUF Q4_0/Q4_1 weights as 4-bit on CPU in bfloat16; none: dequantize to --dtype",
        choices=("auto", "none"),
    )
    weight_cache: str = flag("auto", "packed weights (and the cost prior) kept for the next start: auto, off or a folder")
    cpu_activations: str = flag(
        "auto",
        "activations of the CPU kernels' quantized linears: int8 (rows quantized per 32 columns, integer dot products, "
        "as llama.cpp computes), bf16, or auto: int8 on the model files `bench quality --record` passed, else bf16",
        choices=CPU_ACTIVATIONS,
    )
    device: str = flag("cpu", "cpu or cuda")
    context_length: Optional[int] = flag(None, "override the model's context window")
    mem_fraction_static: Optional[float] = flag(None, "KV pool's share of RAM (default: what the model leaves, at most 0.1)")
    max_total_tokens: Optional[int] = flag(None, "KV pool size in tokens (overrides --mem-fraction-static)")
    max_running_requests: int = flag(64, "most requests decoding at once")
    chunked_prefill_size: int = flag(2048, "most prompt tokens in one prefill step; <=0 disables chunking")
    max_prefill_tokens: int = flag(8192, "most new tokens admitted into one prefill batch")
    schedule_policy: str = flag("fcfs", "order of the waiting queue", choices=SCHEDULE_POLICIES)
    disable_radix_cache: bool = flag(False, "turn prefix sharing off")
    speculative_algorithm: Optional[str] = flag(
        None,
        "DSPARK (block drafter; the embedded model's default, with its shipped drafter), NGRAM (prompt "
        "lookup; the default for any other model, beside SUFFIX), SUFFIX (suffix matches over the request and "
        "past outputs), STANDALONE (a draft model) or NONE (no speculation)",
        choices=SPEC_ALGORITHMS,
    )
    speculative_dspark_block_size: Optional[int] = flag(
        None, "drafts per step (gamma); the verify window is gamma + 1 (default: the drafter checkpoint's, else 5)"
    )
    speculative_draft_model_path: Optional[str] = flag(
        None,
        "DSPARK: the drafter directory (config.json + model.safetensors, from `specserve train-drafter`; default "
        "for the embedded model: the shipped one); STANDALONE: a model (GGUF) with the target's vocabulary",
    )
    speculative_draft_weights: str = flag(
        "q8", "the DSpark drafter's linears and reduced head on CPU: q8 (ggml Q8_0 codes), or bf16", choices=("bf16", "q8")
    )
    speculative_dspark_verify_mode: Optional[str] = flag(
        None,
        "with --speculative-policy fixed: static verifies every window row; compact: per-request verify "
        "lengths from the budget planner (default: $SPECSERVE_RAGGED_VERIFY_MODE, else static)",
        choices=(None,) + VERIFY_MODES,
    )
    speculative_dspark_sps_table_path: Optional[str] = flag(
        None,
        "JSON table of verify steps/s against batch verify tokens (`specserve profile-sps`): the compact "
        "planner's, or the adaptive policy's starting cost of the target's rows",
    )
    speculative_policy: str = flag(
        "adaptive",
        "adaptive: each step, every request gets the drafter and the number of drafts (0..gamma) that "
        "maximise the batch's expected tokens per second under a step-cost model the engine measures itself; "
        "fixed: every request drafts gamma tokens with --speculative-algorithm's drafter",
        choices=SPEC_POLICIES,
    )
    speculative_policy_drafters: Optional[str] = flag(
        None, "drafters the adaptive policy chooses from (default: DSPARK,NGRAM,SUFFIX with DSPARK; else NGRAM,SUFFIX)"
    )
    speculative_suffix_max_tree_depth: int = flag(24, "SUFFIX: the longest suffix of the context matched (>= 2)")
    speculative_suffix_max_spec_factor: float = flag(1.0, "SUFFIX: at most this many drafts per matched token")
    speculative_suffix_min_token_prob: float = flag(0.1, "SUFFIX: a draft's least share of the matched occurrences")
    speculative_suffix_cache_tokens: int = flag(1 << 20, "SUFFIX: finished outputs' tokens kept, oldest evicted first")
    speculative_cost_table_path: Optional[str] = flag(
        None, "JSON step-cost table to start the adaptive policy from instead of the start-up warm-up (StepCostModel.save)"
    )
    speculative_freeze_cost_table: bool = flag(
        False, "never update the step-cost table after start-up, so that runs, loop modes and ranks make identical decisions"
    )
    speculative_min_gain: float = flag(
        0.05, "draft only where the policy predicts this fraction more tokens/s than plain decoding (its error margin)"
    )
    speculative_disable_closed_batch_pricing: bool = flag(
        False, "price drafts in Engine.generate's closed batches as when serving (default: by the row a draft saves)"
    )
    speculative_explore_interval: int = flag(64, "a request tries a drafter unused for this many of its steps (0: never)")
    speculative_disable_batch_size: Optional[int] = flag(
        None,
        "override: decode steps with more running requests than this run without drafts; 0: never speculate "
        "in decode; empty (default): the policy decides",
    )
    disable_overlap_schedule: bool = flag(
        False, "run the normal loop (schedule, run, process) instead of overlapping step N with processing step N-1"
    )
    disable_cuda_graph: bool = flag(
        False, "run decode and verify eagerly instead of as captured steps (CUDA graphs on CUDA, static-buffer steps on CPU)"
    )
    cuda_graph_max_bs: int = flag(32, "largest batch run as a captured step; larger batches run eagerly")
    enable_torch_compile: bool = flag(
        False,
        "torch.compile the captured steps on CPU with stock PyTorch matmuls instead of specserve's kernels: "
        "slower here, and bf16 output is then NOT batch-invariant (opt-in, off by default)",
    )
    random_seed: int = flag(0, "seed for requests that give none")
    num_threads: Optional[int] = flag(None, "torch intra-op threads (default: torch's choice)")
    log_level: str = flag("warning", "logging level")
    enable_hierarchical_cache: bool = flag(
        False, "HiCache: keep evicted prefix-cache KV in a host-memory pool and load it back on a hit"
    )
    hicache_ratio: float = flag(2.0, "host pool size as a multiple of the device KV pool")
    hicache_size: Optional[int] = flag(None, "host pool size in tokens (overrides --hicache-ratio)")
    hicache_write_policy: str = flag(
        "write_through",
        "when nodes are copied to the host",
        choices=("write_through", "write_through_selective", "write_back"),
    )
    hicache_storage_backend: Optional[str] = flag(
        None,
        "file: also keep full 64-token pages in --hicache-storage-dir (survives restarts; a corrupt file is a miss)",
        choices=(None, "file"),
    )
    hicache_storage_dir: Optional[str] = flag(None, "directory of the file tier (created 0700, pages 0600)")
    hicache_storage_max_bytes: int = flag(
        DEFAULT_STORAGE_MAX_BYTES,
        "cap on the file tier's pages in bytes (split between TP ranks); least recently used pages are deleted past it",
    )
    tp_size: int = flag(1, "tensor-parallel ranks (one scheduler process per rank, SPMD)")
    dist_init_addr: Optional[str] = flag(
        None, "host:port of the rank-0 rendezvous (default: 127.0.0.1 and a free port; required with --nnodes > 1)"
    )
    nnodes: int = flag(1, "nodes sharing the tensor-parallel ranks (tp_size / nnodes ranks per node)")
    node_rank: int = flag(0, "this node's index; node 0 hosts rank 0 and the front end")
    collective_timeout: float = flag(60.0, "seconds any cross-rank collective may wait before the rank fails loudly")

    def __post_init__(self) -> None:
        self._default_speculation()
        validate_server_args(self)

    def _default_speculation(self) -> None:
        """Unless told otherwise, speculate under the adaptive policy (which drafts only where it
        pays): the embedded model with its shipped DSpark drafter (and NGRAM), any other model
        with NGRAM, since no drafter ships for it."""
        if self.speculative_algorithm not in (None, Algorithm.DSPARK):
            return
        if self.model_path is not None:
            if self.speculative_algorithm is None and self.speculative_draft_model_path is None:
                object.__setattr__(self, "speculative_algorithm", Algorithm.NGRAM)  # frozen: set once, here
                if self.speculative_policy_drafters is None:  # both lookups, the policy choosing per request
                    object.__setattr__(self, "speculative_policy_drafters", ",".join(LOOKUP_DRAFTERS))
            return
        from specserve.assets import default_drafter_path

        path = self.speculative_draft_model_path or default_drafter_path()
        if path is not None:
            object.__setattr__(self, "speculative_algorithm", Algorithm.DSPARK)
            object.__setattr__(self, "speculative_draft_model_path", path)

    @property
    def speculating(self) -> bool:
        return self.speculative_algorithm not in (None, Algorithm.NONE)

    def policy_drafters(self) -> tuple[str, ...]:
        """The drafters the adaptive policy chooses from."""
        if self.speculative_policy_drafters:
            return tuple(d.strip().upper() for d in self.speculative_policy_drafters.split(",") if d.strip())
        assert self.speculative_algorithm is not None, "asked only while speculating"
        if self.speculative_algorithm in MODEL_DRAFTERS:  # the model drafter, and the lookups beside it
            return (self.speculative_algorithm, *LOOKUP_DRAFTERS)
        return (self.speculative_algorithm,)

    def verify_mode(self) -> str:
        """The flag, else $SPECSERVE_RAGGED_VERIFY_MODE, else static."""
        mode = self.speculative_dspark_verify_mode or os.environ.get(VERIFY_MODE_ENV) or "static"
        if mode not in VERIFY_MODES:
            raise ConfigError(f"{VERIFY_MODE_ENV} must be one of {VERIFY_MODES}, got {mode!r}")
        return mode

    def replace(self, **changes: Any) -> "ServerArgs":
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "ServerArgs":
        unknown = sorted(set(kwargs) - cls.field_names())
        if unknown:
            raise ConfigError(f"unknown engine argument(s) {unknown}; known: {sorted(cls.field_names())}")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            meta = dict(f.metadata)
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", default=f.default, help=meta.get("help"))
                continue
            kind = _cli_type(f.type)
            parser.add_argument(flag, type=kind, default=f.default, help=meta.get("help"), choices=meta.get("choices"))

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "ServerArgs":
        return cls(**{name: getattr(ns, name) for name in cls.field_names()})


def _cli_type(annotation: Any) -> type:
    text = str(annotation)
    return int if "int" in text else float if "float" in text else str


def validate_server_args(args: ServerArgs) -> None:
    """Raise ValueError naming the field and its allowed range (one line: the CLI prints it as is)."""
    _check_types(args)
    _check_choices(args)
    _check_sizes(args)
    _check_speculative(args)
    if args.chat_template is not None and not os.path.isfile(args.chat_template):
        raise ConfigError(f"chat_template: {args.chat_template!r} is not a file")
    _check_hicache(args)
    _check_distributed(args)


def _check_types(args: ServerArgs) -> None:
    """Every field holds its annotated type: a wrong type fails here, not deep inside a step."""
    for f in dataclasses.fields(args):
        value, text = getattr(args, f.name), str(f.type)
        if value is None and "Optional" in text:
            continue
        if text == "bool":
            ok, kind = isinstance(value, bool), "true or false"
        elif "int" in text:
            ok, kind = isinstance(value, int) and not isinstance(value, bool), "an integer"
        elif "float" in text:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            kind = "a finite number"
        else:
            ok, kind = isinstance(value, str), "a string"
        if not ok:
            raise ConfigError(f"{f.name} must be {kind}, got {value!r}")


def _check_choices(args: ServerArgs) -> None:
    if args.dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {DTYPES}, got {args.dtype!r}")
    if args.cpu_activations not in CPU_ACTIVATIONS:
        raise ConfigError(f"cpu_activations must be one of {CPU_ACTIVATIONS}, got {args.cpu_activations!r}")
    if args.quantization not in ("auto", "none"):
        raise ConfigError(f"quantization must be 'auto' or 'none', got {args.quantization!r}")
    if args.schedule_policy not in SCHEDULE_POLICIES:
        raise ConfigError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {args.schedule_policy!r}")
    if args.log_level.lower() not in LOG_LEVELS:
        raise ConfigError(f"log_level must be one of {LOG_LEVELS}, got {args.log_level!r}")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {args.device!r}")


def _at_least(name: str, value: Optional[int | float], low: int | float) -> None:
    if value is not None and value < low:
        raise ConfigError(f"{name} must be >= {low}, got {value}")


def _check_sizes(args: ServerArgs) -> None:
    if args.mem_fraction_static is not None and not 0.0 < args.mem_fraction_static <= 0.95:
        raise ConfigError(f"mem_fraction_static must be in (0, 0.95], got {args.mem_fraction_static}")
    _at_least("max_total_tokens", args.max_total_tokens, 16)
    _at_least("max_running_requests", args.max_running_requests, 1)
    _at_least("cuda_graph_max_bs", args.cuda_graph_max_bs, 1)
    _at_least("max_prefill_tokens", args.max_prefill_tokens, 1)
    _at_least("context_length", args.context_length, 2)
    _at_least("num_threads", args.num_threads, 1)
    if not 0 <= args.random_seed <= MAX_SEED:
        raise ConfigError(f"random_seed must be in [0, 2^64), got {args.random_seed}")


def _check_speculative(args: ServerArgs) -> None:
    if args.speculative_algorithm not in SPEC_ALGORITHMS:
        raise ConfigError(
            f"speculative_algorithm must be one of {', '.join(map(str, DRAFTERS))}, NONE, got {args.speculative_algorithm!r}"
        )
    _at_least("speculative_suffix_max_tree_depth", args.speculative_suffix_max_tree_depth, 2)
    _at_least("speculative_suffix_cache_tokens", args.speculative_suffix_cache_tokens, 0)
    if not (args.speculative_suffix_max_spec_factor > 0 and 0 <= args.speculative_suffix_min_token_prob <= 1):
        raise ConfigError("speculative_suffix_max_spec_factor must be > 0 and speculative_suffix_min_token_prob in [0, 1]")
    gamma = args.speculative_dspark_block_size
    if gamma is not None and not 1 <= gamma <= MAX_DRAFT_TOKENS:
        raise ConfigError(f"speculative_dspark_block_size must be in [1, {MAX_DRAFT_TOKENS}], got {gamma}")
    if args.speculative_algorithm == Algorithm.DSPARK and not args.speculative_draft_model_path:
        raise ConfigError(
            "speculative_draft_model_path: DSPARK needs a drafter directory "
            "(make a random one with `specserve init-drafter --out DIR`)"
        )
    if args.speculative_algorithm == Algorithm.STANDALONE and not args.speculative_draft_model_path:
        raise ConfigError("speculative_draft_model_path: STANDALONE needs a GGUF with the target's vocabulary")
    if args.speculative_dspark_verify_mode not in (None,) + VERIFY_MODES:
        raise ConfigError(
            f"speculative_dspark_verify_mode must be one of {VERIFY_MODES}, got {args.speculative_dspark_verify_mode!r}"
        )
    _at_least("speculative_disable_batch_size", args.speculative_disable_batch_size, 0)
    _at_least("speculative_explore_interval", args.speculative_explore_interval, 0)
    if not 0.0 <= args.speculative_min_gain <= 1.0:
        raise ConfigError(f"speculative_min_gain must be in [0, 1], got {args.speculative_min_gain}")
    if args.speculative_policy not in SPEC_POLICIES:
        raise ConfigError(f"speculative_policy must be one of {SPEC_POLICIES}, got {args.speculative_policy!r}")
    if args.speculating and args.speculative_policy == "adaptive":
        if args.speculative_dspark_verify_mode == "compact":
            raise ConfigError(
                "speculative_dspark_verify_mode compact: the compact planner runs with --speculative-policy "
                "fixed; the adaptive policy chooses every window's length itself"
            )
        unknown = set(args.policy_drafters()) - set(DRAFTERS)
        if unknown or not args.policy_drafters():
            raise ConfigError(
                f"speculative_policy_drafters: a comma-separated subset of {','.join(DRAFTERS)}, got "
                f"{args.speculative_policy_drafters!r}"
            )
        for name in sorted(set(MODEL_DRAFTERS) & set(args.policy_drafters()) - {args.speculative_algorithm}):
            raise ConfigError(f"speculative_policy_drafters: {name} needs --speculative-algorithm {name} (its model)")


def _check_hicache(args: ServerArgs) -> None:
    _at_least("hicache_storage_max_bytes", args.hicache_storage_max_bytes, 1)
    if args.hicache_storage_backend not in (None, "file"):
        raise ConfigError(f"hicache_storage_backend must be 'file', got {args.hicache_storage_backend!r}")
    if not args.enable_hierarchical_cache:
        if args.hicache_storage_backend:
            raise ConfigError("hicache_storage_backend: the file tier needs --enable-hierarchical-cache")
        return
    if args.disable_radix_cache:
        raise ConfigError("enable_hierarchical_cache: needs the radix cache (drop --disable-radix-cache)")
    if args.hicache_ratio <= 0 or (args.hicache_size is not None and args.hicache_size < 1):
        raise ConfigError("hicache_ratio must be > 0 and hicache_size >= 1")
    if args.hicache_write_policy not in ("write_through", "write_through_selective", "write_back"):
        raise ConfigError(f"hicache_write_policy: unknown policy {args.hicache_write_policy!r}")
    if args.hicache_storage_backend == "file":
        if not args.hicache_storage_dir:
            raise ConfigError("hicache_storage_dir: required with --hicache-storage-backend file")
        check_writable_dir("hicache_storage_dir", args.hicache_storage_dir)


def _check_distributed(args: ServerArgs) -> None:
    _at_least("tp_size", args.tp_size, 1)
    if args.nnodes < 1 or args.tp_size % args.nnodes:
        raise ConfigError(f"nnodes must be >= 1 and divide tp_size={args.tp_size}, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(f"node_rank must be in [0, {args.nnodes}), got {args.node_rank}")
    if args.nnodes > 1 and not args.dist_init_addr:
        raise ConfigError("dist_init_addr: required with nnodes > 1 (host:port of node 0)")
    if args.dist_init_addr is not None:
        host, _, port = args.dist_init_addr.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ConfigError(f"dist_init_addr must be host:port with a port in [1, 65535], got {args.dist_init_addr!r}")
    if args.collective_timeout <= 0:
        raise ConfigError(f"collective_timeout must be > 0 seconds, got {args.collective_timeout}")


def number_list(flag: str, text: str, kind: type = int) -> list:
    """A comma-separated flag value as numbers (empty parts skipped); a ConfigError naming the flag otherwise."""
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated {kind.__name__} values, got {text!r}") from None
