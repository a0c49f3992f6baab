"""A CPU engine's RoPE tables start with one chunk of positions and grow before a pass reaches
past them (models/layers.py RotaryEmbedding)."""

from __future__ import annotations

from specserve.models.layers import RotaryEmbedding

CHUNK = RotaryEmbedding.CHUNK


def test_the_model_grows_its_tables_before_a_pass_reaches_them():
    from specserve.engine import Engine

    engine = Engine(dtype="bfloat16", speculative_algorithm="NONE", max_total_tokens=CHUNK + 256)
    try:
        model = engine.runner.model
        assert model.lazy_rope and model.rope.cos.shape[0] == CHUNK
        prompt = [5 + i % 50 for i in range(CHUNK + 20)]  # reaches into the second chunk
        out = engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 4})
        assert len(out["output_ids"]) == 4
        assert model.rope.cos.shape[0] == min(2 * CHUNK, model.rope.max_positions) > CHUNK + 20
    finally:
        engine.shutdown()
