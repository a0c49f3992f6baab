"""Where one target forward step spends its time, by kernel: each kernel entry point is wrapped
with a wall-clock timer for the duration of a `with timed_kernels()` block, and whatever the
kernels do not account for (Python, embedding, allocation) is reported as `other`. A mixture's
block is one entry (its router and experts, one native call on the CPU kernels' path); a timed
entry reached inside another counts in the outer one only, so the parts never sum past the step."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Callable, Iterator

import specserve.models.attention as attention_module
import specserve.models.backend as backend_module
from specserve.kernels.linear import BF16, Q4, Q8, PackedLinear
from specserve.models.moe import SparseMoeBlock

_FORMATS = {Q4: "q4", Q8: "q8", BF16: "bf16"}


def _timed(totals: dict[str, float], name: Callable[..., str], fn: Callable, depth: list[int]) -> Callable:
    def wrapper(*args, **kwargs):
        if depth[0]:  # inside another timed entry: its time is that entry's
            return fn(*args, **kwargs)
        depth[0] += 1
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name(*args)] += time.perf_counter() - start
            depth[0] -= 1
    return wrapper


@contextlib.contextmanager
def timed_kernels() -> Iterator[dict[str, float]]:
    """Seconds per kernel (linears by shape) accumulated while the block runs."""
    totals: dict[str, float] = defaultdict(float)
    patches = [
        (PackedLinear, "__call__", lambda self, *a: f"linear {_FORMATS[self.format]} {self.n}x{self.k}"),
        (backend_module, "add_rms_norm", lambda *a: "add_rms_norm"),  # the CPU kernel ops' entry points
        (backend_module, "silu_mul", lambda *a: "silu_mul"),
        (backend_module, "gelu_tanh_mul", lambda *a: "gelu_tanh_mul"),
        (backend_module, "rope_store", lambda *a: "rope_store"),
        (attention_module, "kernel_paged_attention", lambda *a: "attention"),
        (SparseMoeBlock, "forward", lambda *a: "moe"),
    ]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
    depth = [0]
    for (owner, attr, name), (_, _, original) in zip(patches, saved):
        setattr(owner, attr, _timed(totals, name, original, depth))
    try:
        yield totals
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)


def profile_step(run: Callable[[], object], repeats: int) -> dict[str, float]:
    """Milliseconds per step of each kernel and of the rest, over `repeats` calls of `run`."""
    run()  # warm-up
    with timed_kernels() as totals:
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        total = time.perf_counter() - start
    profile = {name: 1e3 * t / repeats for name, t in sorted(totals.items(), key=lambda kv: -kv[1])}
    profile["other"] = 1e3 * total / repeats - sum(profile.values())
    profile["step"] = 1e3 * total / repeats
    return profile
