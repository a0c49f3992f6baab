"""A llama-family decoder (llama, qwen2, qwen3, gemma3, SmolLM, and the mixtures qwen2moe, qwen3moe,
gpt-oss) over the paged KV pool."""

from __future__ import annotations

import functools
from typing import Any, Mapping, Optional

import torch
from torch import nn

from specserve.kernels.build import load
from specserve.kv.pool import KVPool
from specserve.models.backend import OpBackend, TorchOps
from specserve.models.config import ModelConfig
from specserve.models.forward_batch import ForwardBatch
from specserve.models.layers import ColumnParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear, TPContext, release
from specserve.models.moe import GatedMLP, SparseMoeBlock
from specserve.models.native_layer import NativeLayers, native_linear
from specserve.models.packed_cache import PackedWeightCache
from specserve.models.quant import QuantSource, QuantWeight
from specserve.models.vocab_layers import ParallelLMHead, VocabParallelEmbedding


class LlamaAttention(nn.Module):
    """GQA self-attention: fused column-parallel QKV, RoPE with the K/V store, paged attention,
    row-parallel output."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPContext, dtype: torch.dtype):
        super().__init__()
        self.layer_id = layer_id
        # Ranks own whole KV heads with their query groups (uneven when tp_size does not divide them).
        kv_start, self.num_kv_heads = tp.split(cfg.num_kv_heads)
        group, d = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        self.num_heads = self.num_kv_heads * group
        self.head_dim = d
        self.scale = d**-0.5
        self.window = cfg.window(layer_id)  # 0: global attention
        q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
        q_rows, kv_rows = (kv_start * group * d, self.num_heads * d), (kv_start * d, self.num_kv_heads * d)
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, [q, kv, kv], cfg.attention_bias, tp, dtype, ranges=[q_rows, kv_rows, kv_rows]
        )
        self.o_proj = RowParallelLinear(q, cfg.hidden_size, cfg.attention_out_bias, tp, dtype, cols=q_rows)
        # gpt-oss: this rank's heads' sink logits, kept in float32 as the file has them
        self.sinks = torch.zeros(self.num_heads) if cfg.attention_sinks else None
        self.head_start = kv_start * group
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None

    def forward(
        self, hidden: torch.Tensor, fb: ForwardBatch, kv: KVPool, rope: RotaryEmbedding, ops: OpBackend
    ) -> torch.Tensor:
        k_pool, v_pool = kv.k[self.layer_id], kv.v[self.layer_id]
        qkv = self.qkv_proj(hidden)
        if self.q_norm is not None and self.k_norm is not None:
            qkv = self._norm_heads(qkv, self.q_norm, self.k_norm, ops)
        q = ops.rope_store(qkv, fb.positions, fb.out_cache_loc, self.num_heads, self.num_kv_heads, rope, k_pool, v_pool)
        out = fb.attn.attend(q, k_pool, v_pool, self.scale, self.window, self.sinks)
        return self.o_proj(out.reshape(out.shape[0], -1))

    def _norm_heads(self, qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, ops: OpBackend) -> torch.Tensor:
        """qkv with each head of q and of k RMS-normalised over its head_dim (one row per head, so
        every token's result is its own)."""
        q_size, k_size, d = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.head_dim
        q, k, v = qkv.split([q_size, k_size, k_size], dim=-1)
        q = ops.rms_norm(q.reshape(-1, d), q_norm).reshape(q.shape)
        k = ops.rms_norm(k.reshape(-1, d), k_norm).reshape(k.shape)
        return torch.cat([q, k, v], dim=-1)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks over a residual stream kept apart from each block's output:
    the layer adds its input `out` into `residual` (in place) in its first norm and returns its MLP
    output, which the next layer (or the final norm) adds in turn. With sandwich norms (gemma3) each
    block's output is normalised too before it joins the residual stream; `post_attention_layernorm`
    is then that norm after attention, and `pre_feedforward_layernorm` the one before the MLP."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPContext, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, layer_id, tp, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp: GatedMLP | SparseMoeBlock = (
            SparseMoeBlock(cfg, tp, dtype)
            if cfg.is_moe
            else GatedMLP(cfg.hidden_size, cfg.intermediate_size, tp, dtype, gelu=cfg.hidden_act == "gelu_tanh")
        )
        sandwich = cfg.sandwich_norms
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if sandwich else None
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if sandwich else None

    def forward(
        self,
        out: Optional[torch.Tensor],
        residual: torch.Tensor,
        fb: ForwardBatch,
        kv: KVPool,
        rope: RotaryEmbedding,
        ops: OpBackend,
    ) -> torch.Tensor:
        attn = self.self_attn(ops.add_rms_norm(out, residual, self.input_layernorm), fb, kv, rope, ops)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            return self.mlp(ops.add_rms_norm(attn, residual, self.post_attention_layernorm), ops)
        attn = ops.rms_norm(attn, self.post_attention_layernorm)
        mlp = self.mlp(ops.add_rms_norm(attn, residual, self.pre_feedforward_layernorm), ops)
        return ops.rms_norm(mlp, self.post_feedforward_layernorm)

    def native(self) -> Any:
        """This layer's C++ twin (kernels/csrc/decoder_layer.cpp), packed for the CPU kernels: the
        kernels `forward` calls on CpuKernelOps, in its order (built here, where the layer's parts
        are known, so models/native_layer.py needs no model)."""
        attn, mlp = self.self_attn, self.mlp
        norms = [
            self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
            self.post_feedforward_layernorm, attn.q_norm, attn.k_norm,
        ]  # fmt: skip
        eps = {n.eps for n in norms if n is not None}
        assert len(eps) == 1, f"one epsilon for every norm of a layer, got {sorted(eps)}"
        bias, gelu = attn.qkv_proj.bias, isinstance(mlp, GatedMLP) and mlp.gelu
        o_bias = attn.o_proj.bias
        return load().DecoderLayer(
            native_linear(attn.qkv_proj.kernel), None if bias is None else bias.detach(), native_linear(attn.o_proj.kernel),
            *_native_mlp(mlp), [None if n is None else n.weight.detach() for n in norms],
            attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale, attn.window, gelu, eps.pop(),
            attn.sinks, None if o_bias is None else o_bias.detach(),
        )  # fmt: skip


