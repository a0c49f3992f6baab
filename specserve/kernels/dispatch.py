"""Which kernel path this process uses: chosen from the CPU's flags (AVX512-BF16, else AVX2 + FMA,
else portable C++), or forced by SPECSERVE_CPU_KERNEL_PATH (generic | avx512_bf16 | avx2_fma) so
every path can be tested where the CPU allows. All paths give the same bits."""

from __future__ import annotations

import os
from functools import lru_cache

from specserve import envs
from specserve.errors import ConfigError
from specserve.kernels.build import load

PATHS = {"generic": 0, "avx512_bf16": 1, "avx2_fma": 2}


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
    """The model name, with the family and model numbers where the name alone does not tell the
    generation (a virtual machine's "AMD EPYC" is Zen 4 or Zen 5, whose speeds differ)."""
    name = _cpuinfo("model name") or "unknown"
    family, model = _cpuinfo("cpu family"), _cpuinfo("model")
    return f"{name} (family {family} model {model})" if family and model and not any(c.isdigit() for c in name) else name


def machine_description() -> str:
    """What a measured figure ran on: CPU model, cores, AMX or not, and the kernel path."""
    amx = "amx_tile" in cpu_flags()
    return f"{cpu_model()}, {os.cpu_count()} cores, {'AMX' if amx else 'no AMX'}, {best_path()} kernels"


def vector_paths(module) -> list[str]:
    """The vector paths the built kernel `module` reports this CPU runs, fastest first."""
    return [name for name, has in (("avx512_bf16", module.has_avx512_bf16), ("avx2_fma", module.has_avx2_fma)) if has()]


@lru_cache(maxsize=1)
def available_paths() -> tuple[str, ...]:
    """The paths this CPU runs, fastest first ("generic" always last)."""
    return (*vector_paths(load()), "generic")


def best_path() -> str:
    return available_paths()[0]


def path_id() -> int:
    """The numeric path passed to the kernels: SPECSERVE_CPU_KERNEL_PATH if set, else the best.
    Read on every call (tests switch paths), resolved once per distinct value."""
    return _path_for(os.environ.get(envs.CPU_KERNEL_PATH, ""))


@lru_cache(maxsize=8)
def _path_for(raw: str) -> int:
    name = raw.strip() or best_path()
    if name not in PATHS:
        raise ConfigError(f"{envs.CPU_KERNEL_PATH} must be one of {sorted(PATHS)}, got {name!r}")
    if name not in available_paths():
        needs = {"avx512_bf16": "AVX512-BF16 with VNNI and VBMI", "avx2_fma": "AVX2 and FMA"}[name]
        raise ConfigError(f"{envs.CPU_KERNEL_PATH}={name} but this CPU lacks {needs}")
    return PATHS[name]


def path_name() -> str:
    return {v: k for k, v in PATHS.items()}[path_id()]
