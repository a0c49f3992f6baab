"""`specserve bench models`: each run's ratios are formed within the run, the summary is the
median and range over runs, and the rendered table calls a ratio whose range spans 1 within noise."""

from __future__ import annotations

import json

import pytest

from specserve.bench.models import _batched_peer, _figures, summarize
from benchmarks.render.engine import render_models


def offline_run(ours_tok_s: float, peer_tok_s: float) -> dict:
    ours = {"batch1_tok_s": ours_tok_s, "batch32_tok_s": 8 * ours_tok_s, "decode_1_row_ms": 1000 / ours_tok_s,
            "verify_over_decode": 2.0, "prefill_tok_s": 300.0, "rss_mib": 700.0, "file_mib": 240.0, "kv_mib": 60.0,
            "load_s": 9.0}
    peer = {"batch1_tok_s": peer_tok_s, "decode_1_row_ms": 1000 / peer_tok_s, "prefill_tok_s": 200.0}
    return {"specserve": ours, "llama.cpp": peer, "native": {"tg128_tok_s": 50.0, "pp512_tok_s": 500.0}}


def test_ratios_are_paired_within_runs_and_summarized_by_median_and_range():
    runs = [_figures(offline_run(o, p), 32) for o, p in ((40, 50), (60, 50), (45, 30))]
    summary = summarize(runs)
    assert summary["decode_vs_llama_cpp_python"] == {"median": 1.2, "min": 0.8, "max": 1.5}
    assert summary["rss_over_file_and_kv_mib"]["median"] == 400.0
    assert summary["batch_over_batch1"]["median"] == 8.0
    assert summary["decode_vs_native"]["median"] == 0.9


def rendered(tmp_path, name: str, runs: list[dict], **extra) -> str:
    """The README part of a models.json holding one model's runs."""
    data = extra | {"runs": len(runs), "new_tokens": 64, "batch_size": 32, "threads": 2, "llama_cpp_python": "0.3.36",
            "spec_prompts": 16, "commit": "abc", "date": "2026-12-03", "machine": "a test machine",
            "models": {name: {"path": f"{name}.gguf", "summary": summarize([_figures(r, 32) for r in runs]), "runs": runs}}}
    (tmp_path / "models.json").write_text(json.dumps(data))
    return render_models(str(tmp_path))


def test_rendered_table_marks_a_ratio_whose_runs_span_one(tmp_path):
    text = rendered(tmp_path, "default", [offline_run(o, p) for o, p in ((40, 50), (60, 50), (45, 30))])
    assert "1.20x (0.80-1.50), within noise" in text
    assert "700 MiB = file 240 + KV 60 + 400" in text
    assert "speculation: none" in text and "From `bench_results/models.json` (a test machine" in text
    # Decode with each model's default speculation is never set against native llama.cpp (which does
    # not speculate); prefill, one forward on both sides, is.
    assert "vs native llama.cpp (tg128)" not in text and "prefill vs native (pp512)" in text


def test_a_model_named_by_its_path_is_labelled_by_the_file_stem(tmp_path):
    text = rendered(tmp_path, "/models/dir/qwen-q4_k_m.gguf, int8 activations", [offline_run(40, 50)])
    assert "\n| qwen-q4_k_m, int8 activations (`" in text  # the row's first cell (the file named after it)


def test_a_drafter_file_counts_with_the_model_file(tmp_path):
    run = offline_run(40, 50)
    run["specserve"]["drafter_file_mib"] = 17.0
    assert _figures(run, 32)["rss_over_file_and_kv_mib"] == 700.0 - 240.0 - 17.0 - 60.0
    assert "700 MiB = file 240 + drafter 17 + KV 60 + 383" in rendered(tmp_path, "default", [run])


def spec_table(ratios: dict[tuple[str, int], float], identical: bool = True) -> dict:
    rows = []
    for (workload, bs), ratio in ratios.items():
        for config, r in (("NONE", 1.0), ("DEFAULT", ratio)):
            rows.append({"workload": workload, "batch_size": bs, "config": config, "tokens_per_s": 10 * r,
                         "ratio_to_none": r, "accept_length": None, "identical_to_none": identical or config == "NONE",
                         "drafter_steps": {}})
    return {"table": rows}


def test_speculation_figures_are_the_default_over_none_and_any_differing_run_shows():
    cells = {("mtbench", 1): 1.4, ("mtbench", 16): 1.1, ("humaneval", 1): 0.9}
    runs = [offline_run(40, 50) | {"spec": spec_table(cells, identical)} for identical in (True, False, True)]
    summary = summarize([_figures(r, 32) for r in runs])
    assert summary["default_vs_none@mtbench/bs1"]["median"] == 1.4
    assert summary["default_vs_none@humaneval/bs1"]["median"] == 0.9
    assert summary["default_identical_to_none"] == {"median": 1.0, "min": 0.0, "max": 1.0}


