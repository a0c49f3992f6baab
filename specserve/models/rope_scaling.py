"""RoPE scaling as per-frequency factors: frequency i of the rotary table is base^(-2i/d) / f_i.

That is how llama.cpp runs it (its `rope_freqs` tensor, which the GGUF converter writes for Llama
3.1+ models) and what transformers' `linear` (every f_i = factor) and `llama3` (f_i between 1 for
short wavelengths and `factor` for long ones, smoothed in between) scalings compute. Other kinds
(YaRN, dynamic NTK, LongRoPE) change more than the frequencies and are a clear error.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

from specserve.errors import ConfigError

FreqFactors = Optional[tuple[float, ...]]


def llama3_factors(
    theta: float, head_dim: int, factor: float, low_freq_factor: float, high_freq_factor: float, original_context: int
) -> tuple[float, ...]:
    """The factors of Llama 3.1's scaling (as the GGUF converter writes them into `rope_freqs`)."""
    low_wavelen, high_wavelen = original_context / low_freq_factor, original_context / high_freq_factor
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(factors)


def from_hf(rope: dict[str, Any], theta: float, head_dim: int) -> FreqFactors:
    """The factors of a Hugging Face config's `rope_scaling` / `rope_parameters` (None: unscaled)."""
    kind = rope.get("rope_type", rope.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return (float(rope["factor"]),) * (head_dim // 2)
    if kind == "llama3":
        return llama3_factors(
            theta,
            head_dim,
            float(rope["factor"]),
            float(rope.get("low_freq_factor", 1.0)),
            float(rope.get("high_freq_factor", 4.0)),
            int(rope.get("original_max_position_embeddings", 8192)),
        )
    raise ConfigError(f"model_path: RoPE scaling {kind!r} is not supported (linear and llama3 are)")


def from_gguf(get: Callable[..., Any], freq_tensor: Optional[list[float]], head_dim: int) -> FreqFactors:
    """The factors a GGUF gives: its `rope_freqs` tensor, or `rope.scaling.type` linear with
    `rope.scaling.factor` (`get` reads the architecture's keys)."""
    kind = get("rope.scaling.type")
    if freq_tensor is not None:
        if kind not in (None, "none") or len(freq_tensor) != head_dim // 2:
            raise ConfigError(
                f"model_path: rope_freqs has {len(freq_tensor)} factors for head size {head_dim} (scaling {kind!r})"
            )
        return tuple(float(f) for f in freq_tensor)
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return (float(get("rope.scaling.factor")),) * (head_dim // 2)
    raise ConfigError(f"model_path: GGUF RoPE scaling {kind!r} is not supported (linear and rope_freqs are)")
