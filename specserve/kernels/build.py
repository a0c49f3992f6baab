"""Build and load the C++ CPU kernels (specserve/kernels/csrc) as a torch extension.

`scripts/setup.sh` runs `python -m specserve.kernels.build`, which compiles them and runs a
self-test; a failure there stops the set-up (there is no fallback to stock kernels). The build
lives in a cache folder named by a hash of the sources, flags and torch version, so a source
change builds afresh and every process after the first just loads the library.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from functools import lru_cache
from types import ModuleType

import torch

from specserve import envs

NAME = "specserve_cpu_kernels"
SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCES = ("bindings.cpp", "linear.cpp", "linear_avx2.cpp", "attention.cpp", "ops.cpp")
HEADERS = ("simd.h", "simd_avx512.h", "simd_avx2.h", "linear.h", "attention.h", "ops.h")
# No -ffast-math and no contraction: each kernel's operation order is part of its contract.
CFLAGS = ("-O3", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-fopenmp")


def _fingerprint() -> str:
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        with open(os.path.join(SOURCE_DIR, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    digest.update(" ".join(CFLAGS).encode() + torch.__version__.encode() + sys.version.encode())
    return digest.hexdigest()[:16]


def build_dir() -> str:
    root = os.environ.get(envs.KERNEL_CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "specserve")
    return os.path.join(root, "kernels", _fingerprint())


def _built_library(folder: str) -> str | None:
    """The finished library in folder, or None (also while another process is still building it:
    torch's build holds a `lock` file there, and going through cpp_extension waits for it)."""
    if os.path.exists(os.path.join(folder, "lock")):
        return None
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        if name.startswith(NAME) and name.endswith(".so"):
            return os.path.join(folder, name)
    return None


@lru_cache(maxsize=1)
def load() -> ModuleType:
    """The compiled kernels, built first if this source version has not been built here."""
    folder = build_dir()
    library = _built_library(folder)
    if library is None:
        from torch.utils import cpp_extension

        os.makedirs(folder, exist_ok=True)
        # The `ninja` the package depends on lives next to this interpreter, maybe not on PATH.
        path = os.environ.get("PATH", "")
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + path
        try:
            return cpp_extension.load(NAME, [os.path.join(SOURCE_DIR, s) for s in SOURCES], extra_cflags=list(CFLAGS),
                                      extra_ldflags=["-fopenmp"], build_directory=folder, verbose=False)
        finally:
            os.environ["PATH"] = path
    spec = importlib.util.spec_from_file_location(NAME, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    from specserve.kernels.self_test import self_test

    module = load()
    print(f"specserve kernels built in {build_dir()}")
    print(self_test(module))


if __name__ == "__main__":
    main()
