"""Tiny random models written to GGUF files, one per architecture the engine reads, in the tensor
types real files use (the `gguf` package writes them; K-quant blocks are random codes with small
scales, since the package cannot quantize to them).

The vocabulary is GPT-2's 256 byte symbols, three merges and ChatML's control tokens: enough for the engine's
tokenizer to load from the file; the tests feed token ids."""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from specserve.tokenizer.tokenizer import _byte_decoder

MERGES = ("Ġ t", "Ġ a", "h e")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Byte offsets of the float16 scales (d, dmin) in one K-quant block; the rest are random codes.
K_QUANT_SCALES = {QType.Q2_K: (80, 82), QType.Q3_K: (108,), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,)}
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny model: hidden and intermediate sizes are multiples of 256 (K-quant blocks)."""

    arch: str
    hidden: int = 256
    intermediate: int = 512
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    rope_base: float = 10000.0
    context: int = 512
    bias: bool = False  # Q/K/V biases (qwen2)
    tied: bool = True  # no output.weight: the head is the embedding
    head_dim: int = 0  # 0: hidden // heads (qwen3 sets its own, with per-head q/k norms)
    qk_norm: bool = False
    sandwich: bool = False  # gemma3: norms after attention and after the MLP too
    window: int = 0  # gemma3: the sliding window of its local layers
    rope_freqs: tuple[float, ...] = ()  # llama: RoPE frequency factors (Llama 3.1's scaling), as `rope_freqs.weight`
    yarn: tuple[float, ...] = ()  # (factor, original context): rope.scaling.type = yarn with those keys
    experts: int = 0  # a mixture of experts (qwen3moe, qwen2moe): experts per layer, in place of the MLP
    experts_used: int = 0
    expert_ff: int = 0  # each expert's intermediate size
    shared_ff: int = 0  # qwen2moe: the shared expert's intermediate size (0: none)
    # gpt-oss: attention sinks, biases on the output projection, router and experts; its norm before
    # the MLP is named post_attention_norm
    gpt_oss: bool = False

    @property
    def vocab(self) -> int:
        return 256 + len(MERGES) + len(SPECIALS)


# Qwen3-30B-A3B Q4_K_M's expert types (the shared expert's as a qwen2moe file's).
MOE_TYPES = {"ffn_gate_exps": QType.Q4_K, "ffn_up_exps": QType.Q4_K, "ffn_down_exps": QType.Q6_K,
             "ffn_gate_shexp": QType.Q4_K, "ffn_up_shexp": QType.Q5_K, "ffn_down_shexp": QType.Q6_K}  # fmt: skip
# Tiny mixtures: 4 of 8 experts per token (renormalised), and 2 of 8 plus a gated shared expert.
QWEN3_MOE = TinySpec("qwen3moe", head_dim=128, qk_norm=True, rope_base=1e6, experts=8, experts_used=4, expert_ff=256)
QWEN2_MOE = TinySpec("qwen2moe", bias=True, rope_base=1e6, experts=8, experts_used=2, expert_ff=256, shared_ff=512)
# gpt-oss: MXFP4 experts (as ggml-org's files), 2 of 8 per token, a window of 6 on layers 0 and 2,
# YaRN over an original context of 8 (the prompts pass it); its other weights Q8_0 as those files'.
GPT_OSS_TYPES = {"ffn_gate_exps": QType.MXFP4, "ffn_up_exps": QType.MXFP4, "ffn_down_exps": QType.MXFP4,
                 "attn_q": QType.Q8_0, "attn_k": QType.Q8_0, "attn_v": QType.Q8_0, "attn_output": QType.Q8_0,
                 "token_embd": QType.Q8_0, "output": QType.Q8_0}  # fmt: skip
GPT_OSS = TinySpec("gpt-oss", layers=3, head_dim=64, bias=True, tied=False, window=6, rope_base=150000.0,
                   yarn=(4.0, 8), experts=8, experts_used=2, expert_ff=256, gpt_oss=True)  # fmt: skip


def transformers_reference(path: str):
    """transformers' float32 model of a GGUF written here; its reader skips a mixture's expert
    sizes (it would take its config's defaults), so they are passed from the file's keys."""
    import os

    import torch
    import transformers

    from specserve.models.loader import load_model_config

    cfg = load_model_config(path)
    if cfg.architecture == "gpt-oss":
        return _gpt_oss_reference(path)
    sizes = {"moe_intermediate_size": cfg.moe_intermediate_size} if cfg.is_moe else {}
    if cfg.shared_expert_intermediate_size:
        sizes["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32, **sizes
    ).eval()


def _gpt_oss_reference(path: str):
    """transformers' GptOss model (float32) with the file's weights: its GGUF reader does not map
    llama.cpp's gpt-oss tensors (split gate and up experts, their biases, attn_sinks), so the
    weights are read by the gguf package (`gguf.quants.dequantize`) and put in transformers'
    layout: gate and up interleaved by column, experts stacked and transposed."""
    import gguf as gguf_package
    import torch
    import transformers

    from specserve.models.loader import load_model_config

    cfg = load_model_config(path)
    reader = gguf_package.GGUFReader(path)
    t = {r.name: torch.from_numpy(gguf_package.quants.dequantize(r.data, r.tensor_type).astype(np.float32)) for r in reader.tensors}
    window = next((w for w in cfg.layer_windows if w), 0)
    config = transformers.GptOssConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        sliding_window=window, max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        attention_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": True, "rope_theta": cfg.rope_theta},
    )  # fmt: skip
    model = transformers.GptOssForCausalLM(config).eval()
    state = {"model.embed_tokens.weight": t["token_embd.weight"], "model.norm.weight": t["output_norm.weight"],
             "lm_head.weight": t["output.weight"]}  # fmt: skip
    for i in range(cfg.num_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
            state[f"{p}self_attn.{theirs}.weight"] = t[f"{b}{ours}.weight"]
            state[f"{p}self_attn.{theirs}.bias"] = t[f"{b}{ours}.bias"]
        state[f"{p}self_attn.sinks"] = t[f"{b}attn_sinks.weight"]
        state[f"{p}input_layernorm.weight"] = t[f"{b}attn_norm.weight"]
        state[f"{p}post_attention_layernorm.weight"] = t[f"{b}post_attention_norm.weight"]
        state[f"{p}mlp.router.weight"], state[f"{p}mlp.router.bias"] = t[f"{b}ffn_gate_inp.weight"], t[f"{b}ffn_gate_inp.bias"]
        gate, up = t[f"{b}ffn_gate_exps.weight"], t[f"{b}ffn_up_exps.weight"]  # [E, f, hidden]
        gate_up = torch.stack([gate, up], dim=2).reshape(gate.shape[0], -1, gate.shape[2])  # rows gate0, up0, gate1, ...
        state[f"{p}mlp.experts.gate_up_proj"] = gate_up.transpose(1, 2).contiguous()
        bias = torch.stack([t[f"{b}ffn_gate_exps.bias"], t[f"{b}ffn_up_exps.bias"]], dim=2)
        state[f"{p}mlp.experts.gate_up_proj_bias"] = bias.reshape(bias.shape[0], -1)
        state[f"{p}mlp.experts.down_proj"] = t[f"{b}ffn_down_exps.weight"].transpose(1, 2).contiguous()
        state[f"{p}mlp.experts.down_proj_bias"] = t[f"{b}ffn_down_exps.bias"]
    model.load_state_dict({k: v.reshape(model.state_dict()[k].shape) for k, v in state.items()}, strict=True)
    return model


def random_k_quant(rows: int, cols: int, qtype: QType, rng: np.random.Generator) -> np.ndarray:
    """Random codes of a K-quant tensor [rows, cols] with every block's scales set small and finite."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in K_QUANT_SCALES[qtype]:
        scale = rng.uniform(1e-4, 4e-4, size=(rows, cols // block)).astype(np.float16)
        raw[:, :, offset : offset + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def _add_tensor(writer: gguf.GGUFWriter, name: str, value: np.ndarray, qtype: QType, rng: np.random.Generator) -> None:
    if qtype in (QType.F32, QType.F16):
        writer.add_tensor(name, value.astype(np.float32 if qtype == QType.F32 else np.float16))
    elif qtype in K_QUANT_SCALES:  # a stacked expert tensor [experts, rows, cols] as rows of all
        *stack, rows, cols = value.shape
        raw = random_k_quant(int(np.prod(stack, dtype=np.int64)) * rows, cols, qtype, rng)
        writer.add_tensor(name, raw.reshape(*stack, rows, -1), raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(value.astype(np.float32), qtype), raw_dtype=qtype)


def _add_tokenizer(writer: gguf.GGUFWriter, pre: str) -> None:
    symbols = sorted(_byte_decoder(), key=_byte_decoder().__getitem__)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    merged = [m.replace(" ", "") for m in MERGES]
    writer.add_token_list([*symbols, *merged, *SPECIALS])
    writer.add_token_types([1] * (len(symbols) + len(merged)) + [3] * len(SPECIALS))
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(256 + len(MERGES))
    writer.add_eos_token_id(256 + len(MERGES) + 2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)


def write_tiny_gguf(path: str, spec: TinySpec, types: dict[str, QType], seed: int = 0, pre: str = "qwen2") -> None:
    """A random `spec` model at `path`; `types` maps a weight's GGUF short name (attn_q, ffn_down,
    token_embd, output, ...) to its tensor type (F32 where not named). Norms and biases are F32."""
    rng = np.random.default_rng(seed)
    head_dim = spec.head_dim or spec.hidden // spec.heads
    writer = gguf.GGUFWriter(path, spec.arch)
    if spec.head_dim:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_name(f"tiny {spec.arch}")
    writer.add_block_count(spec.layers)
    writer.add_context_length(spec.context)
    writer.add_embedding_length(spec.hidden)
    writer.add_feed_forward_length(spec.intermediate)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_rope_freq_base(spec.rope_base)
    if spec.yarn:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(spec.yarn[0])
        writer.add_rope_scaling_orig_ctx_len(int(spec.yarn[1]))
    writer.add_layer_norm_rms_eps(1e-6)
    if spec.window:
        writer.add_sliding_window(spec.window)
    if spec.experts:
        writer.add_expert_count(spec.experts)
        writer.add_expert_used_count(spec.experts_used)
        writer.add_expert_feed_forward_length(spec.expert_ff)
        if spec.shared_ff:
            writer.add_expert_shared_feed_forward_length(spec.shared_ff)
    _add_tokenizer(writer, pre)

    def weight(name: str, short: str, rows: int, cols: int, std: float = 0.08, experts: int = 0) -> None:
        size = (experts, rows, cols) if experts else (rows, cols)
        _add_tensor(writer, name, rng.normal(0, std, size=size), types.get(short, QType.F32), rng)

    def norm(name: str, size: int) -> None:
        writer.add_tensor(name, (1 + rng.normal(0, 0.1, size=size)).astype(np.float32))

    weight("token_embd.weight", "token_embd", spec.vocab, spec.hidden, std=0.5)
    for i in range(spec.layers):
        kv = spec.kv_heads * head_dim
        norm(f"blk.{i}.attn_norm.weight", spec.hidden)
        for short, rows in (("attn_q", spec.heads * head_dim), ("attn_k", kv), ("attn_v", kv)):
            weight(f"blk.{i}.{short}.weight", short, rows, spec.hidden)
            if spec.bias:
                writer.add_tensor(f"blk.{i}.{short}.bias", rng.normal(0, 0.1, size=rows).astype(np.float32))
        if spec.qk_norm:
            norm(f"blk.{i}.attn_q_norm.weight", head_dim)
            norm(f"blk.{i}.attn_k_norm.weight", head_dim)
        weight(f"blk.{i}.attn_output.weight", "attn_output", spec.hidden, spec.heads * head_dim)
        if spec.gpt_oss:
            writer.add_tensor(f"blk.{i}.attn_output.bias", rng.normal(0, 0.1, size=spec.hidden).astype(np.float32))
            writer.add_tensor(f"blk.{i}.attn_sinks.weight", rng.normal(0, 1.0, size=spec.heads).astype(np.float32))
        norm(f"blk.{i}.post_attention_norm.weight" if spec.gpt_oss else f"blk.{i}.ffn_norm.weight", spec.hidden)
        if spec.sandwich:
            norm(f"blk.{i}.post_attention_norm.weight", spec.hidden)
            norm(f"blk.{i}.post_ffw_norm.weight", spec.hidden)
        if spec.experts:
            _add_experts(writer, spec, i, weight, rng)
            continue
        weight(f"blk.{i}.ffn_gate.weight", "ffn_gate", spec.intermediate, spec.hidden)
        weight(f"blk.{i}.ffn_up.weight", "ffn_up", spec.intermediate, spec.hidden)
        weight(f"blk.{i}.ffn_down.weight", "ffn_down", spec.hidden, spec.intermediate)
    norm("output_norm.weight", spec.hidden)
    if spec.rope_freqs:
        writer.add_tensor("rope_freqs.weight", np.array(spec.rope_freqs, dtype=np.float32))
    if not spec.tied:
        weight("output.weight", "output", spec.vocab, spec.hidden, std=0.5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_experts(writer: gguf.GGUFWriter, spec: TinySpec, i: int, weight, rng: np.random.Generator) -> None:
    """Layer i's mixture: the router, the stacked experts (types named ffn_gate_exps, ffn_up_exps,
    ffn_down_exps) and qwen2moe's shared expert with its gate vector."""
    router = rng.normal(0, 0.5, size=(spec.experts, spec.hidden)).astype(np.float32)  # spread-out routing
    writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", router)
    if spec.gpt_oss:
        writer.add_tensor(f"blk.{i}.ffn_gate_inp.bias", rng.normal(0, 0.5, size=spec.experts).astype(np.float32))
    # gpt-oss's experts are larger so that its clamp (|gate|, |up| <= 7) bites on some values
    std = 0.5 if spec.gpt_oss else 0.08
    weight(f"blk.{i}.ffn_gate_exps.weight", "ffn_gate_exps", spec.expert_ff, spec.hidden, std=std, experts=spec.experts)
    weight(f"blk.{i}.ffn_up_exps.weight", "ffn_up_exps", spec.expert_ff, spec.hidden, std=std, experts=spec.experts)
    weight(f"blk.{i}.ffn_down_exps.weight", "ffn_down_exps", spec.hidden, spec.expert_ff, experts=spec.experts)
    if spec.gpt_oss:
        for name, size in (("ffn_gate_exps", spec.expert_ff), ("ffn_up_exps", spec.expert_ff), ("ffn_down_exps", spec.hidden)):
            bias = rng.normal(0, 0.5, size=(spec.experts, size)).astype(np.float32)
            writer.add_tensor(f"blk.{i}.{name}.bias", bias)
    if spec.shared_ff:
        writer.add_tensor(f"blk.{i}.ffn_gate_inp_shexp.weight", rng.normal(0, 0.5, size=spec.hidden).astype(np.float32))
        weight(f"blk.{i}.ffn_gate_shexp.weight", "ffn_gate_shexp", spec.shared_ff, spec.hidden)
        weight(f"blk.{i}.ffn_up_shexp.weight", "ffn_up_shexp", spec.shared_ff, spec.hidden)
        weight(f"blk.{i}.ffn_down_shexp.weight", "ffn_down_shexp", spec.hidden, spec.shared_ff)
