"""RoPE scaling as per-frequency factors (models/rope_scaling.py): Llama 3.1's factors give
transformers' own llama3 frequencies, linear divides them all, a GGUF's `rope_freqs` is taken as
written, and a scaling the engine does not run is one clear error."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from specserve.errors import ConfigError
from specserve.models import rope_scaling
from specserve.models.layers import RotaryEmbedding

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("scaling", [LLAMA3, {"rope_type": "linear", "factor": 4.0}])
def test_factors_give_transformers_frequencies(scaling):
    config = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                                      rope_scaling={**scaling, "rope_theta": 500000.0})
    want, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    factors = rope_scaling.from_hf(scaling, 500000.0, 128)
    ours = RotaryEmbedding(128, 4, 500000.0, factors)
    angles = torch.atan2(ours.sin[1], ours.cos[1])  # position 1: the frequencies themselves
    assert torch.allclose(angles.double(), want.double(), rtol=1e-6, atol=0)
    assert len(set(factors)) > 2 if scaling is LLAMA3 else set(factors) == {4.0}


def test_gguf_factors_come_from_rope_freqs_or_a_linear_scaling():
    keys = {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}
    assert rope_scaling.from_gguf(lambda k, d=None: keys.get(k, d), None, 8) == (2.0,) * 4
    assert rope_scaling.from_gguf(lambda k, d=None: d, [1.0, 2.0, 3.0, 4.0], 8) == (1.0, 2.0, 3.0, 4.0)
    assert rope_scaling.from_gguf(lambda k, d=None: d, None, 8) is None
    with pytest.raises(ConfigError, match="rope_freqs has 3 factors"):
        rope_scaling.from_gguf(lambda k, d=None: d, [1.0, 2.0, 3.0], 8)
    with pytest.raises(ConfigError, match="'yarn' is not supported"):
        rope_scaling.from_gguf(lambda k, d=None: {"rope.scaling.type": "yarn"}.get(k, d), None, 8)
    with pytest.raises(ConfigError, match="'dynamic' is not supported"):
        rope_scaling.from_hf({"rope_type": "dynamic", "factor": 2.0}, 10000.0, 8)
