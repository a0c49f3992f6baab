"""The kernel build cannot wedge or go stale: a lock left by a killed build is taken over, a live
build is waited for with a bound, and the cache key covers every source file and the compiler."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from specserve.kernels import build


def test_fingerprint_covers_every_file_in_the_folder_and_the_compiler(tmp_path, monkeypatch):
    sources = tmp_path / "csrc"
    shutil.copytree(build.SOURCE_DIR, sources)
    before = build._fingerprint(str(sources))
    (sources / "new_kernel.h").write_text("// a header no list names\n")
    assert build._fingerprint(str(sources)) != before
    (sources / "new_kernel.h").unlink()
    assert build._fingerprint(str(sources)) == before
    monkeypatch.setattr(build, "compiler_version", lambda: "g++ (a newer one) 14.2.0")
    assert build._fingerprint(str(sources)) != before


def test_a_torch_lock_left_by_a_dead_build_is_removed_under_the_build_lock(tmp_path):
    folder = tmp_path / "kernels"
    folder.mkdir()
    (folder / build.TORCH_LOCK).write_text("")
    assert build._built_library(str(folder)) is None  # torch would wait on it forever
    with build.build_lock(str(folder), wait_s=5):
        assert not (folder / build.TORCH_LOCK).exists()


HOLD = """
import sys, time
from specserve.kernels import build
with build.build_lock(sys.argv[1]):
    open(sys.argv[1] + "/lock", "w").close()  # what torch's build leaves while it runs
    print("holding", flush=True)
    time.sleep(600)
"""


def test_a_live_build_is_waited_for_with_a_bound_and_a_killed_one_is_taken_over(tmp_path):
    folder = str(tmp_path / "kernels")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, folder], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=f"another process \\(pid {holder.pid}\\) has been building"):
            with build.build_lock(folder, wait_s=1.0):
                pass
        assert time.monotonic() - start < 10
        holder.send_signal(signal.SIGKILL)  # the build dies mid-way; the kernel drops its flock
        holder.wait(timeout=30)
        with build.build_lock(folder, wait_s=5):
            assert not os.path.exists(os.path.join(folder, build.TORCH_LOCK))
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_load_with_a_stale_lock_in_the_cache_does_not_wait(tmp_path):
    """End to end, in a fresh process: the built library and a stale torch lock in the cache folder."""
    library = build._built_library(build.build_dir())
    assert library is not None, "the kernels are built by scripts/setup.sh"
    cache = tmp_path / "cache"
    env = {**os.environ, "SPECSERVE_KERNEL_CACHE_DIR": str(cache)}
    folder = subprocess.run([sys.executable, "-c", "from specserve.kernels import build; print(build.build_dir())"],
                            env=env, capture_output=True, text=True, check=True).stdout.strip()
    os.makedirs(folder)
    shutil.copy(library, folder)
    open(os.path.join(folder, build.TORCH_LOCK), "w").close()
    proc = subprocess.run([sys.executable, "-c", "from specserve.kernels import build; print(build.load().has_avx2_fma())"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "left by a build that died" in proc.stderr
    assert not os.path.exists(os.path.join(folder, build.TORCH_LOCK))
