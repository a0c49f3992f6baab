"""The MLP of a decoder layer: a gated MLP (dense models, and each expert of a mixture), and a
sparse mixture of experts (qwen3moe, qwen2moe, gpt-oss) whose every token's result is its own.

Routing: softmax over the router's float32 logits, then the k most probable experts, ties to the
lower expert index (a stable sort: torch.topk leaves the order of equal values unspecified), their
weights renormalised to sum to 1 where the model does (qwen3moe); gpt-oss takes the k largest
logits (its router has a bias) and the softmax of those k only.

Compute: the rows of a step are grouped by expert, so each active expert's weights are read once
for all the rows routed to it (a batch, a prefill chunk, a verify window); its gate and up
projections are one fused linear.

Sums: each row's expert outputs (float32, from the kernels' own per-row sums) are weighted and
added in that row's top-k order, slot 0 first, and then the shared expert's gated output: never
in an order that depends on which other rows share the step, so batching, caching and speculation
leave every token unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from specserve.errors import ConfigError
from specserve.kernels.build import load
from specserve.kernels.dispatch import path_id
from specserve.kernels.linear import PackedLinear
from specserve.models.config import ModelConfig
from specserve.models.layers import ColumnParallelLinear, RowParallelLinear, TPContext
from specserve.models.quant import QuantSource, QuantWeight

# gpt-oss's clamped SwiGLU (moe_activation "swiglu_oai"): gate <= 7, -7 <= up <= 7,
# (up + 1) * gate * sigmoid(1.702 gate).
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


def swiglu_oai(gate_up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's activation of a fused [rows, 2f] gate/up (gate first), float32 -> float32."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
    up = up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA))


class GatedMLP(nn.Module):
    """Gated MLP (SwiGLU, GELU-tanh for gemma3, or gpt-oss's clamped SwiGLU with float32 biases on
    gate/up and down): fused column-parallel gate/up, row-parallel down."""

    def __init__(self, hidden: int, intermediate: int, tp: TPContext, dtype: torch.dtype, gelu: bool = False,
                 activation: str = "silu", bias: bool = False):  # fmt: skip
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate] * 2, False, tp, dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, tp, dtype)
        self.gelu = gelu
        self.activation = "gelu_tanh" if gelu else activation
        # The file's float32 biases, kept in float32 (bf16 would round them): gate then up, and down.
        self.gate_up_bias = torch.zeros(2 * intermediate) if bias else None
        self.down_bias = torch.zeros(hidden) if bias else None

    def forward(self, x: torch.Tensor, ops, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        if self.activation == "swiglu_oai":
            return self._swiglu_oai(x, out_dtype or x.dtype)
        gate_up = self.gate_up_proj(x)
        act = ops.gelu_tanh_mul(gate_up) if self.gelu else ops.silu_mul(gate_up)
        return self.down_proj(act) if out_dtype is None else self.down_proj.matmul(act, out_dtype)

    def _swiglu_oai(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """gpt-oss's expert: float32 sums plus biases, the activation rounded to x's dtype once."""
        gate_up = self.gate_up_proj.matmul(x, torch.float32)
        if self.gate_up_bias is not None:
            gate_up = gate_up + self.gate_up_bias
        y = self.down_proj.matmul(swiglu_oai(gate_up).to(x.dtype), torch.float32)
        return (y if self.down_bias is None else y + self.down_bias).to(out_dtype)

    def load_weights(self, prefix: str, w: Mapping[str, torch.Tensor], codes: Mapping[str, QuantWeight],
                     source: Callable[[str], QuantSource], dense: Callable[[nn.Module, bool], bool]) -> None:  # fmt: skip
        """Take `prefix`{gate,up,down}_proj.weight: codes where the file has them, else dense."""
        gate_up = [f"{prefix}gate_proj.weight", f"{prefix}up_proj.weight"]
        if all(n in codes for n in gate_up):
            self.gate_up_proj.load_quantized([source(n) for n in gate_up])
        if f"{prefix}down_proj.weight" in codes:
            self.down_proj.load_quantized(source(f"{prefix}down_proj.weight"))
        if dense(self.gate_up_proj, self.gate_up_proj.has_codes):
            self.gate_up_proj.load([w[n] for n in gate_up])
        if dense(self.down_proj, self.down_proj.has_codes):
            self.down_proj.load(w[f"{prefix}down_proj.weight"])
        if self.gate_up_bias is not None and self.down_bias is not None:
            self.gate_up_bias.copy_(torch.cat([w[f"{prefix}gate_proj.bias"], w[f"{prefix}up_proj.bias"]]))
            self.down_bias.copy_(w[f"{prefix}down_proj.bias"])


def route(
    logits: torch.Tensor, k: int, normalize: bool, softmax_after_topk: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], experts int64 [T, k]) of router logits [T, E]: the k most probable
    experts by softmax, most probable first, ties to the lower index; renormalised with `normalize`.
    With `softmax_after_topk` (gpt-oss): the k largest logits, and the softmax of those k."""
    if softmax_after_topk:
        top, experts = torch.sort(logits.float(), dim=-1, descending=True, stable=True)
        return torch.softmax(top[:, :k], dim=-1), experts[:, :k]
    probs = torch.softmax(logits.float(), dim=-1)
    top, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    top, experts = top[:, :k], experts[:, :k]
    return (top / top.sum(dim=-1, keepdim=True) if normalize else top), experts


