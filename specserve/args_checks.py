"""ServerArgs' checks: each field's type, choice and range, one precise line per bad value (the
CLI prints it as is; the server answers it as a 4xx where a request carries the setting)."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Optional

from specserve import drafters
from specserve.drafters import suffix
from specserve.errors import ConfigError
from specserve.names import Algorithm
from specserve.paths import check_writable_dir

# The checks take ServerArgs as Any: this module sits below args.py (which imports its choices), and
# the layering test counts a TYPE_CHECKING import as an arrow back up. tests/unit/test_args.py
# covers every field the checks read.
ServerArgs = Any

SCHEDULE_POLICIES = ("fcfs", "lpm", "shortest-prefill-first")
DTYPES = ("auto", "float32", "bfloat16")
CPU_ACTIVATIONS = ("auto", "bf16", "int8")  # auto: resolved by weight type when the engine builds (models/activations.py)
MAX_DRAFT_TOKENS = 15
DEFAULT_BLOCK_SIZE = 5  # every drafter's window when --speculative-num-steps is unset
# The draft length's spellings, each with the tokens it counts beyond the drafts (the anchor: SGLang's).
DRAFT_LENGTH_FLAGS = {"speculative_num_steps": 0, "speculative_num_draft_tokens": 1, "speculative_dspark_block_size": 0}
SPEC_ALGORITHMS = (None, Algorithm.NONE, *drafters.names())  # argparse's choices: the drafters built in
VERIFY_MODES = ("static", "compact")
SUFFIX_SCOPES = suffix.SCOPES  # args.py's choices: the SUFFIX declaration's
SPEC_POLICIES = ("adaptive", "fixed")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MAX_SEED = 2**64 - 1


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
    _at_least("weight_cache_max_gib", args.weight_cache_max_gib, 0)
    if not 0 <= args.random_seed <= MAX_SEED:
        raise ConfigError(f"random_seed must be in [0, 2^64), got {args.random_seed}")


def _check_speculative(args: ServerArgs) -> None:
    algorithm = args.speculative_algorithm
    if algorithm not in (None, Algorithm.NONE) and not drafters.known(algorithm):
        raise ConfigError(f"speculative_algorithm must be one of {', '.join(drafters.names())}, NONE, got {algorithm!r}")
    for name in drafters.names():  # every drafter's own flags, used or not: a bad value is a typo either way
        check = drafters.get(name).check
        if check is not None:
            check(args)
    _check_draft_length(args)
    declared = drafters.of(algorithm)
    if declared is not None and declared.draft_model is not None and not args.speculative_draft_model_path:
        raise ConfigError(f"speculative_draft_model_path: {algorithm} needs {declared.draft_model}")
    if args.speculative_verify_mode not in (None,) + VERIFY_MODES:
        raise ConfigError(f"speculative_verify_mode must be one of {VERIFY_MODES}, got {args.speculative_verify_mode!r}")
    _at_least("speculative_disable_batch_size", args.speculative_disable_batch_size, 0)
    _at_least("speculative_explore_interval", args.speculative_explore_interval, 0)
    if not 0.0 <= args.speculative_min_gain <= 1.0:
        raise ConfigError(f"speculative_min_gain must be in [0, 1], got {args.speculative_min_gain}")
    if args.speculative_policy not in SPEC_POLICIES:
        raise ConfigError(f"speculative_policy must be one of {SPEC_POLICIES}, got {args.speculative_policy!r}")
    if args.speculating and args.speculative_policy == "adaptive":
        _check_policy_drafters(args)


def _check_draft_length(args: ServerArgs) -> None:
    """Each spelling of the draft length in range, and those given agreeing (in drafts per window)."""
    steps = {}
    for name, extra in DRAFT_LENGTH_FLAGS.items():
        value = getattr(args, name)
        if value is None:
            continue
        if not 1 + extra <= value <= MAX_DRAFT_TOKENS + extra:
            raise ConfigError(f"{name} must be in [{1 + extra}, {MAX_DRAFT_TOKENS + extra}], got {value}")
        steps[name] = value - extra
    if len(set(steps.values())) > 1:
        given = ", ".join(f"{name}={getattr(args, name)}" for name in steps)
        raise ConfigError(f"{given}: these give different draft lengths (num_draft_tokens counts the anchor: steps + 1)")


def _check_policy_drafters(args: ServerArgs) -> None:
    if args.speculative_verify_mode == "compact":
        raise ConfigError(
            "speculative_verify_mode compact: the compact planner runs with --speculative-policy "
            "fixed; the adaptive policy chooses every window's length itself"
        )
    chosen = args.policy_drafters()
    if not chosen or not all(drafters.known(name) for name in chosen):
        raise ConfigError(
            f"speculative_policy_drafters: a comma-separated subset of {','.join(drafters.names())}, got "
            f"{args.speculative_policy_drafters!r}"
        )
    for name in sorted(chosen):
        if drafters.get(name).runs_a_model and name != args.speculative_algorithm:
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
