"""`bench linear-rows` on small packed weights: both activation modes timed where the layout has
int8 kernels, bf16 alone where it has none, the kernel left on bf16, and the README table."""

from __future__ import annotations

import json

import torch

from benchmarks.linear_rows import time_linear
from benchmarks.render.engine import render_linear_rows
from specserve.kernels.linear import pack_bf16, pack_q8


def q8_linear(n: int = 48, k: int = 64):
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    return pack_q8(codes, torch.rand(n, k // 32, generator=gen) * 1e-2)


def test_times_both_modes_and_leaves_bf16_on():
    kernel = q8_linear()
    got = time_linear(kernel, 6, calls=3)
    assert set(got) == {"bf16", "int8", "bf16_gmac_s"}
    for mode in ("bf16", "int8"):
        assert 0 < got[mode]["min_us"] <= got[mode]["median_us"] <= got[mode]["max_us"]
    assert got["bf16_gmac_s"] == 6 * 64 * 48 / (got["bf16"]["median_us"] * 1e3)
    assert not kernel.int8_activations


def test_bf16_weights_time_bf16_only():
    got = time_linear(pack_bf16(torch.randn(32, 64)), 2, calls=2)
    assert set(got) == {"bf16", "bf16_gmac_s"}


def test_rendered_table(tmp_path):
    kernel = q8_linear()
    by_rows = {str(m): time_linear(kernel, m, calls=2) for m in (1, 6)}
    data = {"commit": "abc", "date": "d", "machine": "m", "calls": 2, "rows": [1, 6],
            "linears": {"down_proj": {"k": 64, "n": 48, "format": "8-bit codes", "by_rows": by_rows}}}
    (tmp_path / "linear_rows.json").write_text(json.dumps(data))
    text = render_linear_rows(str(tmp_path))
    assert "| down_proj [48x64, 8-bit codes] int8 |" in text and "| M = 6 |" in text
    assert f"{by_rows['6']['bf16']['median_us']:.0f} (" in text and "down_proj bf16 GMAC/s" in text
