"""Fused small ops of a decoder layer in bf16 (see csrc/ops.h): residual add + RMSNorm, SiLU x
up, GELU-tanh x up, gpt-oss's clamped SwiGLU, and RoPE with the K/V store. Each replaces several
PyTorch ops (and their dispatch) with one call whose per-row result does not depend on the number
of rows."""

from __future__ import annotations

from typing import Optional

import torch

from specserve.kernels.build import load
from specserve.kernels.dispatch import path_id


def add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(residual + x) with residual updated in place (RMSNorm(x) when residual is None)."""
    return load().add_rms_norm(x, residual, weight, eps, path_id())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] of shape [rows, 2f]."""
    return load().silu_mul(gate_up, path_id())


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for gate_up = [gate | up] of shape [rows, 2f] (gemma3's MLP)."""
    return load().gelu_tanh_mul(gate_up, path_id())


def swiglu_oai(gate_up: torch.Tensor, bias: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of float32 gate/up sums [rows, 2f] plus their float32 bias [2f], as
    bf16 [rows, f] (what the native mixture runs on each expert's rows)."""
    return load().swiglu_oai(gate_up, bias, alpha, limit, path_id())


def rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    heads: int,
    kv_heads: int,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
) -> torch.Tensor:
    """Rotate q and k of qkv [T, (heads + 2 kv_heads) * D] at `positions` (float32 tables [P, D/2]),
    store rotated k and v at `slots` of the pools, return q [T, heads, D]."""
    return load().rope_store(qkv, cos, sin, positions, slots, heads, kv_heads, k_pool, v_pool)
