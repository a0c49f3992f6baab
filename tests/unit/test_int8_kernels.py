"""The integer-activation linear kernels (csrc/linear_int8.h) on every path this CPU has: the
output equals, bit for bit, an independent Python reading of the arithmetic the header promises
(rows quantized in float32, exact integer group sums, then the float32 fused multiply-adds in group
order); it is within 1e-6 of float64 on the quantized rows; each row's result is the same alone, as
a prefix and permuted; the paths agree bitwise, also on zero, tiny, infinite and NaN rows. The
planted mutation (the same sums combined in another group order) differs from every path, so the
equality is a real check."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_cpu_kernels import NO_VECTOR, QUANTIZED, SUPER_BLOCK_KINDS, assert_every_pair_equal, k_quant_scales, make_weight

from specserve.kernels import dispatch
from specserve.kernels.linear import BLOCK, E2M1, GROUP, Q4, pack_q4, pack_q8

PATHS = list(dispatch.available_paths())
KINDS = [*QUANTIZED, "q4_0"]  # q4_0: offsets of exactly -8 scale, folded into the integer sums


def int8_weight(kind: str, n: int = 40, k: int = 160, seed: int = 0):
    """(packed with integer activations, float64 dense reference) of an [n, k] weight."""
    if kind == "q4_0":
        g = torch.Generator().manual_seed(seed)
        scale = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        packed, dense = pack_q4(codes, scale, -8 * scale), (codes.double() - 8) * scale.double().repeat_interleave(32, 1)
        assert packed.code_offset == 8
    else:
        packed, dense = make_weight(kind, n, max(k, 256) if kind in SUPER_BLOCK_KINDS else k, seed)
    packed = dataclasses.replace(packed)
    assert packed.quantize_activations()
    return packed, dense


def run(packed, x: torch.Tensor, path: str, out_bf16: bool = False) -> torch.Tensor:
    return packed.run(x.contiguous(), out_bf16, dispatch.PATHS[path])


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [m, k] int64, block scales [m, k/32] float32) as the header defines them, in float32."""
    v = x.float().view(x.shape[0], -1, 32)
    amax = v.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    dx = torch.where(inv.isinf(), 0.0, amax / 127.0)  # amax below about 2^-121: the block counts as zero
    inv = torch.where(inv.isinf(), 0.0, inv)
    codes = torch.round(v * inv).clamp(-127, 127)  # round: to nearest, ties to even
    return codes.view(x.shape[0], -1).long(), dx.squeeze(-1)


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 a * b + c rounded once: the product is exact in float64; the float64 sum is made
    round-to-odd (its last bit set toward the exact sum's remainder), which then rounds to float32
    exactly as the exact sum would (53 >= 24 + 2)."""
    p, c = a.double() * b.double(), c.double()
    s = p + c
    err = (p - (s - (s - p))) + (c - (s - p))  # TwoSum: s + err is exactly p + c
    even = (s.view(torch.int64) & 1) == 0
    s = torch.where((err != 0) & even, torch.nextafter(s, s + err), s)
    return s.float()


def unpacked(packed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes [n, k] int64, scales [n, groups], offsets [n, groups] or None) of a packed weight."""
    index = torch.arange(packed.n)
    block, lane = index // BLOCK, index % BLOCK
    if packed.format == Q4:
        codes = packed._q4_codes(block, lane).long()
    else:
        codes = packed.codes.view(torch.int8).view(-1, packed.k // 2, BLOCK, 2)[block, :, lane].reshape(packed.n, -1).long()
    scale = packed.group_values()[block, :, lane].float()
    general = packed.zero.numel() > 0 and packed.code_offset == 0
    return codes, scale, packed.group_values(offsets=True)[block, :, lane].float() if general else None


def reference(packed, x: torch.Tensor, group_order=None) -> torch.Tensor:
    """The header's arithmetic in Python, the groups taken in `group_order` (default: in order)."""
    codes, scale, zero = unpacked(packed)
    q, dx = quantize_rows(x)
    groups, size = packed.k // packed.group, packed.group
    isum = torch.einsum("mgc,ngc->mng", q.view(-1, groups, size), codes.view(-1, groups, size))
    sx = q.view(-1, groups, size).sum(-1)  # [m, groups]
    acc = torch.zeros(x.shape[0], packed.n)
    for g in group_order if group_order is not None else range(groups):
        block_dx = dx[:, g * size // GROUP].unsqueeze(1)
        t = (isum[:, :, g] - packed.code_offset * sx[:, g : g + 1]).float()
        acc = fma32(scale[:, g].unsqueeze(0) * block_dx, t, acc)
        if zero is not None:
            acc = fma32(zero[:, g].unsqueeze(0) * block_dx, sx[:, g : g + 1].float().expand_as(acc), acc)
    return acc


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_int8_linear_is_the_promised_arithmetic_and_every_row_count_gives_the_same_rows(kind, path):
    packed, dense = int8_weight(kind)
    x = torch.randn(70, packed.k, generator=torch.Generator().manual_seed(1)).bfloat16()
    full = run(packed, x, path)
    assert torch.equal(full.view(torch.int32), reference(packed, x).view(torch.int32))
    q, dx = quantize_rows(x)
    want = (q.double() * dx.double().repeat_interleave(32, 1)) @ dense.T
    err = ((full.double() - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-6, f"{kind} {path}: relative error {err:.2e} against float64 on the quantized rows"
    exact = x.double() @ dense.T  # what quantizing the activations costs: about 1/127 of a block's range
    assert ((full.double() - exact).abs().max() / exact.abs().max()).item() <= 2e-2
    for m in range(1, 71):
        assert torch.equal(run(packed, x[:m], path), full[:m]), f"{kind} {path}: rows differ at M={m}"
    order = torch.randperm(70, generator=torch.Generator().manual_seed(2))
    assert torch.equal(run(packed, x[order], path), full[order])
    assert torch.equal(run(packed, x, path, out_bf16=True), full.bfloat16())


@NO_VECTOR
@pytest.mark.parametrize("kind", KINDS)
def test_int8_paths_agree_bitwise_on_ordinary_and_edge_rows(kind):
    packed, _ = int8_weight(kind, 100, 256, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(12, packed.k, generator=g)
    x[0] = 0.0  # a zero row
    x[1] *= 2.0 ** -130  # subnormal bf16 values: counted as zero
    x[2, :32] *= 2.0 ** -120  # one tiny block among ordinary ones
    x[3] *= 2.0 ** 100
    x[4, 5], x[5, 40] = float("inf"), float("nan")  # their blocks make the row's outputs NaN
    x = x.bfloat16()
    results = {path: (run(packed, x, path), run(packed, x, path, out_bf16=True)) for path in PATHS}
    assert_every_pair_equal(results)
    out = results["generic"][0]
    assert torch.equal(out[0], torch.zeros(packed.n)) and torch.equal(out[1], torch.zeros(packed.n))
    assert out[4].isnan().all() and out[5].isnan().all() and out[[2, 3, 6]].isfinite().all()


@pytest.mark.parametrize("kind", ["q6_g16", "q8", "e2m1"])
def test_wide_weights_few_rows_and_extreme_codes(kind):
    """What the shapes above leave out: more than 8 column blocks (several column chunks) with a
    partial last one, 1 to 5 rows (every row tile), and the integer sums at their extremes: codes at
    their largest magnitude (6-bit 63, 8-bit -128) times rows whose codes are all +-127."""
    g = torch.Generator().manual_seed(7)
    n, k = 300, 256
    if kind == "q6_g16":
        codes = torch.full((n, k), 63, dtype=torch.uint8)
        codes[::2] = torch.randint(0, 64, (n // 2, k), dtype=torch.uint8, generator=g)
        scale = k_quant_scales(n, k // 16, g)
        packed = pack_q4(codes, scale, -32 * scale, 16, 6)
    elif kind == "e2m1":  # code 7 reads 24 (E2M1 6.0 doubled, + 12), the table's largest value
        codes = torch.full((n, k), 7, dtype=torch.uint8)
        codes[::2] = torch.randint(0, 16, (n // 2, k), dtype=torch.uint8, generator=g)
        scale = torch.exp2(-torch.randint(4, 11, (n, k // 32), generator=g).float())
        packed = pack_q4(codes, scale, -12 * scale, 32, E2M1)
    else:
        codes = torch.full((n, k), -128, dtype=torch.int8)
        codes[::2] = torch.randint(-128, 128, (n // 2, k), dtype=torch.int8, generator=g)
        packed = pack_q8(codes, (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float())
    assert packed.quantize_activations()
    x = torch.randn(5, k, generator=g)
    x[0], x[1] = 1.0, -1.0  # every code +127, then -127
    x[2] = torch.where(torch.arange(k) % 2 == 0, 1.0, -1.0)
    x = x.bfloat16()
    for m in range(1, 6):
        want = reference(packed, x[:m])
        for path in PATHS:
            assert torch.equal(run(packed, x[:m], path).view(torch.int32), want.view(torch.int32)), (kind, path, m)


@pytest.mark.parametrize("kind", ["q4", "q4_0", "q6_g16", "q8", "q4_k"])
def test_planted_group_order_differs_from_every_path(kind):
    """The mutation the equality above exists to catch: the same integer sums combined in reverse
    group order (or with the groups' last two swapped) give other bits than every path."""
    packed, _ = int8_weight(kind)
    x = torch.randn(70, packed.k, generator=torch.Generator().manual_seed(1)).bfloat16()
    groups = packed.k // packed.group
    for order in (list(reversed(range(groups))), [*range(groups - 2), groups - 1, groups - 2]):
        planted = reference(packed, x, order)
        assert torch.allclose(planted, reference(packed, x), rtol=1e-5, atol=1e-6)  # same sums, other rounding
        for path in PATHS:
            assert not torch.equal(run(packed, x, path).view(torch.int32), planted.view(torch.int32)), (kind, path, order)


def test_code_offsets_are_found_only_where_every_offset_is_minus_c_scale():
    g = torch.Generator().manual_seed(5)
    scale = (torch.rand(16, 2, generator=g) * 0.02 + 1e-3).half().float()
    codes = torch.randint(0, 16, (16, 64), dtype=torch.uint8, generator=g)
    assert pack_q4(codes, scale, -8 * scale).code_offset == 8
    assert pack_q4(codes * 2, scale, -16 * scale, bits=5).code_offset == 16
    nudged = -8 * scale
    nudged[3, 1] = nudged[3, 1] * (1 + 2 ** -10)
    assert pack_q4(codes, scale, nudged).code_offset == 0
    dense = make_weight("bf16", 16, 64)[0]
    assert not dense.quantize_activations()  # bf16 weights keep bf16 activations