class SparseMoeBlock(nn.Module):
    """A mixture of `num_experts` gated MLPs, `num_experts_per_tok` per token (module docstring),
    with qwen2moe's shared expert behind a sigmoid gate, or gpt-oss's biases (the router's kept in
    float32). Every rank holds every expert whole."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype):
        super().__init__()
        if tp.size > 1:
            raise ConfigError("tp_size: mixture-of-experts models run on one rank (tp_size 1)")
        hidden = cfg.hidden_size
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.softmax_after_topk = cfg.moe_softmax_after_topk
        self.gate = ColumnParallelLinear(hidden, [cfg.num_experts], False, tp, dtype)  # the router
        self.router_bias = torch.zeros(cfg.num_experts) if cfg.moe_bias else None
        self.experts = nn.ModuleList(
            GatedMLP(hidden, cfg.moe_intermediate_size, tp, dtype, activation=cfg.moe_activation, bias=cfg.moe_bias)
            for _ in range(cfg.num_experts)
        )
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = GatedMLP(hidden, shared, tp, dtype) if shared else None
        self.shared_expert_gate = ColumnParallelLinear(hidden, [1], False, tp, dtype) if shared else None

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        if self.gate.kernel is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu":
            return self._kernel_moe().forward(x.contiguous(), path_id())  # the CPU kernels' own
        return self.mix(x, ops).to(x.dtype)

    def native(self) -> Any:
        """This mixture as the CPU kernels run it in one call (csrc/moe.cpp MoeMlp: the same routing
        and order of sums as mix(), its softmax in scalar float32), the packed weights shared."""

        def kernel(linear: ColumnParallelLinear | RowParallelLinear) -> Any:
            assert linear.kernel is not None, "packed for the CPU kernels"
            return linear.kernel.native()

        experts = [e for e in self.experts if isinstance(e, GatedMLP)]
        shared = [None] * 3
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            s = self.shared_expert
            shared = [kernel(s.gate_up_proj), kernel(s.down_proj), kernel(self.shared_expert_gate)]
        biases = [(e.gate_up_bias, e.down_bias) for e in experts if e.gate_up_bias is not None]
        return load().MoeMlp(
            kernel(self.gate), [kernel(e.gate_up_proj) for e in experts], [kernel(e.down_proj) for e in experts],
            self.top_k, self.normalize, *shared, self.router_bias, [b[0] for b in biases], [b[1] for b in biases],
            self.softmax_after_topk, experts[0].activation == "swiglu_oai",
        )  # fmt: skip

    def _kernel_moe(self) -> Any:
        """native(), built again whenever a packed weight or its activation setting changed."""
        kernels = [k for m in self.modules() if isinstance(k := getattr(m, "kernel", None), PackedLinear)]
        key = tuple((id(k), k.int8_activations) for k in kernels)
        if getattr(self, "_native_key", None) != key:
            self._native, self._native_key = self.native(), key
        return self._native

    def mix(self, x: torch.Tensor, ops) -> torch.Tensor:
        """The float32 sum of each row's weighted experts (and gated shared expert)."""
        weights, experts = route(self.router_logits(x), self.top_k, self.normalize, self.softmax_after_topk)
        by_slot = x.new_zeros((x.shape[0], self.top_k, x.shape[1]), dtype=torch.float32)
        for e in torch.unique(experts).tolist():
            rows, slots = (experts == e).nonzero(as_tuple=True)
            y = self.experts[e](x[rows], ops, torch.float32)
            by_slot[rows, slots] = y * weights[rows, slots].unsqueeze(1)
        out = by_slot[:, 0]
        for slot in range(1, self.top_k):  # each row's own order, whatever shares the step
            out = out + by_slot[:, slot]
        shared = self.shared(x, ops)
        return out if shared is None else out + shared

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [rows, experts], plus the router's bias where it has one."""
        logits = self.gate.matmul(x, torch.float32)
        return logits if self.router_bias is None else logits + self.router_bias

    def shared(self, x: torch.Tensor, ops) -> Optional[torch.Tensor]:
        """qwen2moe's shared expert, float32, scaled per row by the sigmoid of its gate (None without one)."""
        if self.shared_expert is None or self.shared_expert_gate is None:
            return None
        gate = torch.sigmoid(self.shared_expert_gate.matmul(x, torch.float32))
        return gate * self.shared_expert(x, ops, torch.float32)

    def load_weights(self, prefix: str, w: Mapping[str, torch.Tensor], codes: Mapping[str, QuantWeight],
                     source: Callable[[str], QuantSource], dense: Callable[[nn.Module, bool], bool]) -> None:  # fmt: skip
        """Take the router, experts and shared expert under `prefix` (e.g. "model.layers.0.mlp.")."""
        linears = [(self.gate, f"{prefix}gate.weight")]
        if self.shared_expert_gate is not None:
            linears.append((self.shared_expert_gate, f"{prefix}shared_expert_gate.weight"))
        for linear, name in linears:
            if name in codes:
                linear.load_quantized([source(name)])
            if dense(linear, linear.has_codes):
                linear.load([w[name]])
        if self.router_bias is not None:
            self.router_bias.copy_(w[f"{prefix}gate.bias"].reshape(-1))
        for e, expert in enumerate(self.experts):
            assert isinstance(expert, GatedMLP), "__init__ builds the experts"
            expert.load_weights(f"{prefix}experts.{e}.", w, codes, source, dense)
        if self.shared_expert is not None:
            self.shared_expert.load_weights(f"{prefix}shared_expert.", w, codes, source, dense)
