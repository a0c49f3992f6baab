"""RoPE tables that grow with the positions reached (CPU engines): the same values whichever way
and whenever they grow, never past max_positions (the engine's growth: tests/integration/
test_rope_growth.py)."""

from __future__ import annotations

import torch

from specserve.models.layers import RotaryEmbedding

CHUNK = RotaryEmbedding.CHUNK


def test_lazy_tables_equal_the_full_table_whatever_the_growth_order():
    full = RotaryEmbedding(64, 3 * CHUNK + 100, 10000.0, (1.0, 2.0) * 16)
    step = RotaryEmbedding(64, 3 * CHUNK + 100, 10000.0, (1.0, 2.0) * 16, lazy=True)
    jump = RotaryEmbedding(64, 3 * CHUNK + 100, 10000.0, (1.0, 2.0) * 16, lazy=True)
    assert step.cos.shape[0] == CHUNK  # one chunk to start with
    for reach in (CHUNK + 1, 2 * CHUNK + 5, 3 * CHUNK + 100):
        step.cover(reach)
    jump.cover(3 * CHUNK + 50)  # several chunks in one call
    for t in (step, jump):
        assert t.cos.shape == full.cos.shape
        assert torch.equal(t.cos, full.cos) and torch.equal(t.sin, full.sin)


def test_cover_grows_by_whole_chunks_and_stops_at_max_positions():
    rope = RotaryEmbedding(32, CHUNK + 10, 500000.0, lazy=True)
    rope.cover(10)
    assert rope.cos.shape[0] == CHUNK  # already held: nothing made
    rope.cover(CHUNK + 1)
    assert rope.cos.shape[0] == CHUNK + 10  # the next chunk, cut at max_positions
    rope.cover(10 * CHUNK)
    assert rope.cos.shape[0] == CHUNK + 10
