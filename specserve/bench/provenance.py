"""What every result file records about where its figures come from: the commit (marked dirty if
the tree had changes), the date, the machine (CPU, flags, kernel path, threads) and, for runs that
speculate, the checksum of the drafter, so `python -m benchmarks report` can show it and mark a figure
whose drafter is not the shipped one."""

from __future__ import annotations

import datetime
import hashlib
import os
import subprocess
from typing import Any, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def commit() -> str:
    """HEAD's hash, with '-dirty' when tracked files other than result files (bench_results/, which
    the benchmarks themselves write) differ from it; 'unknown' outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench_results"],
                               cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def machine() -> dict[str, Any]:
    import torch

    from specserve.kernels import dispatch

    flags = dispatch.cpu_flags()
    return {"model": dispatch.cpu_model(), "amx": "amx_tile" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "threads": torch.get_num_threads(), "kernel_path": dispatch.best_path(),
            "description": dispatch.machine_description()}


def drafter_checksum(path: Optional[str]) -> Optional[str]:
    """sha256 of a drafter folder's weight file (model.safetensors), or None."""
    if not path:
        return None
    weights = os.path.join(path, "model.safetensors")
    if not os.path.exists(weights):
        return None
    digest = hashlib.sha256()
    with open(weights, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def provenance(drafter_path: Optional[str] = None) -> dict[str, Any]:
    """The fields a result file starts with."""
    record: dict[str, Any] = {"commit": commit(),
                              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                              "machine": machine()}
    if drafter_path:
        record["drafter"] = {"path": os.path.relpath(drafter_path, REPO), "sha256": drafter_checksum(drafter_path)}
    return record


def emit_report(report: dict[str, Any], out: Optional[str]) -> None:
    """A bench's JSON report on stdout and, with --out, in that file."""
    import json

    text = json.dumps(report, indent=2)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
