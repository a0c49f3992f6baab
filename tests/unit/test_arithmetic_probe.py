"""The machine probes the arithmetic figures are priced against (csrc/probe.cpp, bench/arithmetic.py):
a clock within what any core runs at, VPDPBUSD's rate on the AVX-512 path only, and a step's
multiply-adds counted from its packed weights."""

from __future__ import annotations

import types

import pytest
import torch

from specserve import envs
from specserve.bench.arithmetic import machine_arithmetic, row_macs
from specserve.kernels import dispatch


def test_clock_and_int8_peak_are_measured_on_the_avx512_path_only(monkeypatch):
    monkeypatch.setenv(envs.CPU_KERNEL_PATH, "generic")
    plain = machine_arithmetic()
    assert 0.3 < plain["clock_ghz"] < 8.0, plain  # a real clock, not a constant or a loop folded away
    assert plain["int8_dot_per_s"] is None and plain["int8_macs_per_cycle_per_core_peak"] is None
    if "avx512_bf16" not in dispatch.available_paths():
        pytest.skip("this CPU has no AVX-512 path: no VPDPBUSD peak to measure")
    monkeypatch.setenv(envs.CPU_KERNEL_PATH, "avx512_bf16")
    vector = machine_arithmetic()
    # 64 multiply-adds an instruction, between a quarter and four instructions a cycle
    assert 16 <= vector["int8_macs_per_cycle_per_core_peak"] <= 256, vector


def test_row_macs_count_each_weight_once_and_a_routed_share_of_the_experts():
    from specserve.kernels.linear import PackedLinear

    def kernel(n: int, k: int) -> PackedLinear:
        return PackedLinear(format=0, codes=torch.empty(0), scale=torch.empty(0), zero=torch.empty(0), n=n, k=k)

    shared = kernel(64, 32)  # one weight held by two modules (a tied head) counts once
    mods = {"a": kernel(16, 32), "head": shared, "tied": shared, "layers.0.experts.gate": kernel(8 * 10, 32)}
    model = types.SimpleNamespace(
        config=types.SimpleNamespace(is_moe=True, num_experts=8, num_experts_per_tok=2),
        named_modules=lambda: [(name, types.SimpleNamespace(kernel=k)) for name, k in mods.items()])
    assert row_macs(model) == 16 * 32 + 64 * 32 + 80 * 32 * 2 // 8
