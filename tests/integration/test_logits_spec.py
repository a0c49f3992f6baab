"""Penalties, logit bias and logprobs stay exact under speculative decoding (fp32, the real model).

Each verify row's logits are shaped with the output before that row, drafts included, so greedy
output with penalties is token-identical to NONE's, every committed token's logprob equals the
one a plain decode computes, and a sampled position keeps the penalised target distribution.
The mutation test drops the drafts from the verify rows' history and shows the equality test fails.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from helpers import chat_prompts, prefill_logits

from specserve.executor.request_logits import RequestLogits
from specserve.logits.penalties import shape_logits
from specserve.sampling_params import SamplingParams

CONTENTS = ["Write the word 'hello' twelve times, separated by spaces.", "Count from 1 to 20, separated by commas.",
            "List the days of the week."]
PENALISED = {"temperature": 0, "max_new_tokens": 32, "frequency_penalty": 0.4, "presence_penalty": 0.2,
             "repetition_penalty": 1.1, "logit_bias": {"28": 1.5}, "logprobs": True, "top_logprobs": 3}
# A negative presence penalty invites repetition that the frequency penalty then ends: long accepted
# runs of repeated tokens, so the drafts inside a window change a verify row's penalties.
REPEATING = {"temperature": 0, "max_new_tokens": 32, "frequency_penalty": 0.3, "presence_penalty": -0.8,
             "logprobs": True, "top_logprobs": 3}


@pytest.fixture(scope="module")
def spec_engines(fp32_spec_engines):
    return fp32_spec_engines


@pytest.fixture(scope="module")
def prompts(fp32_engine):
    return chat_prompts(fp32_engine, CONTENTS)


@pytest.fixture(scope="module")
def reference(fp32_engine, prompts):
    return {name: fp32_engine.generate(input_ids=prompts, sampling_params=params)
            for name, params in (("penalised", PENALISED), ("repeating", REPEATING))}


def _accepted(outputs) -> int:
    return sum(o["meta_info"].get("spec_num_correct_drafts", 0) for o in outputs)


@pytest.mark.parametrize("alg", ["NGRAM", "DSPARK"])
@pytest.mark.parametrize("name, params", [("penalised", PENALISED), ("repeating", REPEATING)])
def test_penalised_greedy_output_and_logprobs_equal_none(spec_engines, prompts, reference, alg, name, params):
    outputs = spec_engines[alg].generate(input_ids=prompts, sampling_params=params)
    assert _accepted(outputs) > 0  # accepted drafts: verify rows were shaped and reported
    for ref, out in zip(reference[name], outputs):
        assert out["output_ids"] == ref["output_ids"]
        mine, theirs = out["meta_info"]["output_token_logprobs"], ref["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in mine] == out["output_ids"]
        assert [lp for lp, _, _ in mine] == pytest.approx([lp for lp, _, _ in theirs], abs=1e-4)
        for (lp, tok, _), top in zip(mine, out["meta_info"]["output_top_logprobs"]):
            values = [v for v, _, _ in top]
            assert len(top) == 3 and values == sorted(values, reverse=True)
            assert lp <= values[0] + 1e-6  # greedy picks the top token of the shaped logits
            assert top[0][1] == tok


def test_mutation_verify_rows_without_their_drafts_break_equality(spec_engines, prompts, reference, monkeypatch):
    original = RequestLogits.shape
    monkeypatch.setattr(RequestLogits, "shape", lambda self, logits, rows, params, windows=None:
                        original(self, logits, rows, params, None))
    outputs = spec_engines["NGRAM"].generate(input_ids=prompts, sampling_params=REPEATING)
    assert [o["output_ids"] for o in outputs] != [r["output_ids"] for r in reference["repeating"]]


def test_logprobs_without_penalties_equal_none_and_keep_the_folded_accept(fp32_engine, spec_engines, prompts):
    params = {"temperature": 0, "max_new_tokens": 24, "logprobs": True}
    ref = fp32_engine.generate(input_ids=prompts, sampling_params=params)
    out = spec_engines["NGRAM"].generate(input_ids=prompts, sampling_params=params)
    for r, o in zip(ref, out):
        assert o["output_ids"] == r["output_ids"] and "output_top_logprobs" not in o["meta_info"]
        assert [x[0] for x in o["meta_info"]["output_token_logprobs"]] == pytest.approx(
            [x[0] for x in r["meta_info"]["output_token_logprobs"]], abs=1e-4)


def test_sampled_position_keeps_the_penalised_distribution(fp32_engine, spec_engines):
    """The second token (the first verify window's accept or bonus) given the modal first token:
    chi-square against the exact penalised distribution from the model's logits."""
    prompt = chat_prompts(fp32_engine, ["Name a color."])[0]
    params = {"temperature": 0.6, "max_new_tokens": 2, "frequency_penalty": 1.0, "presence_penalty": 0.5,
              "logit_bias": {"28": 2.0}}
    n = 400
    outs = spec_engines["DSPARK"].generate(input_ids=[prompt] * n,
                                           sampling_params=[{**params, "seed": s} for s in range(n)])
    pairs = [tuple(o["output_ids"]) for o in outs if len(o["output_ids"]) == 2]
    first = Counter(a for a, _ in pairs).most_common(1)[0][0]
    seconds = Counter(b for a, b in pairs if a == first)
    total = sum(seconds.values())
    assert total >= 150, seconds
    logits = prefill_logits(fp32_engine.runner.model, prompt + [first])[-1:].float()
    shaped = shape_logits(logits, [SamplingParams(**params)], [prompt], [[first]])
    probs = torch.softmax(shaped[0] / params["temperature"], -1)
    stat, dof = _chi_square(seconds, probs, total)
    assert _chi_square_sf(stat, dof) > 1e-3, (stat, dof, seconds.most_common(8))


def _chi_square(observed: Counter, probs: torch.Tensor, total: int) -> tuple[float, int]:
    """Pearson's statistic over the tokens expected at least 5 times, the rest lumped into one cell."""
    big = [t for t in torch.argsort(probs, descending=True).tolist()[:50] if probs[t] * total >= 5]
    cells = [(observed.get(t, 0), float(probs[t]) * total) for t in big]
    rest_expected = total - sum(e for _, e in cells)
    cells.append((total - sum(o for o, _ in cells), rest_expected))
    stat = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    return stat, len(cells) - 1


def _chi_square_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof), by the regularized upper incomplete gamma (series)."""
    a, x = dof / 2, stat / 2
    if x == 0:
        return 1.0
    term = total = 1 / a
    k = 0
    while term > 1e-12 * total:
        k += 1
        term *= x / (a + k)
        total += term
    lower = math.exp(-x + a * math.log(x) - math.lgamma(a)) * total
    return max(0.0, 1.0 - lower)


def test_prompt_logprobs_equal_a_prefill_and_bypass_the_prefix_cache(fp32_engine, spec_engines, prompts):
    params = {"temperature": 0, "max_new_tokens": 2, "prompt_logprobs": True, "logprobs": True, "top_logprobs": 2}
    runs = [fp32_engine.generate(input_ids=prompts, sampling_params=params) for _ in range(2)]  # 2nd: cached prefix
    runs.append(spec_engines["DSPARK"].generate(input_ids=prompts, sampling_params=params))
    for i, prompt in enumerate(prompts):
        reference = torch.log_softmax(prefill_logits(fp32_engine.runner.model, prompt).float(), -1)
        want = [float(reference[k, prompt[k + 1]]) for k in range(len(prompt) - 1)]
        for run in runs:
            scored = run[i]["meta_info"]["input_token_logprobs"]
            assert scored[0] == [None, prompt[0], None] and [t for _, t, _ in scored] == prompt
            assert [lp for lp, _, _ in scored[1:]] == pytest.approx(want, abs=1e-4)
            assert run[i]["meta_info"]["cached_tokens"] == 0