def test_rendered_speculation_table_orders_cells_and_flags_differing_tokens(tmp_path):
    cells = {("mtbench", 16): 1.1, ("mtbench", 1): 1.4, ("humaneval", 1): 0.9}
    runs = [offline_run(40, 50) | {"spec": spec_table(cells, identical), "speculation": "adaptive over NGRAM"}
            for identical in (True, False)]
    text = rendered(tmp_path, "q", runs)
    assert "| model (default speculation) | humaneval, batch 1 | mtbench, batch 1 | mtbench, batch 16 | tokens identical to NONE |" in text
    assert "| q (adaptive over NGRAM) | 0.90x (0.90-0.90) | 1.40x (1.40-1.40) | 1.10x (1.10-1.10) | **no** |" in text
    assert "speculation: adaptive over NGRAM)" in text
    assert "same run):" in text  # a record from before --spec-repeats: one repeat per run
    text = rendered(tmp_path, "q", runs, spec_repeats=2)
    assert "same run; each run's ratio the median of 2 repeats in alternating order):" in text


def test_the_mixtures_table_shows_the_experts_a_window_reads(tmp_path):
    """bench models on a mixture records the distinct experts per layer of a decode row and of the
    verify window; the mixtures' table shows both beside the window's cost."""
    from benchmarks.render.engine import render_models_moe

    run = offline_run(40, 50)
    run["specserve"] |= {"decode_tok_s": 41.0, "read_bandwidth_gbs": 40.0, "decode_bandwidth_share": 0.5, "batch4_tok_s": 90.0,
                         "decode_experts_per_layer": 8.0, "verify_experts_per_layer": 23.5}
    figures = _figures(run, 4)
    assert (figures["decode_experts_per_layer"], figures["verify_experts_per_layer"]) == (8.0, 23.5)
    data = {"runs": 1, "new_tokens": 32, "batch_size": 4, "window": 4, "threads": 2, "commit": "abc",
            "date": "2026-12-06", "machine": "a test machine", "llama_bench_args": "-lm none",
            "models": {"m": {"path": "m.gguf", "activations": "int8", "summary": summarize([figures]), "runs": [run]}}}
    (tmp_path / "models_moe.json").write_text(json.dumps(data))
    text = render_models_moe(str(tmp_path))
    assert "experts read per layer, decode row vs 4-row window" in text and "| 8.0 vs 23.5 |" in text
    assert "4-row verify / decode step" in text and "llama-bench -lm none" in text and "700 MiB (file 240, KV 60)" in text


def test_batched_figures_price_each_batch_against_batch_1_and_native_s_tg():
    run = offline_run(40, 50)
    run["specserve"]["batched_decode_tok_s"] = {"1": 10.0, "4": 32.0, "16": 80.0}
    run["native_batched"] = {"1": 8.0, "4": 20.0, "16": 40.0}
    figures = _figures(run, 32)
    assert figures["step_4_rows_over_1"] == 1.25  # 4 rows in 0.125 s against 1 row in 0.1 s
    assert figures["step_16_rows_over_1"] == 2.0 and figures["batched_16_vs_native"] == 2.0
    assert figures["native_batched_4_tok_s"] == 20.0 and figures["batched_1_vs_native"] == 1.25


