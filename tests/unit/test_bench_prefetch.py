"""bench prefetch's summary (speedups formed within each run) and its README part."""

from __future__ import annotations

import json

from benchmarks.prefetch import summarize
from benchmarks.render.speculation import render_prefetch


def _batch(decode: float, verify: float) -> dict:
    return {"plain_decode_step_ms": decode,
            "verify_step_parts_ms": {"target_verify_and_accept": verify, "verify_step": verify + 1.0}}


def _runs(on_decode: list[float], off_decode: list[float]) -> list[dict]:
    return [{"on": {"1": _batch(a, 2 * a)}, "off": {"1": _batch(b, 2 * b)}} for a, b in zip(on_decode, off_decode)]


def test_speedups_are_formed_within_each_run():
    s = summarize(_runs([2.0, 4.0, 3.0], [4.0, 4.0, 6.0]))["1"]["decode_step_ms"]
    assert s["speedup"] == {"median": 2.0, "min": 1.0, "max": 2.0}  # 4/2, 4/4, 6/3
    assert s["on"]["median"] == 3.0 and s["off"]["max"] == 6.0


def test_render_calls_a_gain_only_where_the_ranges_part(tmp_path):
    apart = summarize(_runs([2.0, 2.1, 2.2], [4.0, 4.1, 4.2]))
    overlapping = summarize(_runs([2.0, 3.0, 4.0], [3.5, 3.0, 4.1]))
    for batches, expect in ((apart, "**"), (overlapping, "within noise")):
        record = {"commit": "c", "date": "d", "machine": "m", "runs": 3, "num_prompts": 4, "new_tokens": 8,
                  "batch_sizes": batches}
        (tmp_path / "prefetch.json").write_text(json.dumps(record))
        decode_row = next(line for line in render_prefetch(str(tmp_path)).splitlines() if "decode step" in line)
        assert expect in decode_row
