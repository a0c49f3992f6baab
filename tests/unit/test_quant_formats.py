"""Every GGUF type the engine keeps as codes (models/quant.py): parsed codes and scales give exactly
the `gguf` package's dequantized weights; the kernels compute with them (float64 reference, every
path bitwise equal, a row alone equals it in a batch); fused parts of different types share one
layout; TP shards split them at 32 columns."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from specserve.kernels import dispatch
from specserve.kernels import linear as linear_module
from specserve.kernels.linear import pack_bf16, pack_codes
from specserve.kernels.pack_reference import pack_codes_reference
from specserve.models.quant import (
    Q4Weight,
    Q8Weight,
    concat_rows,
    is_quantized,
    k_codes,
    k_codes_reference,
    k_scale_min,
    k_scale_min_reference,
    mxfp4_codes,
    mxfp4_codes_reference,
    parse_quantized,
)
from tiny_gguf import random_k_quant

PATHS = ["generic", *(p for p in dispatch.available_paths() if p != "generic")]
LEGACY = ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"]  # the gguf package quantizes to these
K_QUANTS = ["Q4_K", "Q5_K", "Q6_K"]
TABLES = ["MXFP4"]  # 4-bit codes read through a table (E2M1), quantized by the gguf package too
LAYOUT = {"Q8_0": Q8Weight}  # the rest: unsigned codes with offsets (Q4Weight)


def raw_tensor(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """GGUF blocks [rows, bytes] of a random weight: quantized by the gguf package, or random
    K-quant codes with small scales."""
    rng = np.random.default_rng(seed)
    qtype = QType[type_name]
    if type_name in K_QUANTS:
        return random_k_quant(rows, cols, qtype, rng)
    return gguf.quants.quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype)


def reference(raw: np.ndarray, type_name: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, QType[type_name]).astype(np.float32))


@pytest.mark.parametrize("type_name", LEGACY + K_QUANTS + TABLES)
def test_parsed_codes_dequantize_to_the_gguf_packages_weights_exactly(type_name):
    raw = raw_tensor(type_name, 24, 512)
    parsed = parse_quantized(raw, type_name)
    assert is_quantized(type_name)
    assert isinstance(parsed, LAYOUT.get(type_name, Q4Weight))
    assert torch.equal(parsed.dequantize(), reference(raw, type_name))


@pytest.mark.parametrize("type_name", K_QUANTS)
def test_native_k_quant_parsing_is_the_reference_on_any_bytes(type_name):
    """csrc/pack.cpp's one-pass codes and 6-bit scales equal the numpy/gguf definitions on
    arbitrary bytes (every bit pattern of every field), on an odd number of rows."""
    block = gguf.GGML_QUANT_SIZES[QType[type_name]][1]
    raw = np.random.default_rng(5).integers(0, 256, size=(7, 3 * block), dtype=np.uint8)
    assert torch.equal(k_codes(raw, type_name), k_codes_reference(raw, type_name))
    if type_name != "Q6_K":
        for got, want in zip(k_scale_min(raw, type_name), k_scale_min_reference(raw, type_name)):
            np.testing.assert_array_equal(got, want)


def test_native_mxfp4_parsing_is_the_reference_on_any_bytes():
    """The one-pass MXFP4 codes and all-zero blocks equal the numpy definition on arbitrary bytes,
    with zero blocks (+0 and -0 codes) planted among them."""
    raw = np.random.default_rng(6).integers(0, 256, size=(7, 5 * 17), dtype=np.uint8)
    raw[2, 1:17] = 0x88  # every code -0: a zero block
    raw[4, 18:34] = 0x08  # +0 and -0 mixed
    raw[5, 35:51] = 0x80
    raw[5, 40] = 0x81  # one magnitude bit: not zero
    codes, zero = mxfp4_codes(raw)
    want_codes, want_zero = mxfp4_codes_reference(raw)
    assert torch.equal(codes, want_codes)
    np.testing.assert_array_equal(zero, want_zero)
    assert zero[2, 0] and zero[4, 1] and not zero[5, 2]


@pytest.mark.parametrize("bits", [4, 5, 6])
def test_native_packing_is_the_reference_layout(bits):
    codes = torch.randint(0, 1 << bits, (48, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    assert torch.equal(pack_codes(codes, bits), pack_codes_reference(codes, bits))


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "MXFP4"])
def test_a_planted_packing_bug_changes_the_weights_the_kernels_read(type_name, monkeypatch):
    """Mutation: a packer that swaps two lanes' words of one oct gives rows that are no longer the
    file's; the same check passes with the real packer."""
    parsed = parse_quantized(raw_tensor(type_name, 32, 256, seed=6), type_name)
    rows = torch.arange(32)
    assert torch.equal(parsed.packed().dense_rows(rows), parsed.dequantize())
    real = linear_module.pack_codes

    def swapped_lanes(codes: torch.Tensor, bits: int) -> torch.Tensor:
        out = real(codes, bits).clone()
        out[0:4], out[4:8] = out[4:8].clone(), out[0:4].clone()
        return out

    monkeypatch.setattr(linear_module, "pack_codes", swapped_lanes)
    assert not torch.equal(parsed.packed().dense_rows(rows), parsed.dequantize())


