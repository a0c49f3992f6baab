"""The kernels' portable path off x86: the sources build for aarch64 (x86 headers and vector code
only behind SPECSERVE_X86), and the generic kernels give there the bits they give here. The
harness tests/native/portable_kernels.cpp runs every generic kernel on fixed inputs (raw bf16 bit
patterns over the whole range for the dense weights) and prints the outputs' bytes; it is built
natively and with Debian's aarch64 cross-compiler, and the aarch64 build runs under qemu-user.
`scripts/setup.sh --test` installs both tools where it can (root and apt-get); CI must have them."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from specserve.kernels.build import CFLAGS, SOURCE_DIR, source_files

HARNESS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "native", "portable_kernels.cpp")
CROSS, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"
EM_AARCH64 = 183  # the ELF header's e_machine
# The torch-facing files need torch's headers; the harness replaces them.
TORCH_FILES = {"bindings.cpp", "torch_glue.cpp", "decoder_layer.cpp", "markov.cpp", "pack.cpp", "moe.cpp", "probe.cpp"}
KERNEL_SOURCES = [os.path.join(SOURCE_DIR, f) for f in source_files() if f.endswith(".cpp") and f not in TORCH_FILES]


def require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        message = f"{tool} is not installed (Debian: g++-aarch64-linux-gnu, qemu-user; scripts/setup.sh --test)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def build(compiler: str, out: str) -> None:
    flags = [f for f in CFLAGS if f != "-fopenmp"]  # the harness is single-threaded
    cmd = [compiler, *flags, "-static", f"-I{SOURCE_DIR}", HARNESS, *KERNEL_SOURCES, "-o", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{compiler} failed:\n{proc.stderr[-4000:]}"


def test_generic_kernels_build_for_aarch64_and_give_the_same_bits(tmp_path):
    cross, qemu = require(CROSS), require(QEMU)
    build("g++", str(tmp_path / "native"))
    build(cross, str(tmp_path / "aarch64"))
    header = (tmp_path / "aarch64").read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == EM_AARCH64
    here = subprocess.run([str(tmp_path / "native")], capture_output=True, timeout=120, check=True).stdout
    there = subprocess.run([qemu, str(tmp_path / "aarch64")], capture_output=True, timeout=300, check=True).stdout
    # 3 linears and 3 with integer activations, a K-quant-table linear twice and twice with integer
    # activations (9 x 40 fp32), attention (5 x 6 x 32 bf16), norm, residual and SiLU (3 x 4 x 200 bf16)
    assert len(here) == 10 * 9 * 40 * 4 + 5 * 6 * 32 * 2 + 3 * 4 * 200 * 2 and any(here)
    assert here == there, "the generic kernels give different bits on aarch64"
