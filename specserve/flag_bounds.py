"""The ranges of the subcommands' own numeric flags, checked before a command runs (ServerArgs
checks its fields itself)."""

from __future__ import annotations

import argparse
from typing import Callable

from specserve.args_checks import MAX_DRAFT_TOKENS, MAX_SEED
from specserve.errors import ConfigError
from specserve.server.heartbeat import HEARTBEAT_S

# The subcommands' own numeric flags: flag -> (allowed, check). ServerArgs checks its fields itself.
# A flag a command lacks is skipped, so each bound must hold for every command that has the flag.
_AT_LEAST_0 = (">= 0", lambda v: v >= 0)
_AT_LEAST_1 = (">= 1", lambda v: v >= 1)
_POSITIVE = ("> 0", lambda v: v > 0)
FLAG_BOUNDS: dict[str, tuple[str, Callable[[float], bool]]] = {
    "seed": ("in [0, 2^64)", lambda v: 0 <= v <= MAX_SEED),
    "temperature": _AT_LEAST_0,
    "max_new_tokens": _AT_LEAST_0,
    "new_tokens": _AT_LEAST_1,
    "max_tokens": _AT_LEAST_1,
    "batch_size": _AT_LEAST_1,
    "num_prompts": _AT_LEAST_0,
    "num_texts": _AT_LEAST_1,
    "prefill_len": _AT_LEAST_1,
    "hf_prompts": _AT_LEAST_0,
    "num_questions": _AT_LEAST_1,
    "answer_tokens": _AT_LEAST_1,
    "device_tokens": (">= 16", lambda v: v >= 16),
    "repeats": _AT_LEAST_1,
    "prefix_len": _AT_LEAST_0,
    "window": (f"in [1, {MAX_DRAFT_TOKENS + 1}]", lambda v: 1 <= v <= MAX_DRAFT_TOKENS + 1),
    "wave": _AT_LEAST_1,
    "small_new_tokens": _AT_LEAST_1,
    "large_new_tokens": _AT_LEAST_1,
    "copy_delay_ms": _AT_LEAST_0,
    "forward_delay_ms": _AT_LEAST_0,
    "copy_lag_ms": _AT_LEAST_0,
    "max_minutes": _POSITIVE,
    "random_input_words": _AT_LEAST_1,
    "runs": _AT_LEAST_1,
    "clean_tokens": _AT_LEAST_1,
    "request_rate": _POSITIVE,
    "warmup": _AT_LEAST_0,
    "timeout": _POSITIVE,
    "topk": _AT_LEAST_1,
    "num_layers": _AT_LEAST_1,
    "markov_rank": _AT_LEAST_1,
    "num_context_layers": _AT_LEAST_1,
    "block_size": (f"in [1, {MAX_DRAFT_TOKENS}]", lambda v: 1 <= v <= MAX_DRAFT_TOKENS),
    "mask_token_id": _AT_LEAST_0,
    "draft_vocab_size": _AT_LEAST_0,
    "steps": _AT_LEAST_1,
    "seqs_per_step": _AT_LEAST_1,
    "anchors_per_seq": _AT_LEAST_0,
    "lr": _POSITIVE,
    "checkpoint_every": _AT_LEAST_1,
    "held_out": _AT_LEAST_0,
    # serve
    "port": ("in [1, 65535]", lambda v: 1 <= v <= 65535),
    "max_queued_requests": _AT_LEAST_1,
    "max_request_bytes": _AT_LEAST_1,
    "shutdown_timeout": _AT_LEAST_0,
    "engine_step_timeout": _POSITIVE,
    "engine_heartbeat_timeout": (f"> {HEARTBEAT_S:g} (the heartbeat interval)", lambda v: v > HEARTBEAT_S),
    "dp_size": _AT_LEAST_1,
    "num_conversations": _AT_LEAST_1,
    "concurrency": _AT_LEAST_1,
    "first_tokens": _AT_LEAST_1,
    "second_tokens": _AT_LEAST_1,
    "router_health_check_interval": _AT_LEAST_1,
    "replica_unhealthy_timeout": _POSITIVE,
    # bench load
    "minutes": _POSITIVE,
    "clients": _AT_LEAST_1,
    "rss_baseline_s": _AT_LEAST_0,
    "max_rss_growth": _POSITIVE,
    "hostile_share": _AT_LEAST_0,
    "disconnect_share": _AT_LEAST_0,
    "abort_share": _AT_LEAST_0,
}


def check_flag_bounds(ns: argparse.Namespace) -> None:
    """Raise ConfigError naming the first subcommand flag outside its range (see FLAG_BOUNDS)."""
    for dest, (allowed, ok) in FLAG_BOUNDS.items():
        value = getattr(ns, dest, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not ok(value):
            raise ConfigError(f"--{dest.replace('_', '-')} must be {allowed}, got {value}")
