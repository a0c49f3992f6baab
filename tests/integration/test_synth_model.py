"""`specserve bench synth-model` (bench/synth_model.py): a file with another's header byte for byte
and random blocks with sane scales, or a published shape on a donor's table; both load in the
`gguf` reader and in specserve and give finite logits."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from helpers import prefill_logits
from tiny_gguf import TinySpec, write_tiny_gguf

from specserve.bench.synth_model import Shape, check_same_header, shape_table, write_gguf, write_like
from specserve.bench.synth_payload import BLOCK_SCALES, random_payload
from specserve.models.gguf_file import GGUFFile

# Every block type specserve serves, plus F16 and F32 (norms, biases).
TYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_0, "ffn_gate": Q.Q4_0,
         "ffn_up": Q.Q8_0, "ffn_down": Q.Q5_1, "token_embd": Q.Q4_1, "output": Q.F16}


@pytest.fixture(scope="module")
def donor(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("donor") / "donor.gguf")
    write_tiny_gguf(path, TinySpec("qwen2", bias=True, tied=False), TYPES)
    return path


@pytest.fixture(scope="module")
def synthetic(donor, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("synth") / "synthetic.gguf")
    write_like(donor, path, seed=1)
    return path


def test_copy_has_the_donors_header_byte_for_byte(donor, synthetic):
    check_same_header(donor, synthetic)
    a, b = GGUFFile(donor), GGUFFile(synthetic)
    assert a.data_start == b.data_start
    with open(donor, "rb") as f, open(synthetic, "rb") as g:
        assert f.read(a.data_start) == g.read(b.data_start)
    changed = [t.name for t, u in zip(a.tensors, b.tensors) if not np.array_equal(t.data, u.data)]
    assert len(changed) == len(a.tensors), "every tensor's payload is new"


def test_blocks_have_their_scales_in_range_and_values_are_finite(synthetic):
    reader = gguf.GGUFReader(synthetic)
    seen = set()
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        assert np.isfinite(values).all() and np.abs(values).max() < 4, tensor.name
        if tensor.tensor_type in BLOCK_SCALES:
            seen.add(tensor.tensor_type)
            offsets, lo, hi = BLOCK_SCALES[tensor.tensor_type]
            size = gguf.GGML_QUANT_SIZES[tensor.tensor_type][1]
            d = np.ascontiguousarray(tensor.data.reshape(-1, size)[:, offsets[0] : offsets[0] + 2]).view(np.float16)
            d = np.abs(d)  # Q4_0 and Q5_0 draw d's sign (bench/synth_payload.py SIGNED_D)
            assert d.min() >= np.float16(lo) and d.max() <= np.float16(hi), tensor.name
    assert seen == {t for t in TYPES.values() if t in BLOCK_SCALES}


def test_copy_loads_in_specserve_with_finite_logits(synthetic):
    from specserve.engine.engine import Engine

    with Engine(model_path=synthetic, dtype="bfloat16", speculative_algorithm="NONE", max_total_tokens=512) as engine:
        logits = prefill_logits(engine.runner.model, [1, 2, 3, 4, 5])
    assert torch.isfinite(logits).all()


def test_a_changed_header_fails_the_check(donor, tmp_path):
    """Mutation: the check must catch a tensor table that differs (one tensor's type) and metadata
    that differs (one value)."""
    header = GGUFFile(donor, header_only=True)
    infos = list(header.infos)
    infos[3] = type(infos[3])(infos[3].name, infos[3].dims, Q.Q8_0 if infos[3].tensor_type != Q.Q8_0 else Q.Q4_0, 0)
    bad_table = str(tmp_path / "table.gguf")
    write_gguf(bad_table, header.kv_entries, infos, header.alignment, random_payload(0))
    with pytest.raises(RuntimeError, match="tensor table"):
        check_same_header(donor, bad_table)
    from specserve.bench.synth_model import kv_entry

    entries = [kv_entry("general.name", "other") if e == next(x for x in header.kv_entries if b"general.name" in x)
               else e for e in header.kv_entries]
    bad_meta = str(tmp_path / "meta.gguf")
    write_gguf(bad_meta, entries, header.infos, header.alignment, random_payload(0))
    with pytest.raises(RuntimeError, match="metadata"):
        check_same_header(donor, bad_meta)


def test_a_published_shape_on_the_donors_table(donor, tmp_path):
    """--shape: every layer's tensors in the shape's widths, the metadata's sizes replaced, the rest
    (tokenizer, template) kept; written as F16 it loads in specserve (llama-quantize is not run here)."""
    shape = Shape(donor, layers=3, hidden=512, intermediate=768, heads=4, kv_heads=2, head_dim=128, context=1024)
    header = GGUFFile(donor, header_only=True)
    entries, infos = shape_table(header, shape)
    path = str(tmp_path / "shape.gguf")
    write_gguf(path, entries, infos, header.alignment, random_payload(0))
    out = GGUFFile(path)
    assert out.fields["qwen2.block_count"] == 3 and out.fields["qwen2.embedding_length"] == 512
    assert out.fields["qwen2.feed_forward_length"] == 768 and out.fields["general.name"] == "synthetic"
    assert out.fields["tokenizer.ggml.tokens"] == header.fields["tokenizer.ggml.tokens"]
    dims = {t.name: tuple(t.shape) for t in out.tensors}
    assert dims["blk.2.ffn_down.weight"] == (768, 512) and dims["blk.2.attn_k.weight"] == (512, 256)
    assert dims["token_embd.weight"] == (512, header.fields["tokenizer.ggml.tokens"].__len__())
    assert [t.name for t in out.tensors if t.name.startswith("blk.")][0].startswith("blk.0.")
    from specserve.engine.engine import Engine

    with Engine(model_path=path, dtype="bfloat16", speculative_algorithm="NONE", max_total_tokens=512) as engine:
        assert torch.isfinite(prefill_logits(engine.runner.model, [1, 2, 3])).all()


def test_step_bytes_leave_out_the_embedding_table_unless_it_is_the_head(donor, tmp_path):
    """bench/bandwidth.py gguf_step_bytes: what llama.cpp streams per batch-1 step."""
    from specserve.bench.bandwidth import gguf_step_bytes
    from specserve.bench.synth_payload import tensor_bytes

    infos = GGUFFile(donor, header_only=True).infos
    table = next(tensor_bytes(i) for i in infos if i.name == "token_embd.weight")
    assert gguf_step_bytes(donor) == sum(tensor_bytes(i) for i in infos) - table
    tied = str(tmp_path / "tied.gguf")
    write_tiny_gguf(tied, TinySpec("qwen2", bias=True, tied=True), TYPES)
    assert gguf_step_bytes(tied) == sum(tensor_bytes(i) for i in GGUFFile(tied, header_only=True).infos)


def test_a_mixture_shape_is_llama_quantizes_q4_k_m_mix_and_loads(donor, tmp_path):
    """--shape qwen3-30b-a3b: the full table's bytes are the published Q4_K_M file's 17.28 GiB
    (llama-bench's listing), with llama-quantize's Q6_K layers; a thin copy of the same table (2
    layers, small widths) loads in specserve as a mixture with finite logits, and a batch-1 step
    reads a token's share of the experts."""
    from specserve.bench.bandwidth import gguf_step_bytes
    from specserve.bench.synth_model import kv_entry
    from specserve.bench.synth_payload import tensor_bytes
    from specserve.bench.synth_moe import MOE_SHAPES, MoeShape, moe_table, use_more_bits
    from specserve.engine.engine import Engine
    from specserve.models.loader import resolve_model_path

    full = MOE_SHAPES["qwen3-30b-a3b"]
    _, infos = moe_table(GGUFFile(resolve_model_path(full.donor), header_only=True), full, kv_entry)
    assert round(sum(tensor_bytes(i) for i in infos) / 2**30, 2) == 17.28
    six = [i for i in range(full.layers) if use_more_bits(i, full.layers)]
    assert six[:7] == [0, 1, 2, 3, 4, 5, 8] and six[-6:] == [42, 43, 44, 45, 46, 47]
    kinds = {i.name: i.tensor_type for i in infos}
    assert kinds["blk.8.ffn_down_exps.weight"] == Q.Q6_K and kinds["blk.9.ffn_down_exps.weight"] == Q.Q4_K
    thin = MoeShape(donor, "qwen3moe", 2, 256, 512, 4, 2, 64, 1024, 8, 2, 256, 1e6, 1e-6)
    header = GGUFFile(donor, header_only=True)
    entries, thin_infos = moe_table(header, thin, kv_entry)
    path = str(tmp_path / "moe.gguf")
    write_gguf(path, entries, thin_infos, header.alignment, random_payload(0))
    experts = sum(tensor_bytes(i) for i in thin_infos if i.name.endswith("_exps.weight"))
    embedding = next(tensor_bytes(i) for i in thin_infos if i.name == "token_embd.weight")
    assert gguf_step_bytes(path) == sum(tensor_bytes(i) for i in thin_infos) - embedding - experts + experts // 4
    with Engine(model_path=path, dtype="bfloat16", speculative_algorithm="NONE", max_total_tokens=512) as engine:
        cfg = engine.runner.model.config
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (8, 2, 256, True)
        assert torch.isfinite(prefill_logits(engine.runner.model, [1, 2, 3])).all()


def test_gpt_oss_shape_is_ggml_orgs_mxfp4_table_and_loads(donor, tmp_path):
    """--shape gpt-oss-20b: the full table's bytes are ggml-org's MXFP4 file's 11.27 GiB (llama-bench's
    listing) with the release's 201,088 tokens; a thin copy (2 layers, small widths) loads in
    specserve as gpt-oss (sinks, biases, a window on layer 0, YaRN) with finite logits, its padded
    vocabulary read by the tokenizer."""
    from specserve.bench.synth_model import kv_entry
    from specserve.bench.synth_payload import tensor_bytes
    from specserve.bench.synth_moe import MOE_SHAPES, MoeShape, moe_table
    from specserve.engine.engine import Engine
    from specserve.models.loader import resolve_model_path

    full = MOE_SHAPES["gpt-oss-20b"]
    _, infos = moe_table(GGUFFile(resolve_model_path(full.donor), header_only=True), full, kv_entry)
    assert round(sum(tensor_bytes(i) for i in infos) / 2**30, 2) == 11.27
    header = GGUFFile(donor, header_only=True)
    vocab = len(header.fields["tokenizer.ggml.tokens"]) + 100
    thin = MoeShape(donor, "gpt-oss", 2, 256, 256, 4, 2, 64, 1024, 8, 2, 256, 150000.0, 1e-5, vocab=vocab, window=16,
                    yarn=(32.0, 64))  # fmt: skip
    entries, thin_infos = moe_table(header, thin, kv_entry)
    path = str(tmp_path / "gpt-oss.gguf")
    write_gguf(path, entries, thin_infos, header.alignment, random_payload(0))
    with Engine(model_path=path, dtype="bfloat16", speculative_algorithm="NONE", max_total_tokens=512) as engine:
        cfg = engine.runner.model.config
        assert (cfg.architecture, cfg.vocab_size, cfg.layer_windows, cfg.attention_sinks, cfg.moe_bias) == (
            "gpt-oss", vocab, (16, 0), True, True)
        assert engine.tokenizer.vocab_size >= vocab
        assert torch.isfinite(prefill_logits(engine.runner.model, [1, 2, 3])).all()


def _experts_one_row_and_window(donor: str, path: str) -> tuple[float, float]:
    """A thin Qwen3-30B-A3B-like mixture in the Q4_K_M mix (2 layers of 64 experts, 8 per token)
    written by the writer: the distinct experts per layer one row and a 4-row window of random
    tokens route to (bench/offline.py distinct_experts, after 8 cached rows)."""
    from specserve.bench.offline import distinct_experts
    from specserve.bench.synth_model import kv_entry
    from specserve.bench.synth_moe import MoeShape, moe_table
    from specserve.engine.engine import Engine

    shape = MoeShape(donor, "qwen3moe", 2, 256, 512, 4, 2, 64, 1024, 64, 8, 256, 1e6, 1e-6)
    header = GGUFFile(donor, header_only=True)
    entries, infos = moe_table(header, shape, kv_entry)
    assert {Q.Q4_K, Q.Q6_K} <= {i.tensor_type for i in infos}
    write_gguf(path, entries, infos, header.alignment, random_payload(0))
    with Engine(model_path=path, dtype="bfloat16", speculative_algorithm="NONE", max_total_tokens=256) as engine:
        ids = np.random.default_rng(1).integers(0, engine.runner.model.config.vocab_size, size=4).tolist()
        return distinct_experts(engine, ids[:1], 8), distinct_experts(engine, ids, 8)


def test_a_synthetic_mixtures_window_spreads_over_experts_as_a_real_ones(donor, tmp_path, monkeypatch):
    """Zero-mean payloads (bench/synth_payload.py _zero_mean): a 4-row window of random tokens reads
    far more experts than one row (64 experts, 8 per token: about 26 for unrelated rows). Planted, the
    old draw (a K-quant's dmin in d's positive range, its min codes random: every weight about +0.05)
    collapses every token onto the same 8 experts."""
    import specserve.bench.synth_payload as sm

    one, window = _experts_one_row_and_window(donor, str(tmp_path / "zero-mean.gguf"))
    assert one == 8 and window >= 16, (one, window)

    def old_offsets(raw: np.ndarray, qtype: Q, d: np.ndarray) -> None:
        offsets, lo, hi = BLOCK_SCALES[qtype]
        if len(offsets) > 1:
            sm._put_f16(raw, offsets[1], np.random.default_rng(0).uniform(lo, hi, size=raw.shape[0]))

    monkeypatch.setattr(sm, "_zero_mean", old_offsets)
    one, window = _experts_one_row_and_window(donor, str(tmp_path / "old.gguf"))
    assert one == 8 and window <= 9, (one, window)
