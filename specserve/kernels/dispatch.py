"""Which kernel path this process uses: chosen from the CPU's flags, or forced by
SPECSERVE_CPU_KERNEL_PATH (generic | avx512_bf16) so every path can be tested where the CPU allows."""

from __future__ import annotations

import os
from functools import lru_cache

from specserve import envs
from specserve.kernels.build import load

PATHS = {"generic": 0, "avx512_bf16": 1}


def _cpuinfo(key: str) -> str:
    """The first `key : value` line of /proc/cpuinfo (Linux), or "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":", 1)[0].strip() == key), "")
    except OSError:
        return ""


def cpu_flags() -> set[str]:
    """Feature flags of this CPU as the kernel sees them, for tests and reports."""
    return set(_cpuinfo("flags").split())


def cpu_model() -> str:
    return _cpuinfo("model name") or "unknown"


@lru_cache(maxsize=1)
def best_path() -> str:
    return "avx512_bf16" if load().has_avx512_bf16() else "generic"


def path_id() -> int:
    """The numeric path passed to the kernels: SPECSERVE_CPU_KERNEL_PATH if set, else the best.
    Read on every call (tests switch paths), resolved once per distinct value."""
    return _path_for(os.environ.get(envs.CPU_KERNEL_PATH, ""))


@lru_cache(maxsize=8)
def _path_for(raw: str) -> int:
    name = raw.strip() or best_path()
    if name not in PATHS:
        raise ValueError(f"{envs.CPU_KERNEL_PATH} must be one of {sorted(PATHS)}, got {name!r}")
    if name == "avx512_bf16" and not load().has_avx512_bf16():
        raise ValueError(f"{envs.CPU_KERNEL_PATH}=avx512_bf16 but this CPU lacks AVX512-BF16")
    return PATHS[name]


def path_name() -> str:
    return {v: k for k, v in PATHS.items()}[path_id()]