@pytest.mark.parametrize("type_name", LEGACY + K_QUANTS + TABLES)
def test_kernels_compute_every_type_from_its_codes(type_name):
    raw = raw_tensor(type_name, 40, 512, seed=1)
    weight = reference(raw, type_name).double()
    packed = parse_quantized(raw, type_name).packed()
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(2)).bfloat16()
    want = x.double() @ weight.T
    outs = {}
    for path in PATHS:
        outs[path] = packed.run(x, False, dispatch.PATHS[path])
        err = ((outs[path].double() - want).abs().max() / want.abs().max()).item()
        assert err <= 1e-5, f"{type_name} {path}: relative error {err:.2e}"
        assert torch.equal(packed.run(x[4:5].contiguous(), False, dispatch.PATHS[path])[0], outs[path][4])
    for path, out in outs.items():
        assert torch.equal(out, outs["generic"]), f"{type_name}: {path} differs from generic"


@pytest.mark.parametrize("types", [["Q4_K", "Q6_K", "Q5_0"], ["Q4_K", "Q6_K", "Q8_0"]])
def test_fused_parts_of_different_types_share_one_layout(types):
    """q (Q4_K), k (Q6_K, scales per 16) and v (Q5_0): 6-bit codes, per 16; with v in Q8_0 (signed
    8-bit codes): an 8-bit weight, per 16, with offsets."""
    parts = [parse_quantized(raw_tensor(t, 16, 256, seed=i), t) for i, t in enumerate(types)]
    fused = concat_rows(parts)
    if "Q8_0" in types:
        assert isinstance(fused, Q8Weight) and fused.group == 16 and fused.offset is not None
    else:
        assert isinstance(fused, Q4Weight) and fused.group == 16 and fused.bits == 6
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5)).bfloat16()
    want = x.double() @ fused.dequantize().double().T
    got = fused.packed().run(x, False, dispatch.PATHS[PATHS[-1]])
    assert ((got.double() - want).abs().max() / want.abs().max()).item() <= 1e-5
    same = concat_rows([parts[0], parts[0]])
    assert isinstance(same, Q4Weight) and torch.equal(same.dequantize(), parts[0].dequantize().repeat(2, 1))


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_1"])
def test_tp_column_shards_are_the_weights_columns(type_name):
    parsed = parse_quantized(raw_tensor(type_name, 16, 512, seed=3), type_name)
    assert torch.equal(parsed.cols(224, 288).dequantize(), parsed.dequantize()[:, 224:])
    with pytest.raises(ValueError, match="multiples of 32"):
        parsed.cols(16, 496)


@pytest.mark.parametrize("type_name", [*LEGACY, *K_QUANTS, *TABLES, "F16"])
def test_rows_read_from_the_packed_layout_are_the_weights_rows(type_name):
    """An embedding lookup in a (tied) head's packed codes gives the dequantized rows exactly."""
    if type_name == "F16":
        dense = torch.randn(40, 77, generator=torch.Generator().manual_seed(4)).bfloat16()
        packed, want = pack_bf16(dense), dense.float()
    else:
        parsed = parse_quantized(raw_tensor(type_name, 40, 256, seed=4), type_name)
        packed, want = parsed.packed(), parsed.dequantize()
    ids = torch.tensor([0, 39, 17, 17, 16, 15, 31])
    assert torch.equal(packed.dense_rows(ids), want[ids])
    # The bf16 lookup in one kernel call (the embedding's): the same rows rounded as torch rounds.
    assert torch.equal(packed.bf16_rows(ids).view(torch.int16), want[ids].bfloat16().view(torch.int16))


