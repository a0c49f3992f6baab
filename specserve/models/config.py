"""ModelConfig: the shape of a llama-family decoder, read from GGUF metadata or config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from specserve.errors import ConfigError
from specserve.models import rope_scaling

SUPPORTED_HF_ARCHITECTURES = (
    "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)  # fmt: skip
# Hugging Face's mixtures, as the GGUF architectures the engine names them by.
_HF_MIXTURES = {"Qwen2MoeForCausalLM": "qwen2moe", "Qwen3MoeForCausalLM": "qwen3moe"}


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a llama-family decoder (llama, qwen2, qwen3, mistral without sliding
    window, gemma3)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over each head's q and k before RoPE (qwen3, gemma3)
    architecture: str = "llama"
    # gemma3: norms after attention and after the MLP too, GELU (tanh), embeddings scaled by
    # sqrt(hidden), and sliding-window layers with a RoPE base of their own between global ones.
    sandwich_norms: bool = False
    hidden_act: str = "silu"  # or "gelu_tanh"
    embed_scale: float = 1.0
    layer_windows: tuple[int, ...] = ()  # per layer: the sliding window (0: global); (): every layer global
    rope_local_theta: Optional[float] = 10000.0  # RoPE base of the sliding-window layers (None: the global RoPE)
    rope_freq_factors: Optional[tuple[float, ...]] = None  # RoPE scaling (models/rope_scaling.py)
    rope_attention_factor: float = 1.0  # the scaling's cos/sin magnitude (YaRN)
    # Mixture of experts (qwen3moe, qwen2moe): every layer's MLP is `num_experts` experts of
    # `moe_intermediate_size`, `num_experts_per_tok` of them per token by a softmax router (their
    # weights renormalised to sum to 1 with norm_topk_prob), plus for qwen2moe a shared expert of
    # `shared_expert_intermediate_size` scaled by a sigmoid gate. num_experts 0: a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    # gpt-oss: a learned logit per head that joins every softmax of attention (its "sink") and a
    # bias on the output projection; a mixture whose router and experts have biases, that routes
    # by the softmax of the k largest logits only, and whose experts gate with the clamped SwiGLU
    # (moe_activation "swiglu_oai": gate <= 7, -7 <= up <= 7, (up + 1) * gate * sigmoid(1.702 gate)).
    attention_sinks: bool = False
    attention_out_bias: bool = False
    moe_bias: bool = False
    moe_softmax_after_topk: bool = False
    moe_activation: str = "silu"

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def window(self, layer: int) -> int:
        """The layer's sliding window in positions (0: it sees the whole context)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        if not any(a in SUPPORTED_HF_ARCHITECTURES for a in archs):
            raise ConfigError(
                f"model_path: architecture {archs} is not llama-family; supported: {SUPPORTED_HF_ARCHITECTURES}"
            )
        # transformers >= 5 writes RoPE settings under rope_parameters; older configs use top-level keys.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        mixture = next((_HF_MIXTURES[a] for a in archs if a in _HF_MIXTURES), None)
        is_qwen2 = "Qwen2ForCausalLM" in archs or mixture == "qwen2moe"
        is_qwen3 = "Qwen3ForCausalLM" in archs or mixture == "qwen3moe"
        scaling = rope_scaling.from_hf(rope, float(rope_theta), head_dim)
        config = cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=head_dim,
            vocab_size=cfg["vocab_size"],
            rope_theta=float(rope_theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", is_qwen2)),
            qk_norm=is_qwen3,
            architecture="qwen2" if is_qwen2 else "qwen3" if is_qwen3 else "llama",
            rope_freq_factors=scaling.freq_factors,
            rope_attention_factor=scaling.attention_factor,
        )
        return config if mixture is None else _hf_mixture(config, cfg, mixture)


def _hf_mixture(config: ModelConfig, cfg: dict[str, Any], architecture: str) -> ModelConfig:
    """A Hugging Face mixture's routing and sizes (every layer sparse: dense layers in between are an error)."""
    if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
        raise ConfigError("model_path: a mixture with dense MLP layers between its sparse ones is not supported")
    return dataclasses.replace(
        config,
        architecture=architecture,
        num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),  # transformers 5 writes the latter
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", architecture == "qwen3moe")),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
    )
