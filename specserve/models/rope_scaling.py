"""RoPE scaling as per-frequency factors: frequency i of the rotary table is base^(-2i/d) / f_i,
and every cos and sin value is multiplied by one attention factor.

That is how llama.cpp runs it (its `rope_freqs` tensor, which the GGUF converter writes for Llama
3.1+ models) and what transformers' `linear` (every f_i = factor), `llama3` (f_i between 1 for
short wavelengths and `factor` for long ones, smoothed in between) and `yarn` (the same ramp
between extrapolated and interpolated frequencies, bounded by the dimensions that turn beta_fast
and beta_slow times in the original context, and the cos/sin magnitude 0.1 ln(factor) + 1)
scalings compute. Other kinds (dynamic NTK, LongRoPE) change the frequencies with the sequence
length and are a clear error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from specserve.errors import ConfigError

FreqFactors = Optional[tuple[float, ...]]


@dataclass(frozen=True)
class RopeScaling:
    """What a model's RoPE scaling changes: the frequencies' divisors (None: none) and the factor
    every cos and sin value is multiplied by."""

    freq_factors: FreqFactors = None
    attention_factor: float = 1.0


def yarn_factors(
    theta: float, head_dim: int, factor: float, original_context: int, beta_fast: float = 32.0, beta_slow: float = 1.0
) -> tuple[float, ...]:
    """YaRN's divisors: frequency pairs below the dimension that turns beta_fast times in the
    original context keep their frequency, those above the one that turns beta_slow times are
    divided by `factor`, and a linear ramp mixes the two in between (as transformers' `yarn`
    with truncated bounds, and llama.cpp, compute it)."""

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), head_dim - 1)
    span = high - low if high != low else 0.001
    factors = []
    for i in range(head_dim // 2):
        extrapolate = 1.0 - min(1.0, max(0.0, (i - low) / span))
        factors.append(1.0 / ((1.0 - extrapolate) / factor + extrapolate))
    return tuple(factors)


def yarn_magnitude(factor: float, mscale: float = 1.0) -> float:
    """YaRN's cos/sin magnitude for a context `factor` times the original: 0.1 mscale ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention(factor: float, mscale: Optional[float] = None, mscale_all: Optional[float] = None) -> float:
    """The magnitude, or with both mscales set (transformers' mscale and mscale_all_dim; llama.cpp's
    1 and yarn_log_multiplier) the ratio of the two magnitudes."""
    if mscale and mscale_all:
        return yarn_magnitude(factor, mscale) / yarn_magnitude(factor, mscale_all)
    return yarn_magnitude(factor)


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


def from_hf(rope: dict[str, Any], theta: float, head_dim: int) -> RopeScaling:
    """The scaling of a Hugging Face config's `rope_scaling` / `rope_parameters`."""
    kind = rope.get("rope_type", rope.get("type"))
    if kind in (None, "default"):
        return RopeScaling()
    if kind == "linear":
        return RopeScaling((float(rope["factor"]),) * (head_dim // 2))
    if kind == "llama3":
        return RopeScaling(
            llama3_factors(
                theta,
                head_dim,
                float(rope["factor"]),
                float(rope.get("low_freq_factor", 1.0)),
                float(rope.get("high_freq_factor", 4.0)),
                int(rope.get("original_max_position_embeddings", 8192)),
            )
        )
    if kind == "yarn":
        return _hf_yarn(rope, theta, head_dim)
    raise ConfigError(f"model_path: RoPE scaling {kind!r} is not supported (linear, llama3 and yarn are)")


def _hf_yarn(rope: dict[str, Any], theta: float, head_dim: int) -> RopeScaling:
    missing = [k for k in ("factor", "original_max_position_embeddings") if rope.get(k) is None]
    if missing:
        raise ConfigError(f"model_path: yarn RoPE scaling needs {' and '.join(missing)}")
    if rope.get("truncate", True) is False or rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("model_path: yarn RoPE scaling without truncation or with partial rotary dims is not supported")
    factor = float(rope["factor"])
    attention = rope.get("attention_factor")
    if attention is None:
        attention = yarn_attention(factor, rope.get("mscale"), rope.get("mscale_all_dim"))
    beta_fast, beta_slow = float(rope.get("beta_fast") or 32.0), float(rope.get("beta_slow") or 1.0)
    factors = yarn_factors(theta, head_dim, factor, int(rope["original_max_position_embeddings"]), beta_fast, beta_slow)
    return RopeScaling(factors, float(attention))


def from_gguf(get: Callable[..., Any], freq_tensor: Optional[list[float]], head_dim: int) -> RopeScaling:
    """The scaling a GGUF gives: its `rope_freqs` tensor, or `rope.scaling.type` linear or yarn
    with `rope.scaling.factor` (`get` reads the architecture's keys), as llama.cpp reads them."""
    kind = get("rope.scaling.type")
    if freq_tensor is not None:
        if kind not in (None, "none") or len(freq_tensor) != head_dim // 2:
            raise ConfigError(
                f"model_path: rope_freqs has {len(freq_tensor)} factors for head size {head_dim} (scaling {kind!r})"
            )
        return RopeScaling(tuple(float(f) for f in freq_tensor))
    if kind in (None, "none"):
        return RopeScaling()
    if kind == "linear":
        return RopeScaling((float(get("rope.scaling.factor")),) * (head_dim // 2))
    if kind == "yarn":
        return _gguf_yarn(get, head_dim)
    raise ConfigError(f"model_path: GGUF RoPE scaling {kind!r} is not supported (linear, yarn and rope_freqs are)")


def _gguf_yarn(get: Callable[..., Any], head_dim: int) -> RopeScaling:
    """llama.cpp's YaRN: the ramp over the original context (`original_context_length`, else the
    training context), magnitude 0.1 ln(factor) + 1 (or its ratio with `yarn_log_multiplier`)
    times `attn_factor`."""
    factor = float(get("rope.scaling.factor", 0.0))
    if factor <= 0:
        raise ConfigError("model_path: GGUF yarn RoPE scaling without rope.scaling.factor")
    if float(get("rope.scaling.yarn_ext_factor", 1.0)) not in (-1.0, 1.0):
        raise ConfigError("model_path: GGUF yarn RoPE scaling with an extrapolation mix other than 1 is not supported")
    original = int(get("rope.scaling.original_context_length", get("context_length", 4096)))
    magnitude = yarn_attention(factor, 1.0, float(get("rope.scaling.yarn_log_multiplier", 0.0)))
    theta = float(get("rope.freq_base", 10000.0))
    factors = yarn_factors(
        theta,
        head_dim,
        factor,
        original,
        float(get("rope.scaling.yarn_beta_fast", 32.0)),
        float(get("rope.scaling.yarn_beta_slow", 1.0)),
    )
    return RopeScaling(factors, magnitude * float(get("rope.scaling.attn_factor", 1.0)))
