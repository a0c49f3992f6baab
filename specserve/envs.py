"""Typed SPECSERVE_* environment switches, read when a component is built (never at import)."""

from __future__ import annotations

import math
import os
from typing import Optional

from specserve.errors import ConfigError


def env_flag(name: str) -> bool:
    """A boolean switch: 1/true/yes/on (any case) is on; unset, empty or 0/false/no/off is off."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(f"{name} must be 0 or 1, got {os.environ[name]!r}")


def env_int(name: str, default: int = 0, minimum: int = 0) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


def env_optional_float(name: str, minimum: float = 0.0) -> Optional[float]:
    """A finite number >= minimum; None when unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {raw!r}") from None
    if not math.isfinite(value) or value < minimum:
        raise ConfigError(f"{name} must be a finite number >= {minimum:g}, got {raw!r}")
    return value


def env_optional_int(name: str) -> Optional[int]:
    raw = os.environ.get(name, "").strip()
    return env_int(name) if raw else None


def env_int_set(name: str) -> Optional[frozenset[int]]:
    """A comma-separated set of non-negative integers ("1", "0,2"); None when unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        values = frozenset(int(part) for part in raw.split(","))
    except ValueError:
        raise ConfigError(f"{name} must be comma-separated integers, got {raw!r}") from None
    if any(v < 0 for v in values):
        raise ConfigError(f"{name} must list ranks >= 0, got {raw!r}")
    return values


STREAM_SANITIZER = "SPECSERVE_STREAM_SANITIZER"
HOST_WAITS = "SPECSERVE_HOST_WAITS"  # "count" or "error": the host-wait detector inside launch (runtime/host_waits.py)
FAULT_COPY_DELAY_MS = "SPECSERVE_FAULT_COPY_DELAY_MS"
FAULT_FORWARD_DELAY_MS = "SPECSERVE_FAULT_FORWARD_DELAY_MS"
FAULT_COPY_LAG_MS = "SPECSERVE_FAULT_COPY_LAG_MS"
FAULT_COPY_LAG_RANKS = "SPECSERVE_FAULT_COPY_LAG_RANKS"  # "1" or "0,2": the ranks that lag (unset: all)
FAULT_SEED = "SPECSERVE_FAULT_SEED"
FAULT_ALIAS_ACCEPT_BUFFERS = "SPECSERVE_FAULT_ALIAS_ACCEPT_BUFFERS"
RANK_CONSENSUS_CHECKER = "SPECSERVE_ENABLE_RANK_CONSENSUS_CHECKER"
# 1: the CPU kernels run each decoder layer, and the DSpark drafter's pass, op by op from Python, not as
# native calls (A/B, tests)
PER_OP_LAYERS = "SPECSERVE_PER_OP_LAYERS"
FAULT_DIVERGE_SITE = "SPECSERVE_FAULT_DIVERGE_SITE"  # test hook "SITE:RANK": that rank records a wrong event there
FAULT_SKIP_COLLECTIVE = "SPECSERVE_FAULT_SKIP_COLLECTIVE"  # test hook "SITE:RANK": that rank never arrives there
CPU_KERNEL_PATH = "SPECSERVE_CPU_KERNEL_PATH"  # force a CPU kernel path: generic or avx512_bf16
KERNEL_CACHE_DIR = "SPECSERVE_KERNEL_CACHE_DIR"  # where the C++ kernels are built (default ~/.cache/specserve)
WEIGHT_CACHE_DIR = "SPECSERVE_WEIGHT_CACHE_DIR"  # --weight-cache auto: where (default ~/.cache/specserve/packed)
WEIGHT_CACHE_MAX_GIB = "SPECSERVE_WEIGHT_CACHE_MAX_GIB"  # --weight-cache-max-gib unset: the cap (else args.py's default)
PREFETCH_BYTES = "SPECSERVE_PREFETCH_BYTES"  # read by the C++ kernels at load: prefetch distance, 1-2 rows (4096; 0: off)
PREFETCH_BYTES_WIDE = "SPECSERVE_PREFETCH_BYTES_WIDE"  # the same for tiles of 3+ rows (32768; 0: off)


def env_choice(name: str, choices: tuple[str, ...]) -> Optional[str]:
    """One of `choices` (any case), or None when unset or empty."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return None
    if raw not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {os.environ[name]!r}")
    return raw
