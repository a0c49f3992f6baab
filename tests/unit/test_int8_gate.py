"""`--cpu-activations auto` (models/int8_gate.py): the quality gate's rule, its record, and the
choice it makes per model file."""

from __future__ import annotations

import json

import pytest

from specserve.args import ServerArgs
from specserve.models.int8_gate import (RECORD, int8_verdict, int8_verdict_vs_bf16, load_record, record_verdict,
                                        resolve_cpu_activations)


def report(int8_perplexity: float, bf16_each: list[bool], int8_each: list[bool]) -> dict:
    def variant(perplexity: float, each: list[bool]) -> dict:
        return {"over_fp32_perplexity": perplexity, "greedy_vs_fp32": {"identical_each": each}}

    return {"bfloat16": variant(1.0002, bf16_each), "int8_activations": variant(int8_perplexity, int8_each)}


def matches(n: int, both: int, bf16_only: int, int8_only: int) -> tuple[list[bool], list[bool]]:
    """Per-prompt matches of n prompts: `both` matched by both, then the discordant ones."""
    neither = n - both - bf16_only - int8_only
    bf16 = [True] * both + [True] * bf16_only + [False] * int8_only + [False] * neither
    int8 = [True] * both + [False] * bf16_only + [True] * int8_only + [False] * neither
    return bf16, int8


def test_the_gate_needs_perplexity_within_0_3_percent_and_greedy_matches_within_paired_noise():
    close = int8_verdict(report(1.0003, *matches(32, 18, 2, 1)))
    assert close["int8"] and close["greedy_only"] == {"bf16": 2, "int8": 1} and close["greedy_identical"]["bf16"] == 20
    low_ppl = int8_verdict(report(1.0040, *matches(32, 20, 0, 0)))
    assert not low_ppl["int8"] and not low_ppl["perplexity_ok"] and low_ppl["greedy_ok"]
    fewer = int8_verdict(report(1.0025, *matches(32, 4, 11, 0)))  # 15 against 4 of 32 (2 sqrt 11 = 6.6 < 11)
    assert not fewer["int8"] and fewer["perplexity_ok"] and not fewer["greedy_ok"]
    # the same share of discordant prompts over more prompts is outside the noise; over few, inside
    assert int8_verdict(report(1.0, *matches(10, 3, 3, 1)))["int8"]  # 2 <= 2 sqrt 4
    assert not int8_verdict(report(1.0, *matches(100, 30, 30, 10)))["int8"]  # 20 > 2 sqrt 40
    with pytest.raises(ValueError, match="at least one"):
        int8_verdict(report(1.0, [], []))


def bf16_reference_report(bf16_ppl: float, int8_ppl: float, prefix: float, identical: list[bool]) -> dict:
    return {"bfloat16": {"perplexity": bf16_ppl},
            "int8_activations": {"perplexity": int8_ppl,
                                 "greedy_vs_bf16": {"mean_matching_prefix": prefix, "identical_each": identical}}}


def test_the_bf16_reference_gate_needs_perplexity_within_0_3_percent_of_bf16_and_half_the_tokens_followed():
    passing = int8_verdict_vs_bf16(bf16_reference_report(8.0, 8.02, 0.7, [True, False, True]))
    assert passing["int8"] and passing["reference"] == "bf16" and passing["greedy_identical"]["int8_vs_bf16"] == 2
    assert passing["perplexity_over_bf16"] == pytest.approx(1.0025)
    high = int8_verdict_vs_bf16(bf16_reference_report(8.0, 8.03, 0.9, [True]))  # 1.00375 > 1.003
    assert not high["int8"] and not high["perplexity_ok"] and high["greedy_ok"]
    early = int8_verdict_vs_bf16(bf16_reference_report(8.0, 8.0, 0.45, [False]))
    assert not early["int8"] and early["perplexity_ok"] and not early["greedy_ok"]


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
    record_verdict(passing, int8_verdict(report(1.0003, *matches(32, 18, 2, 1))), stamp, record)
    record_verdict(failing, int8_verdict(report(1.0040, *matches(32, 18, 2, 1))), stamp, record)
    with pytest.raises(ValueError, match="num-prompts"):  # too few prompts to ship a verdict
        record_verdict(passing, int8_verdict(report(1.0003, *matches(8, 5, 0, 0))), stamp, record)
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
    record_verdict(passing, int8_verdict(report(1.0040, *matches(32, 18, 2, 1))), stamp, record)
    assert len(load_record(record)) == 2 and auto(passing) == "bf16"


def test_auto_is_the_default_and_the_default_model_resolves_to_bf16():
    assert ServerArgs().cpu_activations == "auto"  # resolved when the engine builds (Engine)
    default = [e for e in load_record() if e["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert len(default) == 1 and not default[0]["int8"]  # the shipped record: the default file failed
    assert resolve_cpu_activations("auto", None, "cpu") == "bf16"
    with pytest.raises(ValueError, match="cpu_activations"):
        ServerArgs(cpu_activations="int4")


def test_the_shipped_record_is_well_formed():
    with open(RECORD) as f:
        files = json.load(f)["files"]
    assert files, "no verdicts recorded"
    for entry in files:
        assert set(entry) >= {"file", "bytes", "sha256", "int8", "perplexity_over_fp32", "greedy_identical", "greedy_only",
                              "commit"}
        assert entry["prompts"] >= 32
        assert len(entry["sha256"]) == 64 and entry["bytes"] > 0
        assert entry["int8"] == (entry["perplexity_ok"] and entry["greedy_ok"])
