"""Full-size mixture-of-experts files for `specserve bench synth-model --shape`, written block by
block: a 30B model's F16 (61 GB) would not fit on disk beside its quantized copy, so the tensor
table takes native `llama-quantize`'s type choices for the mix (src/llama-quant.cpp,
llama_tensor_get_type, for Q4_K_M) and the payload is random blocks with sane scales.

The header is the published config's keys under the mixture's architecture, with the tokenizer
and chat template of a file of its family (the Qwen2.5 donor's 151,936-token vocabulary, which
Qwen3 shares); every figure measured on these files says "synthetic weights".
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as QType

from specserve.errors import ConfigError
from specserve.models.gguf_file import GGUFFile, TensorInfo

Q4_K_M = 15  # general.file_type of a Q4_K_M file (LLAMA_FTYPE_MOSTLY_Q4_K_M)


@dataclass(frozen=True)
class MoeShape:
    """A published mixture-of-experts config (config.json of its release)."""

    donor: str  # a packaged model name or a path: its tokenizer and chat template
    arch: str  # the GGUF architecture
    layers: int
    hidden: int
    intermediate: int  # the dense MLP size the config names (unused by its layers)
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    experts: int
    experts_used: int
    expert_ff: int
    rope_base: float
    rms_eps: float
    vocab: int = 0  # the release's vocabulary (0: the donor's); more tokens are reserved control tokens
    window: int = 0  # gpt-oss: the sliding window of its alternate layers
    yarn: tuple[float, int] = (0.0, 0)  # gpt-oss: YaRN's factor and original context


MOE_SHAPES = {
    # Qwen3-30B-A3B: 48 layers of 128 experts (8 per token) of 768, per-head q/k norms, an untied head.
    "qwen3-30b-a3b": MoeShape("qwen2.5-coder-0.5b-instruct-q4_k_m", "qwen3moe", 48, 2048, 6144, 32, 4, 128, 40960,
                              128, 8, 768, 1e6, 1e-6),  # fmt: skip
    # gpt-oss-20b: 24 layers of 32 experts (4 per token) of 2880, 64 heads of 64, a window of 128 on
    # alternate layers, YaRN x32 over 4096, o200k_harmony's 201,088 tokens (the donor's padded).
    "gpt-oss-20b": MoeShape("qwen2.5-coder-0.5b-instruct-q4_k_m", "gpt-oss", 24, 2880, 2880, 64, 8, 64, 131072,
                            32, 4, 2880, 150000.0, 1e-5, vocab=201088, window=128, yarn=(32.0, 4096)),  # fmt: skip
}
MXFP4_MOE = 38  # general.file_type of ggml-org's gpt-oss files (LLAMA_FTYPE_MOSTLY_MXFP4_MOE)


def shape_keys(shape: MoeShape, file_type: int) -> dict[str, int | float | str]:
    """The published config's metadata keys under the mixture's architecture."""
    a = shape.arch
    return {"general.architecture": a, "general.name": "synthetic", "general.file_type": file_type,
            "general.quantization_version": 2, f"{a}.block_count": shape.layers, f"{a}.context_length": shape.context,
            f"{a}.embedding_length": shape.hidden, f"{a}.feed_forward_length": shape.intermediate,
            f"{a}.attention.head_count": shape.heads, f"{a}.attention.head_count_kv": shape.kv_heads,
            f"{a}.attention.key_length": shape.head_dim, f"{a}.attention.value_length": shape.head_dim,
            f"{a}.rope.freq_base": shape.rope_base, f"{a}.attention.layer_norm_rms_epsilon": shape.rms_eps,
            f"{a}.expert_count": shape.experts, f"{a}.expert_used_count": shape.experts_used,
            f"{a}.expert_feed_forward_length": shape.expert_ff}  # fmt: skip


def use_more_bits(i: int, n: int) -> bool:
    """llama-quantize's choice of the layers whose attn_v and ffn_down get Q6_K in a Q4_K_M file:
    the first and last eighths and every third layer between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def moe_table(donor: GGUFFile, shape: MoeShape, kv_entry) -> tuple[list[bytes], list[TensorInfo]]:
    """The metadata (the shape's keys, then the donor's tokenizer entries) and the Q4_K_M tensor table."""
    if shape.arch == "gpt-oss":
        return gpt_oss_table(donor, shape, kv_entry)
    entries = [kv_entry(k, v) for k, v in shape_keys(shape, Q4_K_M).items()]
    entries += [raw for key, raw in zip(donor.fields, donor.kv_entries) if key.startswith("tokenizer.")]
    vocab = len(donor.fields["tokenizer.ggml.tokens"])
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    infos = [_info("token_embd.weight", (h, vocab), QType.Q4_K)]
    for i in range(shape.layers):
        more = use_more_bits(i, shape.layers)
        p = f"blk.{i}."
        infos += [
            _info(p + "attn_norm.weight", (h,), QType.F32),
            _info(p + "attn_q.weight", (h, q), QType.Q4_K),
            _info(p + "attn_k.weight", (h, kv), QType.Q4_K),
            _info(p + "attn_v.weight", (h, kv), QType.Q6_K if more else QType.Q4_K),
            _info(p + "attn_output.weight", (q, h), QType.Q4_K),
            _info(p + "attn_q_norm.weight", (shape.head_dim,), QType.F32),
            _info(p + "attn_k_norm.weight", (shape.head_dim,), QType.F32),
            _info(p + "ffn_norm.weight", (h,), QType.F32),
            _info(p + "ffn_gate_inp.weight", (h, shape.experts), QType.F32),  # llama-quantize leaves routers
            _info(p + "ffn_gate_exps.weight", (h, shape.expert_ff, shape.experts), QType.Q4_K),
            _info(p + "ffn_up_exps.weight", (h, shape.expert_ff, shape.experts), QType.Q4_K),
            _info(p + "ffn_down_exps.weight", (shape.expert_ff, h, shape.experts), QType.Q6_K if more else QType.Q4_K),
        ]
    infos += [_info("output_norm.weight", (h,), QType.F32), _info("output.weight", (h, vocab), QType.Q6_K)]
    if any(len(i.dims) > 1 and i.dims[0] % 256 and i.tensor_type != QType.F32 for i in infos):
        raise ConfigError(f"synth-model: {shape.arch} rows must be whole K-quant blocks of 256")
    return entries, infos