def _native_mlp(mlp: GatedMLP | SparseMoeBlock) -> tuple[Any, Any, Any]:
    """The native layer's gate_up, down and moe arguments: a dense MLP's two linears, or a mixture."""
    if isinstance(mlp, SparseMoeBlock):
        return None, None, mlp.native()
    return native_linear(mlp.gate_up_proj.kernel), native_linear(mlp.down_proj.kernel), None


def _loads_dense(module: nn.Module, dense: bool) -> bool:
    """`dense`; if False, `module` gives up its (unloaded) weight until it is packed, so a read fails
    rather than finding uninitialised memory."""
    if not dense:
        weight = module.weight
        assert isinstance(weight, torch.Tensor), "linears and embeddings hold a weight"
        module.weight = release(weight)
    return dense


def _source(codes: Mapping[str, QuantWeight], name: str) -> QuantSource:
    """A weight's codes read when called (a GGUF's are parsed from the file then, loader.GGUFCodes)."""
    return functools.partial(codes.__getitem__, name)


class LlamaForCausalLM(nn.Module):
    """The target model. forward() writes K/V for the batch's new tokens and returns float32 logits
    of `fb.logit_rows`; with `fb.capture_layer_ids` it also leaves those layers' outputs (every row)
    in `fb.captured_hidden` for the DSpark drafter. Its ops run on `self.ops` (stock torch until
    `use_backend` readies the loaded weights for another backend)."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        tp: TPContext | None = None,
        max_positions: int | None = None,
        lazy_rope: bool = False,
    ):
        super().__init__()
        tp = tp or TPContext()
        self.config = cfg
        self.dtype = dtype
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype, cfg.embed_scale)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, tp, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        positions = max_positions or cfg.max_position_embeddings
        # lazy_rope: the tables grow with the positions a pass reaches (read on the host: CPU only)
        self.lazy_rope = lazy_rope
        self.rope = RotaryEmbedding(
            cfg.head_dim, positions, cfg.rope_theta, cfg.rope_freq_factors, lazy_rope, cfg.rope_attention_factor
        )
        local_theta = cfg.rope_local_theta  # None: the windowed layers share the global RoPE (gpt-oss)
        windowed = any(cfg.window(i) for i in range(cfg.num_layers))
        self.rope_local = (
            RotaryEmbedding(cfg.head_dim, positions, local_theta, lazy=lazy_rope)
            if windowed and local_theta is not None
            else self.rope
        )
        self.ops: OpBackend = TorchOps(dtype)
        self.tp_size = tp.size
        self.native: Optional[NativeLayers] = None  # the layers as one C++ call each (use_backend)
        self._tied_head = False  # the head is the embedding (set by load_weights)
        self.weight_cache: Optional[PackedWeightCache] = None  # set by use_backend

    def use_backend(self, ops: OpBackend, cache: Optional[PackedWeightCache] = None) -> None:
        """Run on `ops` from now on (after load_weights: it packs the weights it needs, or maps
        them from `cache` where an earlier start kept them)."""
        ops.prepare(self, cache)
        self.weight_cache = cache  # its background save is waited for when the engine closes
        if self._tied_head and self.lm_head.kernel is not None:  # one copy of the codes: the head's
            self.embed_tokens.read_from(self.lm_head.kernel)
        self.ops = ops
        # The model builds its own native twin (the backend knows ops, not models).
        fuses = ops.fuses_layers and self.tp_size == 1
        self.native = NativeLayers.build(list(self.layers)) if fuses else None

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, kv: KVPool) -> torch.Tensor:
        if self.lazy_rope and fb.positions.numel():
            # The host's bound where the caller knows one: reading the positions would wait for the device.
            top = fb.position_bound if fb.position_bound is not None else int(fb.positions.max()) + 1
            self.rope.cover(top)
            self.rope_local.cover(top)
        residual = self.embed_tokens(fb.input_ids)
        native = self.native if self.native is not None and self.native.applies(fb) else None
        out: Optional[torch.Tensor]
        if native is not None:  # the drafter's context: the captured layers' outputs for every row, side by side
            out, fb.captured_hidden = native.forward(fb, kv, residual, self.rope, self.rope_local)
        else:
            out, captured = self._per_op_layers(fb, kv, residual)
            fb.captured_hidden = torch.cat(captured, dim=-1) if captured else None
        assert out is not None, "the model has layers"
        rows = fb.logit_rows
        return self.lm_head(self.ops.add_rms_norm(out[rows].contiguous(), residual[rows].contiguous(), self.norm))

    def _per_op_layers(
        self, fb: ForwardBatch, kv: KVPool, residual: torch.Tensor
    ) -> tuple[Optional[torch.Tensor], list[torch.Tensor]]:
        """The layers op by op (the native layers' reference): the last MLP output and the
        captured layers' outputs (their MLP's plus the residual stream), in layer order."""
        out, captured = None, []
        for i, layer in enumerate(self.layers):
            rope = self.rope_local if self.config.window(i) else self.rope
            out = layer(out, residual, fb, kv, rope, self.ops)
            if i in fb.capture_layer_ids:
                captured.append(out + residual)
        return out, captured

    @staticmethod
    def _load_quantized(layer: "LlamaDecoderLayer", p: str, quantized: Mapping[str, QuantWeight]) -> None:
        """Point the attention's linears at their codes (each read only when the layer is packed; the
        MLP takes its own in its load_weights)."""
        qkv = [f"{p}self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj")]
        if all(n in quantized for n in qkv):
            layer.self_attn.qkv_proj.load_quantized([_source(quantized, n) for n in qkv])
        if f"{p}self_attn.o_proj.weight" in quantized:
            layer.self_attn.o_proj.load_quantized(_source(quantized, f"{p}self_attn.o_proj.weight"))

    def load_weights(
        self,
        weights: Mapping[str, torch.Tensor],
        quantized: Optional[Mapping[str, QuantWeight]] = None,
        dense_quantized: bool = True,
    ) -> None:
        """Load full (unsharded) Hugging Face-named weights; each layer keeps its own shard.

        `quantized` optionally gives GGUF-quantized (Q4/Q8) codes of some weights; a fused linear takes
        them only when every part has them, and uses them only once packed for CPU in bf16. Without
        `dense_quantized` (the backend packs codes: OpBackend.packs_codes) a linear that took codes,
        and an embedding read from them, never reads its dense weight, so a lazily loaded file
        (loader.LazyWeights) never dequantizes it.
        """
        w, codes = weights, quantized or {}
        head = "lm_head.weight" if "lm_head.weight" in w else "model.embed_tokens.weight"
        self._tied_head = head == "model.embed_tokens.weight"
        if head in codes:
            self.lm_head.load_quantized(_source(codes, head))
        if not self._tied_head and "model.embed_tokens.weight" in codes:
            self.embed_tokens.load_quantized(_source(codes, "model.embed_tokens.weight"))

        def dense(module: nn.Module, has_codes: bool) -> bool:
            return _loads_dense(module, dense_quantized or not has_codes)

        embed_codes = self.embed_tokens.has_codes or (self._tied_head and self.lm_head.has_codes)  # read_from the head's
        if dense(self.embed_tokens, embed_codes):
            self.embed_tokens.load(w["model.embed_tokens.weight"])
        if dense(self.lm_head, self.lm_head.has_codes):
            self.lm_head.load(w[head])
        self.norm.weight.data.copy_(w["model.norm.weight"])
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, LlamaDecoderLayer), "__init__ builds the layers"
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            self._load_quantized(layer, p, codes)
            names = ("q_proj", "k_proj", "v_proj")
            if attn.qkv_proj.bias is not None:
                attn.qkv_proj.load_bias([w[f"{p}self_attn.{n}.bias"] for n in names])
            if dense(attn.qkv_proj, attn.qkv_proj.has_codes):
                attn.qkv_proj.load([w[f"{p}self_attn.{n}.weight"] for n in names])
            if dense(attn.o_proj, attn.o_proj.has_codes):
                attn.o_proj.load(w[f"{p}self_attn.o_proj.weight"])
            if attn.o_proj.bias is not None:
                attn.o_proj.bias.data.copy_(w[f"{p}self_attn.o_proj.bias"])
            if attn.sinks is not None:
                attn.sinks.copy_(
                    w[f"{p}self_attn.sinks.weight"].reshape(-1)[attn.head_start : attn.head_start + attn.num_heads]
                )
            mlp.load_weights(f"{p}mlp.", w, codes, functools.partial(_source, codes), dense)
            if attn.q_norm is not None and attn.k_norm is not None:
                attn.q_norm.weight.data.copy_(w[f"{p}self_attn.q_norm.weight"])
                attn.k_norm.weight.data.copy_(w[f"{p}self_attn.k_norm.weight"])
            layer.input_layernorm.weight.data.copy_(w[f"{p}input_layernorm.weight"])
            layer.post_attention_layernorm.weight.data.copy_(w[f"{p}post_attention_layernorm.weight"])
            for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):  # sandwich norms only
                norm = getattr(layer, name)
                if norm is not None:
                    norm.weight.data.copy_(w[f"{p}{name}.weight"])