def test_each_peer_is_compared_at_the_bandwidth_probed_beside_it(tmp_path, monkeypatch):
    """A peer's llama-bench run is bracketed by read-bandwidth probes (their mean recorded), and our
    decode over its tg128 is also given per GB/s of each side's own probe: a peer that ran while the
    neighbours left it more bandwidth is not credited with it."""
    from specserve.bench import bandwidth
    from specserve.bench.models import _native

    probes = iter([40.0, 60.0])
    monkeypatch.setattr(bandwidth, "read_bandwidth_gbs", lambda threads: next(probes))
    monkeypatch.setattr(bandwidth, "gguf_step_bytes", lambda path: 1e9)
    fake = tmp_path / "llama-bench"  # prints what the real one does with -o json
    fake.write_text("#!/bin/sh\necho '[{\"n_gen\": 128, \"avg_ts\": 30.0}, {\"n_gen\": 0, \"avg_ts\": 90.0}]'\n")
    fake.chmod(0o755)
    ik = _native(str(fake), "m.gguf", 2)
    assert ik == {"step_bytes": 1e9, "tg128_tok_s": 30.0, "pp512_tok_s": 90.0, "read_bandwidth_gbs": 50.0}
    run = offline_run(40, 50)
    run["specserve"] |= {"decode_tok_s": 24.0, "read_bandwidth_gbs": 30.0, "decode_bandwidth_share": 0.8}
    run["ik_llama.cpp"] = ik
    figures = _figures(run, 32)
    assert figures["decode_vs_ik"] == 24.0 / 30.0  # raw: slower
    assert figures["decode_vs_ik_per_bandwidth"] == (24.0 / 30.0) / (30.0 / 50.0)  # 0.8 against 0.6 tokens per GB/s
    assert figures["ik_read_bandwidth_gbs"] == 50.0 and "decode_vs_native_per_bandwidth" not in figures  # no probe
    from benchmarks.render.engine import render_models_vs_ik

    run["native"] = {**ik, "tg128_tok_s": 20.0}
    figures = _figures(run, 32) | {"steady_decode_tok_s": 24.0}
    data = {"runs": 1, "new_tokens": 32, "window": 4, "threads": 2, "commit": "abc", "date": "2026-12-07",
            "machine": "a test machine", "llama_bench_args": "", "ik_llama_bench_args": "-rtr 1",
            "models": {"m": {"path": "m.gguf", "activations": "int8", "summary": summarize([figures]), "runs": [run]}}}
    (tmp_path / "models_vs_ik.json").write_text(json.dumps(data))
    text = render_models_vs_ik(str(tmp_path))
    assert "decode per GB/s of its probe: vs native / vs ik" in text and "| 2.00x (2.00-2.00) / 1.33x (1.33-1.33) |" in text


def test_the_batched_peer_reads_s_tg_from_llama_batched_bench_jsonl(tmp_path):
    fake = tmp_path / "llama-batched-bench"  # prints what the real one does with --output-format jsonl
    fake.write_text("#!/bin/sh\necho 'main: n_kv_max = 5376'\n"
                    "echo '{\"n_kv_max\": 5376, \"pp\": 128, \"tg\": 32, \"pl\": 1, \"speed_tg\": 30.5}'\n"
                    "echo '{\"n_kv_max\": 5376, \"pp\": 128, \"tg\": 32, \"pl\": 16, \"speed_tg\": 101.25}'\n"
                    "echo \"$@\" > \"$0.args\"\n")
    fake.chmod(0o755)
    assert _batched_peer(str(fake), "m.gguf", 2, [1, 16]) == {"1": 30.5, "16": 101.25}
    args = (tmp_path / "llama-batched-bench.args").read_text().split()
    assert args[args.index("-npl") + 1] == "1,16" and args[args.index("-npp") + 1] == "128"
    assert int(args[args.index("-c") + 1]) >= 16 * (128 + 32)  # room for every sequence's K/V


def test_arithmetic_figures_price_each_step_against_the_measured_peak_and_bandwidth():
    run = offline_run(40, 50) | {"activations": "int8"}
    run["specserve"] |= {"linear_macs_per_row": 1e9, "head_macs": 2e8, "window": 4, "verify_4_rows_ms": 50.0,
                         "decode_1_row_ms": 40.0, "prefill_len": 512, "prefill_tok_s": 256.0, "clock_ghz": 2.5,
                         "probe_threads": 2, "int8_dot_per_s": 2.5e9 * 2 * 2, "int8_macs_per_cycle_per_core_peak": 128.0,
                         "weights_streamed_mib": 1000.0, "read_bandwidth_gbs": 50.0}
    figures = _figures(run, 32)
    assert figures["decode_macs_per_cycle_per_core"] == pytest.approx(1e9 / 0.04 / 5e9)  # 5
    assert figures["window_macs_per_cycle_per_core"] == pytest.approx(4e9 / 0.05 / 5e9)  # 16
    # a prefill's head runs for its last row only: 512 rows in 2 s
    assert figures["prefill_share_of_int8_peak"] == pytest.approx((512 * 8e8 + 2e8) / 2.0 / (1e10 * 64))
    assert figures["decode_bandwidth_share"] == pytest.approx(1000 * 2**20 / 0.04 / 1e9 / 50)
    assert figures["prefill_head_counted_per_row"] == 0.0
    assert "decode_macs_per_cycle_per_core" not in _figures(offline_run(40, 50) | {"activations": "int8"}, 32)
    assert "decode_macs_per_cycle_per_core" not in _figures({**run, "activations": "bf16"}, 32)  # VDPBF16PS, not priced
    moe = {**run, "specserve": {**run["specserve"], "verify_experts_per_layer": 11.0, "decode_experts_per_layer": 8.0}}
    assert "window_weight_gb_s" not in _figures(moe, 32) and "decode_weight_gb_s" in _figures(moe, 32)
