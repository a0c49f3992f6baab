"""The DSpark block drafter: g drafts in one bidirectional pass, then a Markov head left to right.

Notation: S tokens have KV in the cache, `a` is the anchor (the last target-approved
token, not yet cached). The block `[a, M, .., M]` (M = mask id) sits at positions S..S+g-1; slot
k predicts the token after position S+k, so g slots give g drafts and the verify window is g + 1.

Context comes from the target: `ctx = norm(fc(cat(h_l for l in target_layer_ids)))` per committed
token, projected by each draft layer into its own K/V at that token's absolute position and kept in
a paged draft-KV pool indexed by the target's token slots. Only committed tokens are injected: the
whole prompt at prefill, the anchor and accepted drafts after each verify.

The drafter is replicated on every tensor-parallel rank (it is small; sharding it would add two
all-reduces per draft layer for a few MFLOPs of work) and shares the target's input embedding and
LM head, frozen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence, cast

import torch
import torch.nn.functional as F
from torch import nn

from specserve.errors import ConfigError
from specserve.kernels.build import load
from specserve.kernels.linear import PackedLinear, concat_columns, pack_bf16
from specserve.kv.pool import KVPool
from specserve.models.backend import OpBackend, TorchOps
from specserve.models.config import ModelConfig
from specserve.models.dspark_native import NativeDraftBlock
from specserve.models.layers import Linear, RMSNorm, RotaryEmbedding, apply_rope
from specserve.models.quant import Q8Weight
from specserve.runtime.host_waits import device_code
from specserve.runtime.stream import staged
from specserve.sampler import counter_uniforms, draft_counter, filtered_probs, inverse_cdf, seeds_tensor
from specserve.sampling_params import SamplingParams


@dataclass
class DsparkConfig:
    """Shape of a drafter, saved as config.json next to model.safetensors."""

    hidden_size: int  # equals the target's: the embedding and LM head are shared
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    target_hidden_size: int
    target_layer_ids: list[int]
    block_size: int = 5
    markov_rank: int = 64
    mask_token_id: int = 0
    draft_vocab_size: Optional[int] = None  # drafts come from this many target ids (None: all of them)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    architecture: str = "dspark"
    extra: dict = field(default_factory=dict)  # free-form provenance (target, training run, ...)

    @classmethod
    def for_target(
        cls,
        target: ModelConfig,
        num_layers: int = 1,
        block_size: int = 5,
        markov_rank: int = 64,
        num_context_layers: int = 3,
        mask_token_id: int = 0,
    ) -> "DsparkConfig":
        """A drafter as wide as the target, reading `num_context_layers` layers spread over its depth."""
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_layers=num_layers,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            vocab_size=target.vocab_size,
            target_hidden_size=target.hidden_size,
            target_layer_ids=spread_layers(target.num_layers, num_context_layers),
            block_size=block_size,
            markov_rank=markov_rank,
            mask_token_id=mask_token_id,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
        )

    def validate_for(self, target: ModelConfig) -> None:
        problems = []
        if self.hidden_size != target.hidden_size:
            problems.append(f"hidden_size {self.hidden_size} != target {target.hidden_size} (the LM head is shared)")
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} != target {target.vocab_size}")
        if list(self.target_layer_ids) != sorted(set(self.target_layer_ids)):
            problems.append(f"target_layer_ids {self.target_layer_ids} must be increasing (fc reads them in layer order)")
        if any(not 0 <= i < target.num_layers for i in self.target_layer_ids):
            problems.append(f"target_layer_ids {self.target_layer_ids} outside 0..{target.num_layers - 1}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            problems.append(f"draft_vocab_size {self.draft_vocab_size} outside 1..{self.vocab_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} outside the vocabulary")
        if problems:
            raise ConfigError("speculative_draft_model_path: drafter does not fit the target: " + "; ".join(problems))


def spread_layers(num_layers: int, n: int) -> list[int]:
    """n target layer ids spread from the second layer to the third-from-last."""
    lo, hi = min(1, num_layers - 1), max(0, num_layers - 3)
    if n == 1:
        return [hi]
    return sorted({round(lo + (hi - lo) * i / (n - 1)) for i in range(n)})


@dataclass
class DraftOut:
    """One drafting pass for bs requests (all on the drafter's device).

    tokens [bs, g] int64; probs [bs, g, V] float32, the Markov-corrected distribution q each draft
    was taken from (one-hot rows for greedy requests), or None when every request is greedy;
    confidence [bs, g]: c_k, the drafter's estimate that slot k survives given slots < k did.
    """

    tokens: torch.Tensor
    probs: Optional[torch.Tensor]
    confidence: torch.Tensor


class DraftLayer(nn.Module):
    """A decoder layer whose queries come from the block and whose K/V cover context and block."""

    def __init__(self, cfg: DsparkConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.q_proj = Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = Linear(cfg.num_heads * d, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_proj = Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, h, bias=False)

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of context rows [N, H] at their absolute positions -> [N, KVH, D] each."""
        k = apply_rope(self.k_proj(ctx).view(ctx.shape[0], -1, self.head_dim), cos, sin)
        return k, self.v_proj(ctx).view(ctx.shape[0], -1, self.head_dim)

    def native(self) -> Optional[Any]:
        """This layer's C++ twin (kernels/csrc/decoder_layer.cpp, its QKV and gate/up fused) for the
        native drafting pass (models/dspark_native.py), or None when its linears do not fuse (not all
        packed, or not whole 16-column blocks) or its norms' epsilons differ."""
        parts = [lin.kernel for lin in (self.q_proj, self.k_proj, self.v_proj, self.gate_proj, self.up_proj)]
        o, down = self.o_proj.kernel, self.down_proj.kernel
        if o is None or down is None or any(k is None for k in parts):
            return None
        qkv = concat_columns([k for k in parts[:3] if k is not None])
        gate_up = concat_columns([k for k in parts[3:] if k is not None])
        norms = (self.input_layernorm, self.post_attention_layernorm)
        eps = {n.eps for n in norms}
        if qkv is None or gate_up is None or len(eps) != 1:
            return None
        weights = [n.weight.detach() for n in norms] + [None] * 4
        return load().DecoderLayer(
            qkv.native(), None, o.native(), gate_up.native(), down.native(), None, weights, self.num_heads,
            self.num_kv_heads, self.head_dim, self.head_dim**-0.5, 0, False, eps.pop(),
        )  # fmt: skip

    def forward(
        self,
        x: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        mask: Optional[torch.Tensor],
        cos: torch.Tensor,
        sin: torch.Tensor,
        ops: OpBackend,
    ) -> torch.Tensor:
        """x [bs, g, H]; ctx_k/ctx_v [bs, C, KVH, D]; mask additive [bs, 1, 1, C + g] or None."""
        bs, g, _ = x.shape
        h = ops.rms_norm(x, self.input_layernorm).view(bs * g, -1)
        q = apply_rope(self.q_proj(h).view(bs * g, -1, self.head_dim), cos, sin).view(bs, g, -1, self.head_dim)
        k = apply_rope(self.k_proj(h).view(bs * g, -1, self.head_dim), cos, sin).view(bs, g, -1, self.head_dim)
        v = self.v_proj(h).view(bs, g, -1, self.head_dim)
        out = ops.block_attention(q, torch.cat([ctx_k, k], 1), torch.cat([ctx_v, v], 1), mask)
        x = x + self.o_proj(out.reshape(bs, g, -1))
        m = ops.rms_norm(x, self.post_attention_layernorm)
        return x + self.down_proj(ops.silu_mul(torch.cat([self.gate_proj(m), self.up_proj(m)], dim=-1)))


class DraftVocabHead(nn.Module):
    """The target LM head's rows of the draft vocabulary: frozen, float32 logits over draft ids."""

    weight: torch.Tensor  # a buffer [V_draft, H]

    def __init__(self, rows: torch.Tensor, q8: bool = False):
        super().__init__()
        self.register_buffer("weight", rows, persistent=False)
        self.kernel: Optional[PackedLinear] = None
        self.q8 = q8  # packed as ggml Q8_0 codes (of float32 rows: a Q8_0 target head's own codes)
        self.int8_activations = q8  # and its rows' activations as int8 (CpuKernelOps.prepare): a fifth faster

    def pack_for_cpu(self) -> None:
        if self.q8:  # the kernel computes from the codes: the rows go
            self.kernel = Q8Weight.from_dense(self.weight).packed()
            self.weight = self.weight.new_empty(0)
        else:
            self.kernel = pack_bf16(self.weight)

    def rows(self, index: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Rows `index` of the head weight (a drafter's reduced vocabulary reads them)."""
        return self.weight.detach()[index].to(dtype or self.weight.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(hidden.to(torch.bfloat16), torch.float32)
        return F.linear(hidden.to(self.weight.dtype), self.weight).float()


class _WeightedHead(Protocol):  # an LM head that shows its weight's rows (reduced draft vocabularies read them)
    def rows(self, index: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor: ...


class DsparkDrafter(nn.Module):
    """The drafter's own weights; `embed` and `lm_head` are the target's (callables, frozen)."""

    draft_to_target: torch.Tensor  # a buffer [V_draft], with a reduced draft vocabulary only

    def __init__(self, cfg: DsparkConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        n_ctx = len(cfg.target_layer_ids)
        self.fc = Linear(n_ctx * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.markov_w1 = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
        self.markov_w2 = Linear(cfg.markov_rank, self.draft_vocab_size, bias=False)
        if cfg.draft_vocab_size is not None:  # draft id -> target id; saved with the weights
            self.register_buffer("draft_to_target", torch.arange(cfg.draft_vocab_size))
        self.confidence = Linear(cfg.hidden_size + cfg.markov_rank, 1)
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta)
        self.embed: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        self.lm_head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        self.ops: OpBackend = TorchOps(torch.float32)  # stock torch (training) until use_backend
        self.q8_weights = False
        self.native: Optional[NativeDraftBlock] = None  # the block and greedy Markov head as native calls

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def draft_vocab_size(self) -> int:
        return self.config.draft_vocab_size or self.config.vocab_size

    @property
    def reduced_vocab(self) -> bool:
        return self.config.draft_vocab_size is not None

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def attach_target(
        self, embed: Callable[[torch.Tensor], torch.Tensor], lm_head: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """Share the target's embedding and LM head. With a reduced draft vocabulary the head is
        the target head's rows of the draft ids (`lm_head` must then give them: `.rows(ids)`)."""
        self.embed, self.lm_head = embed, lm_head
        if self.reduced_vocab:
            dtype = torch.float32 if self.q8_weights else None  # exact rows to quantize
            rows = cast(_WeightedHead, lm_head).rows(self.draft_to_target, dtype)  # the contract above
            self.lm_head = DraftVocabHead(rows.contiguous(), q8=self.q8_weights)
            self.ops.prepare(self.lm_head)

    def quantize_weights(self) -> None:
        """Compute the linears and the reduced-vocabulary head from ggml Q8_0 codes of their weights
        (half the bytes a step reads); call before use_backend and attach_target."""
        self.q8_weights = True
        for part in self.modules():  # the Markov head's W2 stays bf16: at one row a step, dequantizing costs more
            if isinstance(part, Linear) and part is not self.markov_w2:
                part.q8_weights = True

    def use_backend(self, ops: OpBackend) -> None:
        """Run on `ops` from now on (after the weights are loaded: it packs the ones it needs)."""
        ops.prepare(self)
        self.ops = ops
        self.native = None  # built here, where the drafter's parts are known: the ops know no model
        if ops.fuses_layers and self.dtype == torch.bfloat16:  # packed for the CPU kernels in bf16
            twins = [cast(DraftLayer, layer).native() for layer in self.layers]
            self.native = NativeDraftBlock.build(twins, self.markov_w2.kernel)

    # ------------------------------------------------------------ context injection

    @torch.inference_mode()
    def inject(self, target_hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv: KVPool) -> None:
        """Write every draft layer's K/V for committed tokens.

        target_hidden [N, len(target_layer_ids) * H_target]: the target's hidden states of exactly
        the committed tokens; positions [N] their absolute positions; slots [N] their token slots.
        """
        if target_hidden.shape[0] == 0:
            return
        ctx = self.context(target_hidden)
        cos, sin = self.rope.cos_sin(positions, ctx.dtype)
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DraftLayer), "__init__ builds the layers"
            k, v = layer.context_kv(ctx, cos, sin)
            kv.write(i, slots, k, v)

    def context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(self.fc(target_hidden.to(self.dtype)), self.hidden_norm)

    # ------------------------------------------------------------ drafting

    @torch.inference_mode()
    def propose(
        self,
        anchors: torch.Tensor,
        prefix_lens: torch.Tensor,
        ctx_slots: torch.Tensor,
        kv: KVPool,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        counters: "Sequence[int] | torch.Tensor",
        drafts: Optional[int] = None,
    ) -> DraftOut:
        """Draft g tokens per request (the first `drafts` of them: the same tokens, without the rest).

        anchors [bs]; prefix_lens [bs] (S); ctx_slots [bs, C] token slots of context positions
        0..C-1 (columns >= S are ignored); counters: each request's output length, from which the
        draft uniforms derive, so sampled drafts are reproducible across batches and ranks.
        """
        hidden = self.block_hidden(anchors, prefix_lens, ctx_slots, kv)[:, :drafts]  # the whole block attends
        assert self.lm_head is not None, "attach_target first"
        base = self.lm_head(hidden.reshape(-1, hidden.shape[-1])).view(hidden.shape[0], hidden.shape[1], -1)
        return self.markov_decode(anchors, hidden, base, params, seeds, counters)

    def block_hidden(
        self, anchors: torch.Tensor, prefix_lens: torch.Tensor, ctx_slots: torch.Tensor, kv: KVPool
    ) -> torch.Tensor:
        """Final-normed hidden states of the block slots, [bs, g, H]."""
        native = self._native_block_hidden(anchors, prefix_lens, ctx_slots, kv)
        if native is not None:
            return native
        bs, g = anchors.shape[0], self.block_size
        ids = torch.full((bs, g), self.config.mask_token_id, dtype=torch.int64, device=anchors.device)
        ids[:, 0] = anchors
        positions = (prefix_lens.unsqueeze(1) + torch.arange(g, device=anchors.device)).reshape(-1)
        cos, sin = self.rope.cos_sin(positions, self.dtype)
        assert self.embed is not None, "attach_target first"
        x = self.embed(ids.reshape(-1)).to(self.dtype).view(bs, g, -1)
        width = ctx_slots.shape[1]
        ctx_valid = torch.arange(width, device=anchors.device).unsqueeze(0) < prefix_lens.unsqueeze(1)
        slots = ctx_slots.masked_fill(~ctx_valid, 0)
        keep = torch.cat([ctx_valid, ctx_valid.new_ones(bs, g)], 1)  # always masked: no prefix read back
        mask = torch.where(keep, 0.0, float("-inf")).to(self.dtype).view(bs, 1, 1, -1)
        for i, layer in enumerate(self.layers):
            x = layer(x, kv.k[i][slots], kv.v[i][slots], mask, cos, sin, self.ops)
        return self.ops.rms_norm(x, self.norm)

    def _native_block_hidden(
        self, anchors: torch.Tensor, prefix_lens: torch.Tensor, ctx_slots: torch.Tensor, kv: KVPool
    ) -> Optional[torch.Tensor]:
        """block_hidden through the native layers (models/dspark_native.py), or None: no native
        pass, not attached yet (the per-op pass says so), or too few block rows for this batch."""
        if self.native is None or self.embed is None:
            return None
        bs, g = anchors.shape[0], self.block_size
        rows = self.native.block_rows(kv, bs, g)
        if rows is None:
            return None
        with device_code():  # a CPU kernel's own inputs (this path exists on CPU alone)
            ids = torch.full((bs, g), self.config.mask_token_id, dtype=torch.int64)
            ids[:, 0] = anchors
            residual = self.embed(ids.reshape(-1)).to(self.dtype).contiguous().clone()
            out = self.native.layers_out(residual, prefix_lens, ctx_slots, kv, rows, self.rope)
            return self.ops.add_rms_norm(out, residual, self.norm).view(bs, g, -1)

    def markov_decode(
        self,
        anchors: torch.Tensor,
        hidden: torch.Tensor,
        base_logits: torch.Tensor,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        counters: "Sequence[int] | torch.Tensor",
    ) -> DraftOut:
        """Left to right: logits_k = U_k + W2 W1[prev_k]; pick x_k; prev_{k+1} = x_k."""
        bs, g, _ = base_logits.shape
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        native = None
        if not sampled and self.native is not None:
            to_target = self.draft_to_target if self.reduced_vocab else None
            native = self.native.markov_greedy(anchors, base_logits, self.markov_w1.weight.detach(), to_target)
        if native is not None:
            return self._draft_out(hidden, *native, None)
        tokens = torch.empty(bs, g, dtype=torch.int64, device=anchors.device)
        vocab = self.config.vocab_size
        probs = base_logits.new_zeros(bs, g, vocab) if sampled else None
        if sampled:
            rows = staged(sampled, torch.int64, anchors.device)
            row_seeds = seeds_tensor([seeds[i] for i in sampled], anchors.device)
            counts = counters if isinstance(counters, torch.Tensor) else staged(list(counters), torch.int64, anchors.device)
            row_counters = counts[rows]
            coupled = staged([params[i].seeded_sampling for i in sampled], torch.bool, anchors.device)
        prev, embedded = anchors.long(), []
        for k in range(g):
            e = self.markov_w1(prev)
            embedded.append(e)
            logits = base_logits[:, k] + self.markov_w2(e).float()
            pick = self.to_target(logits.argmax(-1))
            if probs is not None:  # some request samples: drawn on the device, nothing read back
                probs[:, k] = F.one_hot(pick, vocab).float()
                q = filtered_probs(logits[rows], [params[i] for i in sampled])
                u = counter_uniforms(row_seeds, draft_counter(row_counters, k, coupled))
                pick = pick.index_copy(0, rows, self.to_target(inverse_cdf(q, u)))
                probs[rows, k] = self.to_target_probs(q)
            tokens[:, k] = pick
            prev = pick
        return self._draft_out(hidden, tokens, torch.stack(embedded, 1), probs)

    def _draft_out(
        self, hidden: torch.Tensor, tokens: torch.Tensor, embedded: torch.Tensor, probs: Optional[torch.Tensor]
    ) -> DraftOut:
        # Every slot's confidence in one call after the loop (a linear's rows do not depend on each other).
        conf = torch.sigmoid(self.confidence(torch.cat([hidden, embedded], -1)).float().squeeze(-1))
        return DraftOut(tokens, probs, conf)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.draft_to_target[draft_ids] if self.reduced_vocab else draft_ids

    def to_target_probs(self, q: torch.Tensor) -> torch.Tensor:
        """[n, V_draft] -> [n, V]: target ids outside the draft vocabulary get probability 0."""
        if not self.reduced_vocab:
            return q
        full = q.new_zeros(q.shape[0], self.config.vocab_size)
        return full.index_copy_(1, self.draft_to_target, q)
