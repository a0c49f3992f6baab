"""`--cpu-activations auto` (models/activations.py): one rule by weight type, the measurements it
stands on, and the greedy gate `bench quality` still reports beside them (bench/int8_gate.py)."""

from __future__ import annotations

import json
import os

import pytest

from specserve.args import ServerArgs
from specserve.bench.int8_gate import int8_verdict, int8_verdict_vs_bf16
from specserve.bench.quality import greedy_paired, until_stop
from specserve.models.activations import DEQUANTIZED_REASON, INT8_REASON, OFF_CPU_REASON, choose_cpu_activations, \
    with_resolved_activations

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "bench_results")
TOP1_RECORDS = ("quality_top1_smollm2.json", "quality_top1_qwen2.5-coder-0.5b.json", "quality_top1_gemma-3-270m.json")


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


def test_auto_takes_int8_for_quantized_weights_on_cpu_and_bf16_elsewhere():
    assert ServerArgs().cpu_activations == "auto"  # resolved when the engine builds (Engine)
    assert choose_cpu_activations("auto", "cpu", "auto") == ("int8", INT8_REASON)
    assert choose_cpu_activations("auto", "cuda:0", "auto") == ("bf16", OFF_CPU_REASON)  # the flag sets CPU kernels only
    assert choose_cpu_activations("auto", "cpu", "none") == ("bf16", DEQUANTIZED_REASON)  # no codes left to take int8
    for choice in ("bf16", "int8"):  # an explicit choice stands, and says it was asked for
        assert choose_cpu_activations(choice, "cpu", "auto") == (choice, f"--cpu-activations {choice}")
    assert with_resolved_activations(ServerArgs()).cpu_activations == "int8"  # the default file too (no record read)
    assert with_resolved_activations(ServerArgs(cpu_activations="bf16")).cpu_activations == "bf16"
    with pytest.raises(ValueError, match="cpu_activations"):
        ServerArgs(cpu_activations="int4")


def test_the_rule_stands_on_the_committed_measurements_against_llama_cpp():
    """The rule's premise, read from the committed records (`bench quality --peer-llama-cpp`): on
    every real file int8 activations put fp32's token first no less often than llama.cpp's own
    8-bit activations beyond paired noise, at a perplexity no further from fp32's. A re-measured
    record that broke it fails here, so the default cannot outlive its evidence."""
    for name in TOP1_RECORDS:
        with open(os.path.join(RESULTS, name)) as f:
            data = json.load(f)
        int8, peer = data["int8_activations"], data["llama.cpp"]
        paired = int8["top1_vs_llama_cpp"]
        assert paired["only_theirs"] - paired["only_ours"] <= 2 * paired["noise"], name
        assert int8["over_fp32_perplexity"] <= peer["over_fp32_perplexity"] * 1.001, name


def test_greedy_answers_compare_up_to_the_end_of_sequence_and_pair_against_a_third_arm():
    assert until_stop([[5, 6, 2, 7], [5, 6], [2]], (2,)) == [[5, 6], [5, 6], []]
    report = {"int8_activations": {"greedy_vs_fp32": {"identical_each": [True, True, False, False, True]}},
              "llama.cpp": {"greedy_vs_fp32": {"identical_each": [True, False, True, False, False]}}}
    paired = greedy_paired(report, "llama.cpp")
    assert (paired["only_ours"], paired["only_theirs"]) == (2, 1) and paired["noise"] == pytest.approx(3 ** 0.5)
