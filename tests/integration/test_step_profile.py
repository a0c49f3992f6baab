"""bench offline's step profile on the default path (bf16, the CPU kernels): every kernel entry
point it wraps exists and is reached by a forward step, so the README's table has every column."""

from __future__ import annotations

import argparse

import pytest

from specserve import Engine
from specserve.bench.offline import step_shapes
from specserve.kernels.dispatch import best_path


@pytest.mark.skipif(best_path() == "portable", reason="the step profile is for the native kernel paths")
def test_a_bf16_step_profile_times_every_kernel():
    with Engine(max_total_tokens=512, speculative_algorithm="NONE") as engine:
        assert engine.runner.model.ops.name == "cpu-kernels"
        ns = argparse.Namespace(window=3, prefix_len=16, prefill_len=32, repeats=1)
        shapes = step_shapes(engine, ns)
    for name in ("decode", "verify"):
        profile = shapes[f"{name}_profile_ms"]
        for kernel in ("add_rms_norm", "silu_mul", "rope_store", "attention"):
            assert profile.get(kernel, 0.0) > 0.0, (name, kernel, profile)
        assert any(k.startswith("linear q4") for k in profile) and profile["step"] > 0, profile


def test_a_timed_entry_inside_another_counts_in_the_outer_one_only():
    """step_profile's wrappers: an inner timed call adds nothing of its own (else a mixture's router
    linear on the torch path would count twice, in `linear` and in `moe`); alone it counts."""
    from collections import defaultdict

    from specserve.bench.step_profile import _timed

    totals: dict[str, float] = defaultdict(float)
    depth = [0]
    inner = _timed(totals, lambda *a: "inner", lambda: 1, depth)
    outer = _timed(totals, lambda *a: "outer", lambda: inner() + 1, depth)
    assert outer() == 2 and set(totals) == {"outer"}
    assert inner() == 1 and set(totals) == {"outer", "inner"} and depth == [0]
