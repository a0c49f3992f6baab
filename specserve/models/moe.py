"""The MLP of a decoder layer: a gated MLP (dense models, and each expert of a mixture), and a
sparse mixture of experts (qwen3moe, qwen2moe) whose every token's result is its own.

Routing: softmax over the router's float32 logits, then the k most probable experts, ties to the
lower expert index (a stable sort: torch.topk leaves the order of equal values unspecified), their
weights renormalised to sum to 1 where the model does (qwen3moe).

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


class GatedMLP(nn.Module):
    """Gated MLP (SwiGLU, or GELU-tanh for gemma3): fused column-parallel gate/up, row-parallel down."""

    def __init__(self, hidden: int, intermediate: int, tp: TPContext, dtype: torch.dtype, gelu: bool = False):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate] * 2, False, tp, dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, tp, dtype)
        self.gelu = gelu

    def forward(self, x: torch.Tensor, ops, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = ops.gelu_tanh_mul(gate_up) if self.gelu else ops.silu_mul(gate_up)
        return self.down_proj(act) if out_dtype is None else self.down_proj.matmul(act, out_dtype)

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


def route(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], experts int64 [T, k]) of router logits [T, E]: the k most probable
    experts by softmax, most probable first, ties to the lower index; renormalised with `normalize`."""
    probs = torch.softmax(logits.float(), dim=-1)
    top, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    top, experts = top[:, :k], experts[:, :k]
    return (top / top.sum(dim=-1, keepdim=True) if normalize else top), experts


class SparseMoeBlock(nn.Module):
    """A mixture of `num_experts` gated MLPs, `num_experts_per_tok` per token (module docstring),
    with qwen2moe's shared expert behind a sigmoid gate. Every rank holds every expert whole."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype):
        super().__init__()
        if tp.size > 1:
            raise ConfigError("tp_size: mixture-of-experts models run on one rank (tp_size 1)")
        hidden = cfg.hidden_size
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = ColumnParallelLinear(hidden, [cfg.num_experts], False, tp, dtype)  # the router
        self.experts = nn.ModuleList(GatedMLP(hidden, cfg.moe_intermediate_size, tp, dtype) for _ in range(cfg.num_experts))
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
        return load().MoeMlp(
            kernel(self.gate), [kernel(e.gate_up_proj) for e in experts], [kernel(e.down_proj) for e in experts],
            self.top_k, self.normalize, *shared,
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
        weights, experts = route(self.gate.matmul(x, torch.float32), self.top_k, self.normalize)
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
        for e, expert in enumerate(self.experts):
            assert isinstance(expert, GatedMLP), "__init__ builds the experts"
            expert.load_weights(f"{prefix}experts.{e}.", w, codes, source, dense)
        if self.shared_expert is not None:
            self.shared_expert.load_weights(f"{prefix}shared_expert.", w, codes, source, dense)
