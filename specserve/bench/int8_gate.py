"""The greedy-answer gate that once chose int8 activations file by file, kept as a comparison in
`specserve bench quality` reports: int8's perplexity within 0.3% of fp32's, and its greedy MT-Bench
answers identical to fp32's no fewer than bf16's, beyond paired noise (or, where fp32 does not fit,
judged against bf16 on the same file). The default no longer reads any verdict: `--cpu-activations
auto` follows one rule by weight type (models/activations.py), set against llama.cpp's own 8-bit
activations measured the same way (top-1 agreement with fp32, and this gate's greedy counts with
llama.cpp as a third arm).
"""

from __future__ import annotations

import math
from typing import Any

from specserve.errors import ConfigError

PERPLEXITY_LIMIT = 1.003  # int8's perplexity over fp32's at most this
NOISE_SIGMAS = 2.0  # how far int8's matches may fall below bf16's (standard deviations of the paired difference)
MIN_BF16_PREFIX = 0.5  # the bf16-reference gate: int8's greedy outputs follow bf16's this far on average


def int8_verdict(report: dict[str, Any]) -> dict[str, Any]:
    """The gate on one `bench quality` report: int8's perplexity within 0.3% of fp32's, and its
    greedy outputs identical to fp32's on no fewer prompts than bf16's, beyond noise. The two
    variants answer the same prompts, so the test is paired (McNemar's): of the prompts where
    exactly one of them matches fp32, bf16-only (b) may exceed int8-only (c) by at most two
    standard deviations of b - c under no difference, 2 sqrt(b + c)."""
    bf16, int8 = report["bfloat16"], report["int8_activations"]
    pairs = list(zip(bf16["greedy_vs_fp32"]["identical_each"], int8["greedy_vs_fp32"]["identical_each"]))
    if not pairs:
        raise ConfigError("the int8 gate needs at least one greedy prompt")
    bf16_only = sum(a and not b for a, b in pairs)
    int8_only = sum(b and not a for a, b in pairs)
    noise = NOISE_SIGMAS * math.sqrt(bf16_only + int8_only)
    perplexity_ok = int8["over_fp32_perplexity"] <= PERPLEXITY_LIMIT
    greedy_ok = bf16_only - int8_only <= noise
    return {
        "int8": perplexity_ok and greedy_ok,
        "perplexity_ok": perplexity_ok,
        "greedy_ok": greedy_ok,
        "perplexity_over_fp32": {"bf16": bf16["over_fp32_perplexity"], "int8": int8["over_fp32_perplexity"]},
        "greedy_identical": {"bf16": sum(a for a, _ in pairs), "int8": sum(b for _, b in pairs)},
        "greedy_only": {"bf16": bf16_only, "int8": int8_only},
        "greedy_noise": noise,
        "prompts": len(pairs),
    }


def int8_verdict_vs_bf16(report: dict[str, Any]) -> dict[str, Any]:
    """The gate where an fp32 reference is unaffordable (a 7B file's fp32 weights alone exceed these
    machines' memory): int8 against bf16 activations on the same file. int8's perplexity within 0.3%
    of bf16's, and its greedy outputs following bf16's for at least MIN_BF16_PREFIX of their tokens
    on average before the first difference. A weaker test than the fp32 gate (bf16's own distance
    from fp32 is not measured), so its verdicts are recorded with their reference."""
    int8 = report["int8_activations"]
    ratio = int8["perplexity"] / report["bfloat16"]["perplexity"]
    prefix = int8["greedy_vs_bf16"]["mean_matching_prefix"]
    perplexity_ok, greedy_ok = ratio <= PERPLEXITY_LIMIT, prefix >= MIN_BF16_PREFIX
    return {
        "int8": perplexity_ok and greedy_ok,
        "reference": "bf16",
        "perplexity_ok": perplexity_ok,
        "greedy_ok": greedy_ok,
        "perplexity_over_bf16": ratio,
        "mean_matching_prefix": prefix,
        "greedy_identical": {"int8_vs_bf16": sum(int8["greedy_vs_bf16"]["identical_each"])},
        "prompts": len(int8["greedy_vs_bf16"]["identical_each"]),
    }
