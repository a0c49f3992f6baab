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


MOE_SHAPES = {
    # Qwen3-30B-A3B: 48 layers of 128 experts (8 per token) of 768, per-head q/k norms, an untied head.
    "qwen3-30b-a3b": MoeShape("qwen2.5-coder-0.5b-instruct-q4_k_m", "qwen3moe", 48, 2048, 6144, 32, 4, 128, 40960,
                              128, 8, 768, 1e6, 1e-6),  # fmt: skip
}


def use_more_bits(i: int, n: int) -> bool:
    """llama-quantize's choice of the layers whose attn_v and ffn_down get Q6_K in a Q4_K_M file:
    the first and last eighths and every third layer between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def moe_table(donor: GGUFFile, shape: MoeShape, kv_entry) -> tuple[list[bytes], list[TensorInfo]]:
    """The metadata (the shape's keys, then the donor's tokenizer entries) and the Q4_K_M tensor table."""
    a = shape.arch
    keys = {"general.architecture": a, "general.name": "synthetic", "general.file_type": Q4_K_M,
            "general.quantization_version": 2, f"{a}.block_count": shape.layers, f"{a}.context_length": shape.context,
            f"{a}.embedding_length": shape.hidden, f"{a}.feed_forward_length": shape.intermediate,
            f"{a}.attention.head_count": shape.heads, f"{a}.attention.head_count_kv": shape.kv_heads,
            f"{a}.attention.key_length": shape.head_dim, f"{a}.attention.value_length": shape.head_dim,
            f"{a}.rope.freq_base": shape.rope_base, f"{a}.attention.layer_norm_rms_epsilon": shape.rms_eps,
            f"{a}.expert_count": shape.experts, f"{a}.expert_used_count": shape.experts_used,
            f"{a}.expert_feed_forward_length": shape.expert_ff}  # fmt: skip
    entries = [kv_entry(k, v) for k, v in keys.items()]
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


def _info(name: str, dims: tuple[int, ...], qtype: QType) -> TensorInfo:
    return TensorInfo(name, dims, qtype, 0)
