"""RoPE scaling as per-frequency factors and a cos/sin magnitude (models/rope_scaling.py): Llama
3.1's factors give transformers' own llama3 frequencies, linear divides them all, YaRN gives
transformers' yarn frequencies and attention factor (and, from a GGUF, llama.cpp's), a GGUF's
`rope_freqs` is taken as written, and a scaling the engine does not run is one clear error."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from specserve.errors import ConfigError
from specserve.models import rope_scaling
from specserve.models.layers import RotaryEmbedding

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
YARN_MSCALE = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
               "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2}


@pytest.mark.parametrize("scaling", [LLAMA3, {"rope_type": "linear", "factor": 4.0}, YARN, YARN_MSCALE])
def test_factors_give_transformers_frequencies(scaling):
    config = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                                      rope_scaling={**scaling, "rope_theta": 500000.0})
    want, want_magnitude = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    ours = rope_scaling.from_hf(scaling, 500000.0, 128)
    rope = RotaryEmbedding(128, 4, 500000.0, ours.freq_factors, attention_factor=ours.attention_factor)
    angles = torch.atan2(rope.sin[1], rope.cos[1])  # position 1: the frequencies themselves
    assert torch.allclose(angles.double(), want.double(), rtol=1e-6, atol=0)
    assert ours.attention_factor == pytest.approx(want_magnitude, rel=1e-12)
    assert torch.allclose(torch.hypot(rope.cos[1], rope.sin[1]).double(), torch.full((64,), want_magnitude).double())
    factors = set(ours.freq_factors)
    if scaling is LLAMA3:
        assert len(factors) > 2 and ours.attention_factor == 1.0
    if scaling["rope_type"] == "linear":
        assert factors == {4.0} and ours.attention_factor == 1.0
    if scaling["rope_type"] == "yarn":  # fast pairs kept, slow ones divided by the factor, a ramp between
        assert ours.freq_factors[0] == 1.0 and ours.freq_factors[-1] == pytest.approx(scaling["factor"])
        assert len(factors) > 3 and ours.attention_factor > 1.0


def _llama_cpp_yarn_angles(theta: float, dims: int, factor: float, original: int, position: int) -> list[float]:
    """The angles llama.cpp's rope_yarn (ggml-cpu ops.cpp) gives one position, from its own formulas."""
    def corr_dim(rotations: float) -> float:
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(0.0, math.floor(corr_dim(32))), min(dims - 1.0, math.ceil(corr_dim(1)))
    out = []
    for i0 in range(0, dims, 2):
        extrap = position * theta ** (-i0 / dims)
        ramp = 1 - min(1.0, max(0.0, (i0 // 2 - low) / max(0.001, high - low)))
        out.append(extrap / factor * (1 - ramp) + extrap * ramp)
    return out


def test_gguf_yarn_is_llama_cpp_yarn_and_equals_the_hf_reading():
    keys = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 32768,
            "rope.freq_base": 1e6}
    ours = rope_scaling.from_gguf(lambda k, d=None: keys.get(k, d), None, 128)
    assert ours == rope_scaling.from_hf(YARN, 1e6, 128)
    assert ours.attention_factor == pytest.approx(1 + 0.1 * math.log(4.0))
    rope = RotaryEmbedding(128, 1000, 1e6, ours.freq_factors, attention_factor=ours.attention_factor)
    for position in (1, 999):
        want = torch.tensor(_llama_cpp_yarn_angles(1e6, 128, 4.0, 32768, position), dtype=torch.float64)
        assert torch.allclose(torch.cos(want) * ours.attention_factor, rope.cos[position].double(), atol=1e-6)
        assert torch.allclose(torch.sin(want) * ours.attention_factor, rope.sin[position].double(), atol=1e-6)
    scaled = {**keys, "rope.scaling.attn_factor": 0.5, "rope.scaling.yarn_log_multiplier": 0.1}
    got = rope_scaling.from_gguf(lambda k, d=None: scaled.get(k, d), None, 128)
    assert got.attention_factor == pytest.approx(0.5 * (1 + 0.1 * math.log(4.0)) / (1 + 0.01 * math.log(4.0)))
    with pytest.raises(ConfigError, match="extrapolation mix"):
        rope_scaling.from_gguf(lambda k, d=None: {**keys, "rope.scaling.yarn_ext_factor": 0.5}.get(k, d), None, 128)
    with pytest.raises(ConfigError, match="without rope.scaling.factor"):
        rope_scaling.from_gguf(lambda k, d=None: {"rope.scaling.type": "yarn"}.get(k, d), None, 128)
    with pytest.raises(ConfigError, match="needs original_max_position_embeddings"):
        rope_scaling.from_hf({"rope_type": "yarn", "factor": 4.0}, 1e6, 128)


def test_gguf_factors_come_from_rope_freqs_or_a_linear_scaling():
    keys = {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}
    assert rope_scaling.from_gguf(lambda k, d=None: keys.get(k, d), None, 8).freq_factors == (2.0,) * 4
    assert rope_scaling.from_gguf(lambda k, d=None: d, [1.0, 2.0, 3.0, 4.0], 8).freq_factors == (1.0, 2.0, 3.0, 4.0)
    assert rope_scaling.from_gguf(lambda k, d=None: d, None, 8) == rope_scaling.RopeScaling()
    with pytest.raises(ConfigError, match="rope_freqs has 3 factors"):
        rope_scaling.from_gguf(lambda k, d=None: d, [1.0, 2.0, 3.0], 8)
    with pytest.raises(ConfigError, match="'longrope' is not supported"):
        rope_scaling.from_gguf(lambda k, d=None: {"rope.scaling.type": "longrope"}.get(k, d), None, 8)
    with pytest.raises(ConfigError, match="'dynamic' is not supported"):
        rope_scaling.from_hf({"rope_type": "dynamic", "factor": 2.0}, 10000.0, 8)
