"""Build and load the C++ CPU kernels (specserve/kernels/csrc) as a torch extension.

`scripts/setup.sh` runs `python -m specserve.kernels.self_test`, which compiles them (`load`) and
runs a self-test; a failure there stops the set-up (there is no fallback to stock kernels). The build
lives in a cache folder named by a hash of every file in the source folder, the flags, the
compiler's version, the torch version and the Python version, so any change builds afresh and
every process after the first just loads the library.

Builds are serialized by an advisory lock (`flock` on `build.lock` in that folder), which the
kernel drops when its holder dies. torch's own `lock` file, which a killed build leaves behind
and which makes every later torch build wait forever, is therefore stale whenever we hold ours,
and is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import subprocess
import sys
import time
from functools import lru_cache
from types import ModuleType
from typing import Iterator

import torch

from specserve import envs

NAME = "specserve_cpu_kernels"
SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
# No -ffast-math and no contraction: each kernel's operation order is part of its contract.
CFLAGS = ("-O3", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-fopenmp")
BUILD_LOCK = "build.lock"  # ours (flock)
TORCH_LOCK = "lock"  # torch.utils.cpp_extension's (a plain file)
BUILD_WAIT_S = 900.0  # how long to wait for another live process's build before giving up


def source_files(folder: str = SOURCE_DIR) -> list[str]:
    """Every file under the kernel source folder, as sorted paths relative to it."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        found += [os.path.relpath(os.path.join(root, f), folder) for f in files]
    return sorted(found)


def compiler_version() -> str:
    """The first line of `$CXX --version` (torch builds with $CXX, else c++)."""
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"specserve kernels: cannot run the C++ compiler {cxx!r} ({exc}); install g++") from None
    return (out.stdout.strip().splitlines() or [""])[0]


def _fingerprint(folder: str = SOURCE_DIR) -> str:
    digest = hashlib.sha256()
    for name in source_files(folder):
        with open(os.path.join(folder, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read() + b"\0")
    for part in (" ".join(CFLAGS), compiler_version(), torch.__version__, sys.version):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def build_dir() -> str:
    root = os.environ.get(envs.KERNEL_CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "specserve")
    return os.path.join(root, "kernels", _fingerprint())


def _built_library(folder: str) -> str | None:
    """The finished library in folder, or None (also while a build is under way: torch's `lock`)."""
    if os.path.exists(os.path.join(folder, TORCH_LOCK)):
        return None
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        if name.startswith(NAME) and name.endswith(".so"):
            return os.path.join(folder, name)
    return None


@contextlib.contextmanager
def build_lock(folder: str, wait_s: float = BUILD_WAIT_S) -> Iterator[None]:
    """Hold the folder's build lock; a torch `lock` found then was left by a dead build and goes."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, BUILD_LOCK), "a+") as handle:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    handle.seek(0)
                    raise TimeoutError(
                        f"specserve kernels: another process ({handle.read().strip() or 'unknown'}) "
                        f"has been building in {folder} for over {wait_s:.0f} s"
                    ) from None
                time.sleep(0.2)
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(f"pid {os.getpid()}")
            handle.flush()
            stale = os.path.join(folder, TORCH_LOCK)
            if os.path.exists(stale):
                print(f"specserve kernels: removing {stale}, left by a build that died", file=sys.stderr)
                os.remove(stale)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@lru_cache(maxsize=1)
def load() -> ModuleType:
    """The compiled kernels, built first if this source version has not been built here."""
    folder = build_dir()
    library = _built_library(folder)
    if library is None:
        with build_lock(folder):
            library = _built_library(folder)  # another process may have built it while we waited
            if library is None:
                return _build(folder)
    spec = importlib.util.spec_from_file_location(NAME, library)
    assert spec is not None and spec.loader is not None, f"{library}: not an extension module"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(folder: str) -> ModuleType:
    from torch.utils import cpp_extension

    sources = [os.path.join(SOURCE_DIR, name) for name in source_files() if name.endswith(".cpp")]
    # The `ninja` the package depends on lives next to this interpreter, maybe not on PATH.
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + path
    try:
        return cpp_extension.load(
            NAME, sources, extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"], build_directory=folder, verbose=False
        )
    finally:
        os.environ["PATH"] = path
