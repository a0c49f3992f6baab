"""`--cpu-activations auto` (models/int8_gate.py): the quality gate's rule, its record, and the
choice it makes per model file."""

from __future__ import annotations

import json

import pytest

from specserve.args import ServerArgs
from specserve.models.int8_gate import RECORD, int8_verdict, load_record, record_verdict, resolve_cpu_activations


def report(int8_perplexity: float, bf16_identical: float, int8_identical: float, prompts: int = 32) -> dict:
    return {"num_prompts": prompts,
            "bfloat16": {"over_fp32_perplexity": 1.0002, "greedy_vs_fp32": {"identical_outputs": bf16_identical}},
            "int8_activations": {"over_fp32_perplexity": int8_perplexity,
                                 "greedy_vs_fp32": {"identical_outputs": int8_identical}}}


def test_the_gate_needs_perplexity_within_0_3_percent_and_greedy_matches_within_noise():
    assert int8_verdict(report(1.0003, 0.625, 0.594))["int8"]  # Qwen's measured figures
    low_ppl = int8_verdict(report(1.0040, 0.625, 0.625))
    assert not low_ppl["int8"] and not low_ppl["perplexity_ok"] and low_ppl["greedy_ok"]
    fewer = int8_verdict(report(1.0025, 0.469, 0.1875))  # the default model's, int8 everywhere but QKV
    assert not fewer["int8"] and fewer["perplexity_ok"] and not fewer["greedy_ok"]
    # the same shortfall over more prompts is further outside the noise; over very few it is inside
    assert int8_verdict(report(1.0, 0.5, 0.4, prompts=8))["int8"]
    assert not int8_verdict(report(1.0, 0.5, 0.4, prompts=400))["int8"]


def fake_model(tmp_path, name: str, content: bytes):
    path = tmp_path / name
    path.write_bytes(content)
    return str(path)


def test_auto_picks_int8_only_for_a_recorded_passing_file(tmp_path):
    record = str(tmp_path / "quality" / "int8.json")
    passing = fake_model(tmp_path, "a.gguf", b"GGUF-passing-model")
    failing = fake_model(tmp_path, "b.gguf", b"GGUF-failing-model")
    lookalike = fake_model(tmp_path, "c.gguf", b"GGUF-passing-modeX")  # same size, other bytes
    unmeasured = fake_model(tmp_path, "d.gguf", b"GGUF-never-measured-model")
    stamp = {"commit": "c0ffee", "date": "today", "machine": "here"}
    record_verdict(passing, int8_verdict(report(1.0003, 0.625, 0.594)), stamp, record)
    record_verdict(failing, int8_verdict(report(1.0040, 0.625, 0.625)), stamp, record)
    assert [e["file"] for e in load_record(record)] == ["a.gguf", "b.gguf"]

    def auto(path, device="cpu"):
        return resolve_cpu_activations("auto", path, device, record)

    assert auto(passing) == "int8"
    assert [auto(failing), auto(lookalike), auto(unmeasured)] == ["bf16"] * 3
    assert auto(passing, device="cuda") == "bf16"  # the flag sets only the CPU kernels
    assert auto(str(tmp_path / "missing.gguf")) == "bf16"  # the engine reports the missing file itself
    assert [resolve_cpu_activations(c, passing, "cpu", record) for c in ("bf16", "int8")] == ["bf16", "int8"]
    assert resolve_cpu_activations("int8", failing, "cpu", record) == "int8"  # an explicit choice stands

    # a re-measured file replaces its verdict rather than adding a second one
    record_verdict(passing, int8_verdict(report(1.0040, 0.625, 0.625)), stamp, record)
    assert len(load_record(record)) == 2 and auto(passing) == "bf16"


def test_auto_is_the_default_and_the_default_model_resolves_to_bf16():
    assert ServerArgs().cpu_activations == "auto"  # resolved when the engine builds (Engine._build)
    assert resolve_cpu_activations("auto", None, "cpu") == "bf16"  # the shipped record: the default file failed
    with pytest.raises(ValueError, match="cpu_activations"):
        ServerArgs(cpu_activations="int4")


def test_the_shipped_record_is_well_formed():
    with open(RECORD) as f:
        files = json.load(f)["files"]
    assert files, "no verdicts recorded"
    for entry in files:
        assert set(entry) >= {"file", "bytes", "sha256", "int8", "perplexity_over_fp32", "greedy_identical", "commit"}
        assert len(entry["sha256"]) == 64 and entry["bytes"] > 0
        assert entry["int8"] == (entry["perplexity_ok"] and entry["greedy_ok"])