def gpt_oss_table(donor: GGUFFile, shape: MoeShape, kv_entry) -> tuple[list[bytes], list[TensorInfo]]:
    """gpt-oss as ggml-org's MXFP4 files hold it: MXFP4 experts with float32 biases, Q8_0 attention,
    embedding and head, float32 norms, sinks and router; its keys, then the donor's tokenizer with
    its vocabulary padded to the release's."""
    a, h = shape.arch, shape.hidden
    keys = {**shape_keys(shape, MXFP4_MOE), f"{a}.attention.sliding_window": shape.window,
            f"{a}.rope.scaling.type": "yarn", f"{a}.rope.scaling.factor": shape.yarn[0],
            f"{a}.rope.scaling.original_context_length": shape.yarn[1]}  # fmt: skip
    entries = [kv_entry(k, v) for k, v in keys.items()] + padded_vocabulary(donor, shape.vocab, kv_entry)
    q, kv, ff, e = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.expert_ff, shape.experts
    infos = [_info("token_embd.weight", (h, shape.vocab), QType.Q8_0)]
    for i in range(shape.layers):
        p = f"blk.{i}."
        infos += [_info(p + "attn_norm.weight", (h,), QType.F32)]
        for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            infos += [_info(p + name + ".weight", (h, rows), QType.Q8_0), _info(p + name + ".bias", (rows,), QType.F32)]
        infos += [
            _info(p + "attn_output.weight", (q, h), QType.Q8_0),
            _info(p + "attn_output.bias", (h,), QType.F32),
            _info(p + "attn_sinks.weight", (shape.heads,), QType.F32),
            _info(p + "post_attention_norm.weight", (h,), QType.F32),
            _info(p + "ffn_gate_inp.weight", (h, e), QType.F32),
            _info(p + "ffn_gate_inp.bias", (e,), QType.F32),
        ]
        for name, dims, bias in (("ffn_gate_exps", (h, ff, e), (ff, e)), ("ffn_up_exps", (h, ff, e), (ff, e)),
                                 ("ffn_down_exps", (ff, h, e), (h, e))):  # fmt: skip
            infos += [_info(p + name + ".weight", dims, QType.MXFP4), _info(p + name + ".bias", bias, QType.F32)]
    infos += [_info("output_norm.weight", (h,), QType.F32), _info("output.weight", (h, shape.vocab), QType.Q8_0)]
    return entries, infos


def padded_vocabulary(donor: GGUFFile, vocab: int, kv_entry) -> list[bytes]:
    """The donor's tokenizer entries, its tokens and token types extended to `vocab` with reserved
    control tokens (so the embedding and head have the release's rows)."""
    tokens, types = donor.fields["tokenizer.ggml.tokens"], donor.fields["tokenizer.ggml.token_type"]
    if vocab < len(tokens):
        raise ConfigError(f"synth-model: the donor has {len(tokens)} tokens, more than {vocab}")
    extra = range(vocab - len(tokens))
    padded = {
        "tokenizer.ggml.tokens": [*tokens, *(f"<|reserved_synthetic_{i}|>" for i in extra)],
        "tokenizer.ggml.token_type": [*types, *(3 for _ in extra)],
    }
    return [
        kv_entry(key, padded[key]) if key in padded else raw
        for key, raw in zip(donor.fields, donor.kv_entries)
        if key.startswith("tokenizer.")
    ]


def _info(name: str, dims: tuple[int, ...], qtype: QType) -> TensorInfo:
    return TensorInfo(name, dims, qtype, 0)