def test_bf16_rows_round_ties_to_even_and_keep_subnormals():
    """The lookup's bf16 values are torch's rounding of dense_rows: a Q8_0 scale of 3 * 2^-10 with
    odd codes puts every product on a bf16 tie (381 * 2^-10 has nine significant bits: it rounds to
    the even 380 * 2^-10), and a bf16 table's subnormals stay (the kernels' own stores flush them).
    An id past the table is an error, not a read past the codes."""
    d = 3 * 2**-10
    codes = torch.tensor([127, 125, 123, -127, 101, 0, 1, -1] * 4, dtype=torch.float32)
    packed = Q8Weight.from_dense((codes * d).repeat(16, 1)).packed()
    ids = torch.arange(16)
    got = packed.bf16_rows(ids)
    assert torch.equal(got.view(torch.int16), packed.dense_rows(ids).to(torch.bfloat16).view(torch.int16))
    assert float(got[0, 0]) == 380 * 2**-10 and float(got[0, 3]) == -380 * 2**-10  # ties went to even
    tiny, first = pack_bf16(torch.tensor([[1e-39, -1e-39, 3.0, -0.0]]).bfloat16()), torch.tensor([0])
    assert torch.equal(tiny.bf16_rows(first).view(torch.int16), tiny.dense_rows(first).bfloat16().view(torch.int16))
    assert float(tiny.bf16_rows(first)[0, 0]) != 0.0
    with pytest.raises(RuntimeError, match="outside the weight"):
        packed.bf16_rows(torch.tensor([16]))


def test_q8_of_a_dense_weight_is_ggml_q8_0_bit_for_bit():
    """Q8Weight.from_dense (the drafter's --speculative-draft-weights q8) against the gguf
    package's Q8_0: random rows at several magnitudes, an all-zero block, values halfway between
    two codes and a block of one sign."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((6, 96)) * np.array([[1e-3], [0.05], [1.0], [30.0], [1.0], [1.0]])).astype(np.float32)
    w[4, :32] = 0.0
    w[4, 32:64] = np.arange(32) - 15.5  # d = 1 with the 127 below: every code a tie between two integers
    w[4, 32] = 127.0
    w[5, 64:] = np.abs(w[5, 64:])
    ours = Q8Weight.from_dense(torch.from_numpy(w))
    raw = gguf.quants.quantize(w, QType.Q8_0).reshape(6, 3, 34)
    scales = raw[..., :2].copy().view(np.float16).astype(np.float32).reshape(6, 3)
    codes = raw[..., 2:].copy().view(np.int8).reshape(6, 96)
    assert torch.equal(ours.codes, torch.from_numpy(codes)) and torch.equal(ours.scale, torch.from_numpy(scales))
    assert torch.equal(ours.dequantize(), reference(raw.reshape(6, -1), "Q8_0"))
    halves_to_even = torch.from_numpy(w[4, 32:64]).round().to(torch.int8)  # the rule this test tells apart
    assert not torch.equal(halves_to_even, ours.codes[4, 32:64])


@pytest.mark.parametrize("type_name", LEGACY + K_QUANTS + TABLES)
def test_packed_weights_take_no_more_memory_than_the_files_blocks(type_name):
    """The layout keeps the file's bytes per weight: K-quant scales and offsets as int8 multiples of
    float16 super-values per 256 columns (not float32 values), offsets of -c * scale not stored."""
    raw = raw_tensor(type_name, 32, 1024, seed=6)
    parsed = parse_quantized(raw, type_name)
    packed = parsed.packed()
    assert packed.nbytes() <= raw.nbytes * 1.03, f"{type_name}: {packed.nbytes()} bytes packed for {raw.nbytes} in the file"
    if type_name in K_QUANTS:
        assert packed.scale.dtype == torch.int8 and packed.scale_super.dtype == torch.float16
    if type_name in ("Q4_0", "Q5_0", "Q6_K"):
        assert packed.zero.numel() == 0 and packed.code_offset == 1 << (parsed.bits - 1)
    # the TP shards and fused parts that keep whole super-blocks keep the int8 tables
    shard, fused = parsed.cols(256, 512).packed(), concat_rows([parsed, parsed.rows(slice(0, 16))]).packed()
    assert torch.equal(shard.dense_rows(torch.arange(32)), parsed.dequantize()[:, 256:768])
    assert shard.scale.dtype == fused.scale.dtype == packed.scale.dtype


def test_mxfp4_rows_of_gpt_oss_width_keep_one_byte_tables():
    """gpt-oss's rows are 2880 columns, 11.25 super-blocks of 256: the last one partial. The scales
    still pack as int8 multiples of float16 super-values (the file's 4.25 bits per weight become
    4.31, not float16 tables' 4.5), and the kernels still read the file's weights."""
    raw = raw_tensor("MXFP4", 16, 2880, seed=9)
    parsed = parse_quantized(raw, "MXFP4")
    packed = parsed.packed()
    assert packed.scale.dtype == torch.int8 and packed.nbytes() <= raw.nbytes * 1.02
    assert torch.equal(packed.dense_rows(torch.arange(16)), reference(raw, "MXFP4"))
    # a row-parallel linear takes its columns with cols(): all of them keep the compact tables
    assert parsed.cols(0, 2880).packed().scale.dtype == torch.int8
    assert torch.equal(parsed.cols(256, 2624).dequantize(), parsed.dequantize()[:, 256:])
