"""The C++ CPU kernels against float64 references, for odd shapes, on every path this CPU has:
each output row is computed in one order whatever the row count (so a row's result is bitwise the
same alone, in any batch and at any position), the generic, AVX512-BF16 and AVX2 paths agree bit
for bit, and the dispatched path follows the CPU's flags and SPECSERVE_CPU_KERNEL_PATH."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from specserve import envs
from specserve.kernels import dispatch
from specserve.kernels.attention import paged_attention
from specserve.kernels.build import load
from specserve.kernels.linear import BF16, E2M1, E2M1_CODES, Q4, Q8, pack_bf16, pack_q4, pack_q8

AVX512_FLAGS = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni", "avx512vbmi"}
VECTOR_PATHS = [p for p in dispatch.available_paths() if p != "generic"]
PATHS = ["generic", *VECTOR_PATHS]
NO_VECTOR = pytest.mark.skipif(not VECTOR_PATHS, reason="this CPU has neither AVX512-BF16 nor AVX2: only the generic path")
# Largest error relative to the largest reference output: fp32 sums of exact bf16 products for
# the quantized formats; bf16 output rounding (2^-8) for the dense one.
# The quantized layouts: 4-bit codes with float16 or float32 scales and offsets, 5-bit codes
# (Q5_0, Q5_1, Q5_K), 6-bit codes in groups of 16 (Q6_K); 8-bit codes with float16 scales, with
# offsets (8-bit fusions of the others), and in groups of 16; K-quant tables (int8 sub-values times
# float16 super-values per 256 columns) with stored offsets (Q4_K) and with -32 * scale (Q6_K);
# E2M1 codes read through their table with power-of-two scales (MXFP4) in K-quant-style tables.
QUANTIZED = ["q4", "q4_f32", "q5", "q6_g16", "q8", "q8_offset", "q8_g16", "q4_k", "q6_k", "e2m1"]
SUPER_BLOCK_KINDS = ("q4_k", "q6_k", "e2m1")  # int8 tables only where K is a multiple of 256
KINDS = [*QUANTIZED, "bf16"]
BOUND = {**{kind: 1e-5 for kind in QUANTIZED}, "bf16": 8e-3}


def expand(t: torch.Tensor, group: int = 32) -> torch.Tensor:
    return t.double().repeat_interleave(group, 1)


def k_quant_scales(n: int, groups: int, g: torch.Generator) -> torch.Tensor:
    """A float16 super-block scale times 6-bit sub-scales: values float16 cannot hold."""
    return (torch.rand(n, 1, generator=g) * 1e-3).half().float() * torch.randint(1, 64, (n, groups), generator=g).float()


def k_quant_tables(kind: str, n: int, k: int, g: torch.Generator):
    """(codes, scale, offset, group, bits, supers) of a K-quant weight as the GGUF parser gives it:
    scales (and Q4_K's offsets) integer multiples of float16 super-values per 256 columns."""
    bits, group, low, high = (4, 32, 0, 64) if kind == "q4_k" else (6, 16, -128, 128)
    tops = [(torch.rand(n, -(-k // 256), generator=g) * 1e-3 + 1e-5).half().float() for _ in range(2)]
    subs = [torch.randint(low, high, (n, k // group), generator=g).float() for _ in range(2)]
    spread = [t.repeat_interleave(256 // group, 1)[:, : k // group] for t in tops]  # a partial last super-block
    scale = spread[0] * subs[0]
    if kind == "q4_k":
        offset, supers = -spread[1] * subs[1], (tops[0], -tops[1])
    else:
        offset, supers = -32 * scale, (tops[0], -32 * tops[0])
    codes = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=g)
    return codes, scale, offset, group, bits, supers


def e2m1_tables(n: int, k: int, g: torch.Generator):
    """(codes, scale, offset, supers) of an MXFP4 weight as the GGUF parser gives it: power-of-two
    scales 2^-10 .. 2^-4 per 32 columns, the smallest per 256 columns their super-value."""
    scale = torch.exp2(-torch.randint(4, 11, (n, k // 32), generator=g).float())
    padded = torch.nn.functional.pad(scale, (0, -(k // 32) % 8), value=1.0)  # a partial last super-block
    top = padded.view(n, -1, 8).amin(-1)
    return torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g), scale, -12 * scale, (top, None)


def make_weight(kind: str, n: int, k: int, seed: int = 0):
    """(packed, float64 dense reference) of an [n, k] weight."""
    g = torch.Generator().manual_seed(seed)
    if kind == "e2m1":
        codes, scale, offset, supers = e2m1_tables(n, k, g)
        packed = pack_q4(codes, scale, offset, 32, E2M1, supers)
        assert packed.code_offset == 12 and packed.scale.dtype == torch.int8
        return packed, (E2M1_CODES[codes.long()].double() - 12) * expand(scale)
    if kind in ("q4_k", "q6_k"):
        codes, scale, offset, group, bits, supers = k_quant_tables(kind, n, k, g)
        packed = pack_q4(codes, scale, offset, group, bits, supers)
        assert packed.scale.dtype == torch.int8  # K-quant tables, the last super-block partial where K says so
        return packed, codes.double() * expand(scale, group) + expand(offset, group)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    if kind in ("q5", "q6_g16"):
        bits, group = (5, 32) if kind == "q5" else (6, 16)
        codes = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=g)
        scale = k_quant_scales(n, k // group, g)
        offset = -(1 << (bits - 1)) * scale
        packed = pack_q4(codes, scale, offset, group, bits)
        return packed, codes.double() * expand(scale, group) + expand(offset, group)
    if kind.startswith("q4"):
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        offset = (-8 * scale + torch.randn(n, k // 32, generator=g) * 1e-3).half().float()
        if kind == "q4_f32":
            scale, offset = k_quant_scales(n, k // 32, g), -k_quant_scales(n, k // 32, g)
        packed = pack_q4(codes, scale, offset)
        assert packed.scale.dtype == (torch.float32 if kind == "q4_f32" else torch.float16)
        return packed, codes.double() * expand(scale) + expand(offset)
    if kind == "q8":
        codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        return pack_q8(codes, scale), codes.double() * expand(scale)
    if kind == "q8_offset":
        codes = torch.randint(0, 32, (n, k), dtype=torch.int8, generator=g)
        offset = -k_quant_scales(n, k // 32, g)
        return pack_q8(codes, scale, offset), codes.double() * expand(scale) + expand(offset)
    if kind == "q8_g16":
        codes = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=g)
        scale16 = k_quant_scales(n, k // 16, g) * torch.randint(-2, 2, (n, k // 16), generator=g).float()
        return pack_q8(codes, scale16, group=16), codes.double() * expand(scale16, 16)
    dense = torch.randn(n, k, generator=g).bfloat16()
    return pack_bf16(dense), dense.double()


def run(packed, x: torch.Tensor, path: str) -> torch.Tensor:
    return packed.run(x.contiguous(), packed.format not in (Q4, Q8), dispatch.PATHS[path])


# N = 40 leaves a partial column block; K = 160 is 5 groups; K = 77 is odd (dense only).
SHAPES = {**{kind: (40, 160) for kind in QUANTIZED}, "q4_k": (40, 512), "q6_k": (40, 512),
          "e2m1": (40, 416), "bf16": (40, 77)}  # e2m1: 256 + 160 columns, a partial last super-block


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_linear_matches_float64_and_every_row_count_gives_the_same_rows(kind, path):
    packed, dense = make_weight(kind, *SHAPES[kind])
    x = torch.randn(70, packed.k, generator=torch.Generator().manual_seed(1)).bfloat16()
    full = run(packed, x, path)
    want = x.double() @ dense.T
    err = ((full.double() - want).abs().max() / want.abs().max()).item()
    assert err <= BOUND[kind], f"{kind} {path}: relative error {err:.2e}"
    for m in range(1, 71):
        assert torch.equal(run(packed, x[:m], path), full[:m]), f"{kind} {path}: rows differ at M={m}"
    # A row's result does not depend on its place in the batch either.
    order = torch.randperm(70, generator=torch.Generator().manual_seed(2))
    assert torch.equal(run(packed, x[order], path), full[order])


@NO_VECTOR
@pytest.mark.parametrize("kind", KINDS)
def test_every_pair_of_paths_agrees_bitwise(kind):
    packed, _ = make_weight(kind, 100, {"bf16": 191, "q4_k": 512, "q6_k": 768}.get(kind, 192), seed=3)
    x = torch.randn(33, packed.k, generator=torch.Generator().manual_seed(4)).bfloat16()
    assert_every_pair_equal({path: (run(packed, x, path),) for path in PATHS})


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def assert_every_pair_equal(results: dict[str, tuple[torch.Tensor, ...]]) -> None:
    """Each path's outputs, bit for bit (NaN payloads included), against every other path's."""
    for (path_a, outs_a), (path_b, outs_b) in itertools.combinations(results.items(), 2):
        for i, (a, b) in enumerate(zip(outs_a, outs_b, strict=True)):
            assert torch.equal(bits(a), bits(b)), f"output {i}: {path_a} and {path_b} differ"


@NO_VECTOR
@pytest.mark.parametrize("kind", KINDS)
def test_paths_agree_where_fused_multiply_adds_would_not_be_exact(kind):
    """The AVX2 path sums by plain FMA only for rows whose exponents make that exact; these rows sit
    on both sides of its bounds (tiny values whose sums go subnormal, huge ones, inf and NaN)."""
    packed, _ = make_weight(kind, 48, 64, seed=6)
    g = torch.Generator().manual_seed(9)
    base = torch.randn(10, 64, generator=g)
    x = torch.cat([base[:2] * 2.0 ** -112, base[2:4] * 2.0 ** -119, base[4:6] * 2.0 ** -124, base[6:8] * 2.0 ** 110,
                   base[8:10]]).bfloat16()
    x[9, 5], x[8, 7] = float("inf"), float("nan")
    x[7, :2] = torch.tensor([2.0 ** -120, -(2.0 ** -120) * (1 + 2 ** -7)])  # cancels to a subnormal
    assert_every_pair_equal({path: (run(packed, x, path),) for path in PATHS})
    if kind == "bf16":  # tiny and huge weights: products that underflow or overflow fp32
        w = torch.randn(48, 64, generator=g) * 2.0 ** torch.randint(-60, 60, (48, 64), generator=g)
        for weight in (w, w * 2.0 ** -70):
            packed = pack_bf16(weight.bfloat16())
            assert_every_pair_equal({path: (run(packed, x, path),) for path in PATHS})


@NO_VECTOR
@pytest.mark.parametrize("seed", range(4))
def test_paths_agree_on_random_bf16_bit_patterns(seed):
    """Weights and rows drawn as raw bf16 bits over the whole range (subnormals, 2^127, inf, NaN
    with payloads) in a narrow exponent band per row, so sums cross fp32's limits often."""
    g = torch.Generator().manual_seed(100 + seed)

    def draw(rows: int, cols: int, exponent_bias: int) -> torch.Tensor:
        sign_mantissa = torch.randint(0, 2 ** 16, (rows, cols), generator=g) & 0x807F
        centre = torch.randint(0, 256, (rows, 1), generator=g)
        exponent = (centre + torch.randint(-6, 7, (rows, cols), generator=g) + exponent_bias).clamp(0, 255)
        return (sign_mantissa | (exponent << 7)).to(torch.int16).view(torch.bfloat16)

    weight = draw(48, 64, 0)
    x = draw(40, 64, 0)
    packed = pack_bf16(weight)
    assert_every_pair_equal({path: (packed.run(x, False, dispatch.PATHS[path]),) for path in PATHS})


@pytest.mark.parametrize("path", PATHS)
def test_each_pair_step_is_vdpbf16ps_as_the_sdm_defines_it(path):
    """Per pair, acc = fma(w_hi, x_hi, acc) then fma(w_lo, x_lo, acc): the product exact (kept at
    full range), one rounding, subnormal inputs read as zero, results that round below 2^-126
    flushed ("FP32 FMA with DAZ in, FTZ out and RNE rounding"). Measured on AMD Zen 4's VDPBF16PS;
    the generic path runs this check on every CPU, ARM included."""
    t = lambda *v: torch.tensor(v, dtype=torch.float32).bfloat16()  # noqa: E731
    # (w_lo, w_hi), (x_lo, x_hi), fp32 result
    cases = [
        # a subnormal product (2^-128) still adds to a normal sum: not flushed on its own
        ((2.0 ** -64, 2.0 ** -63), (2.0 ** -64, 2.0 ** -63), 1.25 * 2.0 ** -126),
        # a product past fp32's range (2^200) is exact; the sum overflows once: inf, not inf - inf
        ((2.0 ** 100, 2.0 ** 100), (-(2.0 ** 100), 2.0 ** 100), float("inf")),
        # 2^-126 - 3 * 2^-152 rounds (unbounded exponent) to 2^-126 - 2^-150: tiny, so flushed to +0,
        # where an IEEE FMA without FTZ rounds it up to 2^-126
        ((1.5 * 2.0 ** -75, 2.0 ** -63), (-(2.0 ** -76), 2.0 ** -63), 0.0),
        # 2^-126 - 2^-160 rounds up to 2^-126 before tininess is judged: kept
        ((2.0 ** -80, 2.0 ** -63), (-(2.0 ** -80), 2.0 ** -63), 2.0 ** -126),
        # a subnormal input is read as zero (DAZ): 2^-130 * 2^10 does not count
        ((2.0 ** 10, 1.0), (2.0 ** -130, 1.0), 1.0),
    ]
    for (w_lo, w_hi), (x_lo, x_hi), want in cases:
        weight = t(w_lo, w_hi).repeat(16, 1)
        x = t(x_lo, x_hi).unsqueeze(0)
        got = pack_bf16(weight).run(x, False, dispatch.PATHS[path])[0, 0].item()
        assert got == want and (got != 0 or str(got) == str(want)), (w_lo, w_hi, x_lo, x_hi, got, want)


def test_bf16_exponent_range_marks_values_the_fast_sums_cannot_take():
    from specserve.kernels.linear import bf16_exponent_range

    assert bf16_exponent_range(torch.tensor([0.0, 1.0, -0.25, 3.0]).bfloat16()) == (125, 128)
    assert bf16_exponent_range(torch.zeros(4, dtype=torch.bfloat16)) == (255, 0)
    for bad in (2.0 ** -130, float("inf"), float("nan")):
        assert bf16_exponent_range(torch.tensor([1.0, bad]).bfloat16()) == (-1, -1)


def attention_case(seed: int = 0, dim: int = 64, kv_heads: int = 3, heads: int = 9):
    g = torch.Generator().manual_seed(seed)
    slots = 300
    k_pool = torch.randn(slots, kv_heads, dim, generator=g).bfloat16()
    v_pool = torch.randn(slots, kv_heads, dim, generator=g).bfloat16()
    table = torch.zeros(3, 256, dtype=torch.int64)
    for r in range(3):
        table[r, :200] = torch.randperm(slots - 1, generator=g)[:200] + 1
    rows = 40
    q = torch.randn(rows, heads, dim, generator=g).bfloat16()
    row_req = torch.randint(0, 3, (rows,), generator=g)
    row_len = torch.randint(1, 201, (rows,), generator=g)
    row_len[-1] = 0  # a padding row
    return q, k_pool, v_pool, table, row_req, row_len, dim ** -0.5


def attention_reference(q, k_pool, v_pool, table, row_req, row_len, scale, window=0, sinks=None):
    """float64 attention; with `sinks` each head's logit joins its softmax, its weight going nowhere."""
    group = q.shape[1] // k_pool.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        n = int(row_len[t])
        if n == 0:
            continue
        slots = table[row_req[t], max(0, n - window) if window else 0:n]
        k = k_pool[slots].double().repeat_interleave(group, 1)
        v = v_pool[slots].double().repeat_interleave(group, 1)
        scores = torch.einsum("hd,lhd->hl", q[t].double(), k) * scale
        if sinks is not None:
            scores = torch.cat([scores, sinks.double().unsqueeze(1)], dim=1)
        weights = scores.softmax(-1)[:, : len(slots)]
        out[t] = torch.einsum("hl,lhd->hd", weights, v)
    return out


@pytest.mark.parametrize("path", PATHS)
def test_attention_sinks_take_their_share_of_each_softmax(path, monkeypatch):
    """gpt-oss's sinks (a logit per head, no value): within bf16 rounding of float64, with and
    without a window; a row alone as in the batch; a sink far below every score changes nothing, and
    dropping the sinks (the bug this guards against) is far off the reference."""
    monkeypatch.setenv(envs.CPU_KERNEL_PATH, path)
    q, k_pool, v_pool, table, row_req, row_len, scale = case = attention_case(seed=7)
    sinks = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(8)) * 3
    for window in (0, 37):
        out = paged_attention(*case, window, sinks)
        want = attention_reference(*case, window, sinks)
        assert (out.double() - want).abs().max().item() <= 1.6e-2, (path, window)
        assert (paged_attention(*case, window).double() - want).abs().max().item() > 0.05, "dropped sinks look right"
        for t in (0, 17):
            alone = paged_attention(q[t:t + 1], k_pool, v_pool, table, row_req[t:t + 1], row_len[t:t + 1], scale, window, sinks)
            assert torch.equal(alone[0], out[t])
    assert torch.equal(paged_attention(*case, 0, torch.full_like(sinks, -1e30)), paged_attention(*case))
    with pytest.raises(RuntimeError, match="sinks must be contiguous float32"):
        paged_attention(*case, 0, sinks[:3])


@pytest.mark.parametrize("dim", [64, 48, 128, 32, 256])
@pytest.mark.parametrize("path", PATHS)
def test_paged_attention_matches_float64_and_rows_are_independent(path, dim, monkeypatch):
    monkeypatch.setenv(envs.CPU_KERNEL_PATH, path)
    case = attention_case(dim=dim)
    q, k_pool, v_pool, table, row_req, row_len, scale = case
    out = paged_attention(*case)
    err = (out.double() - attention_reference(*case)).abs().max().item()
    assert err <= 1.6e-2, f"attention {path}: error {err:.2e} (outputs are bf16)"
    assert not out[-1].any(), "a row that sees no positions must be zero"
    for t in (0, 5, 17, 38):  # alone, and within a different set of rows
        alone = paged_attention(q[t:t + 1], k_pool, v_pool, table, row_req[t:t + 1], row_len[t:t + 1], scale)
        assert torch.equal(alone[0], out[t])
    pick = torch.tensor([30, 2, 17])
    assert torch.equal(paged_attention(q[pick], k_pool, v_pool, table, row_req[pick], row_len[pick], scale), out[pick])


@pytest.mark.parametrize("path", PATHS)
def test_sliding_window_attention_sees_the_last_window_positions(path, monkeypatch):
    monkeypatch.setenv(envs.CPU_KERNEL_PATH, path)
    q, k_pool, v_pool, table, row_req, row_len, scale = attention_case(seed=3)
    window = 37
    out = paged_attention(q, k_pool, v_pool, table, row_req, row_len, scale, window)
    err = (out.double() - attention_reference(q, k_pool, v_pool, table, row_req, row_len, scale, window)).abs().max()
    assert err.item() <= 1.6e-2, f"windowed attention {path}: error {err.item():.2e}"
    short = row_len <= window  # a row shorter than the window sees everything, as without one
    assert torch.equal(out[short], paged_attention(q, k_pool, v_pool, table, row_req, row_len, scale)[short])
    assert not torch.equal(out[~short], paged_attention(q, k_pool, v_pool, table, row_req, row_len, scale)[~short])
    for t in (0, 5, 17):  # alone, as in the batch
        alone = paged_attention(q[t:t + 1], k_pool, v_pool, table, row_req[t:t + 1], row_len[t:t + 1], scale, window)
        assert torch.equal(alone[0], out[t])
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        paged_attention(q, k_pool, v_pool, table, row_req, row_len, scale, -1)


@NO_VECTOR
@pytest.mark.parametrize("group", [3, 7, 12])  # one pass of a group (up to 8 query heads), or two
@pytest.mark.parametrize("dim", [64, 128, 32, 256])
def test_attention_paths_agree_bitwise(dim, group, monkeypatch):
    case = attention_case(seed=5, dim=dim, kv_heads=2, heads=2 * group)
    results = {}
    for path in PATHS:
        monkeypatch.setenv(envs.CPU_KERNEL_PATH, path)
        sinks = torch.linspace(-2.0, 3.0, case[0].shape[1])
        # and with a sliding window, with sinks
        results[path] = (paged_attention(*case), paged_attention(*case, 37), paged_attention(*case, 37, sinks))
    assert_every_pair_equal(results)


def test_dispatched_path_follows_the_cpu_flags(monkeypatch):
    monkeypatch.delenv(envs.CPU_KERNEL_PATH, raising=False)
    flags = dispatch.cpu_flags()
    expected = "avx512_bf16" if AVX512_FLAGS <= flags else "avx2_fma" if {"avx2", "fma"} <= flags else "generic"
    assert dispatch.path_name() == expected


def test_the_environment_switch_forces_a_path_and_rejects_unknown_ones(monkeypatch):
    packed, _ = make_weight("q4", 32, 64)
    x = torch.randn(3, 64).bfloat16()
    monkeypatch.setenv(envs.CPU_KERNEL_PATH, "generic")
    assert dispatch.path_name() == "generic"
    assert torch.equal(packed(x, torch.float32), run(packed, x, "generic"))
    monkeypatch.setenv(envs.CPU_KERNEL_PATH, "amx")
    with pytest.raises(ValueError, match="SPECSERVE_CPU_KERNEL_PATH must be one of"):
        packed(x)
    for path, needs in (("avx512_bf16", "AVX512-BF16"), ("avx2_fma", "AVX2 and FMA")):
        if path not in PATHS:
            monkeypatch.setenv(envs.CPU_KERNEL_PATH, path)
            with pytest.raises(ValueError, match=f"lacks {needs}"):
                packed(x)


def test_bad_arguments_get_clear_errors():
    packed, _ = make_weight("q8", 32, 64)
    with pytest.raises(RuntimeError, match="x must be bf16"):
        load().linear(torch.randn(2, 64), Q8, packed.codes, packed.scale, packed.zero, 32, 64, False, 0)
    with pytest.raises(RuntimeError, match="wrong size"):
        load().linear(torch.randn(2, 64).bfloat16(), Q8, packed.codes[:-1], packed.scale, packed.zero, 32, 64, False, 0)
    with pytest.raises(ValueError, match="divisible by 32"):
        pack_q4(torch.zeros(16, 40, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(16, 1))
    with pytest.raises(ValueError, match="must be float32 values"):
        pack_q8(torch.zeros(16, 32, dtype=torch.int8), torch.full((16, 1), 0.1, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="4, 5 or 6 bits"):
        load().linear(torch.randn(2, 64).bfloat16(), Q8, packed.codes, packed.scale, packed.zero, 32, 64, False, 0, bits=5)
    with pytest.raises(ValueError, match="must be 5-bit"):
        pack_q4(torch.full((16, 32), 40, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(16, 1), bits=5)


def test_fused_small_ops_match_references_and_paths_agree(monkeypatch):
    from specserve.kernels import ops

    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, 200, generator=g).bfloat16()  # 200: not a multiple of 16
    x[0, :4] = torch.tensor([1e-39, -1e-40, 0.0, 1e18]).bfloat16()  # denormals and a large value
    residual = torch.randn(9, 200, generator=g).bfloat16()
    weight = torch.randn(200, generator=g).bfloat16()
    gate_up = (torch.randn(9, 2 * 200, generator=g) * 4).bfloat16()
    results = {}
    for path in PATHS:
        monkeypatch.setenv(envs.CPU_KERNEL_PATH, path)
        res = residual.clone()
        results[path] = (ops.add_rms_norm(x, res, weight, 1e-5), res, ops.add_rms_norm(x, None, weight, 1e-5),
                         ops.silu_mul(gate_up), ops.gelu_tanh_mul(gate_up))
        normed, res, plain, act, gelu = results[path]
        assert torch.equal(res, x + residual)  # the residual add rounds to bf16 like torch's
        for got, base in ((normed, (x + residual)), (plain, x)):
            want = torch.nn.functional.rms_norm(base.double(), (200,), weight.double(), 1e-5)
            assert ((got.double() - want).abs() / (want.abs() + 1e-2)).max() < 2e-2
        gate, up = gate_up.double().chunk(2, dim=-1)
        for got, want in ((act, torch.nn.functional.silu(gate) * up),
                          (gelu, torch.nn.functional.gelu(gate, approximate="tanh") * up)):
            assert ((got.double() - want).abs() / (want.abs() + 1e-2)).max() < 2e-2
        for t in (0, 4, 8):  # one row alone gives the same result
            assert torch.equal(ops.add_rms_norm(x[t:t + 1], None, weight, 1e-5)[0], plain[t])
            assert torch.equal(ops.silu_mul(gate_up[t:t + 1])[0], act[t])
            assert torch.equal(ops.gelu_tanh_mul(gate_up[t:t + 1])[0], gelu[t])
    assert_every_pair_equal(results)


def test_swiglu_oai_matches_the_model_reference_and_paths_agree(monkeypatch):
    """The native mixture's gpt-oss activation: every path the same bits, within bf16 rounding of
    models/moe.py's float32 reference, each row its own; the clamps (gate <= 7, |up| <= 7) hit, a
    NaN sum passed through them as the reference's torch.clamp does (never a clamped value), and
    f = 203 so that the AVX2 path's scalar tail runs too."""
    from specserve.kernels import ops
    from specserve.models.moe import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, swiglu_oai

    f = 203
    g = torch.Generator().manual_seed(9)
    gate_up = torch.randn(9, 2 * f, generator=g) * 6  # beyond the clamps
    bias = torch.randn(2 * f, generator=g)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, -60.0, 3.4e38])
    gate_up[8, :7], gate_up[8, f + 7:f + 14] = special, special  # gates, then ups
    gate_up[8, f:f + 7] = 0.5
    sums = gate_up + bias
    assert (sums[:, :f] > SWIGLU_OAI_LIMIT).any() and (sums[:, f:] < -SWIGLU_OAI_LIMIT).any()
    want = swiglu_oai(sums).double()
    results = {}
    for path in PATHS:
        monkeypatch.setenv(envs.CPU_KERNEL_PATH, path)
        got = ops.swiglu_oai(gate_up, bias, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT)
        assert torch.equal(got.isnan(), want.isnan()), path  # NaN exactly where the reference has it
        finite = ~want.isnan()
        assert ((got.double() - want).abs() / (want.abs() + 1e-2))[finite].max() < 1e-2
        for t in (0, 4, 8):
            assert torch.equal(bits(ops.swiglu_oai(gate_up[t:t + 1], bias, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT)[0]),
                               bits(got[t]))
        results[path] = (got,)
    assert_every_pair_equal(results)


def test_rope_store_rotates_q_and_k_and_stores_k_v():
    from specserve.kernels import ops
    from specserve.models.layers import RotaryEmbedding, apply_rope

    g = torch.Generator().manual_seed(8)
    heads, kv_heads, dim, rows = 6, 2, 32, 5
    rope = RotaryEmbedding(dim, 64, 10000.0)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g).bfloat16()
    positions = torch.tensor([0, 3, 17, 63, 5])
    slots = torch.tensor([4, 1, 7, 2, 9])
    k_pool = torch.zeros(10, kv_heads, dim, dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    q = ops.rope_store(qkv, rope.cos, rope.sin, positions, slots, heads, kv_heads, k_pool, v_pool)
    parts = qkv.double().view(rows, -1, dim)
    cos, sin = rope.cos[positions].double().unsqueeze(1), rope.sin[positions].double().unsqueeze(1)
    rotated = apply_rope(parts[:, :heads + kv_heads], cos, sin)
    assert (q.double() - rotated[:, :heads]).abs().max() < 3e-2
    assert (k_pool[slots].double() - rotated[:, heads:]).abs().max() < 3e-2
    assert torch.equal(v_pool[slots], qkv.view(rows, -1, dim)[:, heads + kv_heads:])
    assert not k_pool[[0, 3, 5, 6, 8]].any()  # no other slot is touched
    with pytest.raises(RuntimeError, match="outside the K/V pool"):
        ops.rope_store(qkv, rope.cos, rope.sin, positions, torch.tensor([4, 1, 7, 2, 10]), heads, kv_heads, k_pool, v_pool)


@NO_VECTOR
def test_paths_agree_on_subnormal_inputs_and_products():
    # VDPBF16PS reads subnormal inputs as zero and flushes subnormal results; the other paths must too.
    weight = torch.ones(16, 2, dtype=torch.bfloat16)
    packed = pack_bf16(weight)
    x = torch.tensor([[2.0 ** -130, 2.0 ** -120], [2.0 ** -65, 2.0 ** -65], [2.0 ** -60, 3.0]]).bfloat16()
    assert_every_pair_equal({path: (run(packed, x, path).float(),) for path in PATHS})
    assert run(packed, x, "generic")[0, 0].item() == 2.0 ** -120  # the subnormal input counted as zero
    # Without the exponent bounds (the binding's default), the AVX2 path flushes every row: same bits.
    raw = lambda path: load().linear(x, BF16, packed.codes, packed.scale, packed.zero, 16, 2, False,  # noqa: E731
                                     dispatch.PATHS[path])
    assert_every_pair_equal({path: (raw(path),) for path in PATHS})


def test_attention_refuses_a_table_slot_outside_the_pool():
    q, k_pool, v_pool, table, row_req, row_len, scale = attention_case()
    bad = table.clone()
    bad[int(row_req[0]), 0] = k_pool.shape[0]
    with pytest.raises(RuntimeError, match="outside the K/V pool"):
        paged_attention(q, k_pool, v_pool, bad, row_req, row_len, scale)


@pytest.mark.parametrize("kind", ["q4_k", "q6_k", "e2m1"])
def test_compact_tables_give_the_bits_of_float32_tables(kind):
    """K-quant tables (int8 x float16 super-values) and offsets computed as -c * scale are storage
    only: every path gives the bits it gives with plain float32 scales and stored offsets, with bf16
    and with integer activations."""
    g = torch.Generator().manual_seed(8)
    if kind == "e2m1":
        codes, scale, offset, supers = e2m1_tables(40, 512, g)
        group, bits = 32, E2M1
    else:
        codes, scale, offset, group, bits, supers = k_quant_tables(kind, 40, 512, g)
    compact = pack_q4(codes, scale, offset, group, bits, supers)
    plain = pack_q4(codes, scale, offset, group, bits)
    stored = dataclasses.replace(plain, zero=plain.group_values(offsets=True).to(plain.scale.dtype), code_offset=0)
    plain_dtype = torch.float16 if kind == "e2m1" else torch.float32  # powers of two are float16 values
    assert compact.scale.dtype == torch.int8 and plain.scale.dtype == stored.zero.dtype == plain_dtype
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(9)).bfloat16()
    for path in PATHS:
        outs = [run(p, x, path) for p in (compact, plain, stored)]
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), path
        int8 = [dataclasses.replace(p) for p in (compact, plain)]
        assert all(p.quantize_activations() for p in int8)
        assert torch.equal(run(int8[0], x, path), run(int8[1], x, path)), path
