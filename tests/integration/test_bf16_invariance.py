"""bf16 (the default dtype) is batch-, cache-, chunk- and window-invariant: a token's logits are
bitwise the same however the step that computes it is shaped, and greedy output is the same for
every speculative algorithm, loop mode, batch and cache state.

The logit tests drive the model directly over a private KV pool; the mutation test routes the
row counts of a verify window (6..32) through a different kernel (oneDNN bf16, as the engine did
before) and checks that the same comparison then fails.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from helpers import chat_prompts, int8_activations, policy_args

from specserve import Engine
from specserve.kv.pool import KVPool, ReqToTokenPool
from specserve.models import layers
from specserve.models.forward_batch import ForwardBatch

CONTENTS = ["Name three colors.", "Explain in detail how photosynthesis works.",
            "Write a Python function that reverses a string.", "List ten fun facts about octopuses."]
GREEDY = {"temperature": 0, "max_new_tokens": 40}


@pytest.fixture(scope="module")
def bf16_engine():
    engine = Engine(dtype="bfloat16", cpu_activations="bf16", max_total_tokens=8192, speculative_algorithm="NONE")
    yield engine
    engine.shutdown()


class Steps:
    """Forward passes of the engine's model over a private pool; each request owns a table row."""

    def __init__(self, model, requests: int, max_len: int):
        cfg = model.config
        self.model = model
        self.kv = KVPool(requests * max_len, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype)
        self.table = ReqToTokenPool(requests, max_len)
        for r in range(requests):
            self.table.write(r, 0, list(range(1 + r * max_len, 1 + (r + 1) * max_len)))

    def run(self, parts: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
        """One pass: parts are (request, token ids, start position); logits of every row, per part."""
        ids = [t for _, toks, _ in parts for t in toks]
        pos = [start + i for _, toks, start in parts for i in range(len(toks))]
        loc = [int(self.table.table[r, p]) for (r, toks, start) in parts for p in range(start, start + len(toks))]
        meta = self.model.ops.attention_metadata(self.table.table, [r for r, _, _ in parts],
                                                 [start + len(toks) for _, toks, start in parts],
                                                 [len(toks) for _, toks, _ in parts], "cpu")
        fb = ForwardBatch(torch.tensor(ids), torch.tensor(pos), torch.tensor(loc), meta, torch.arange(len(ids)))
        return list(self.model(fb, self.kv).split([len(toks) for _, toks, _ in parts]))


def shape_mismatches(model, tokens: list[int]) -> list[str]:
    """Compute every position of `tokens` in differently shaped steps and name the shapes whose
    logits differ from one whole prefill (an empty list means bitwise invariant)."""
    n, rng = len(tokens), random.Random(0)
    others = [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 60))] for _ in range(32)]
    steps = Steps(model, 1 + len(others), 128)
    reference = steps.run([(0, tokens, 0)])[0]
    bad = []
    for chunk in (1, 5, 16):  # chunked prefill; each chunk extends the cached prefix
        for start in range(0, n, chunk):
            got = steps.run([(0, tokens[start:start + chunk], start)])[0]
            if not torch.equal(got, reference[start:start + chunk]):
                bad.append(f"prefill chunk {chunk} at {start}")
    steps.run([(r + 1, o, 0) for r, o in enumerate(others)])  # the other requests' prefixes
    for batch in (1, 3, 8, 33):  # position n-1 decoded next to batch-1 other requests
        parts = [(0, tokens[n - 1:], n - 1)] + [(r + 1, o[-1:], len(o) - 1) for r, o in enumerate(others[:batch - 1])]
        if not torch.equal(steps.run(parts)[0], reference[n - 1:]):
            bad.append(f"decode in a batch of {batch}")
    window = [(0, tokens[n - 6:], n - 6)] + [(r + 1, o[-6:], len(o) - 6) for r, o in enumerate(others[:7]) if len(o) >= 6]
    if not torch.equal(steps.run(window)[0], reference[n - 6:]):  # a batch of 6-row verify windows
        bad.append("6-row verify window")
    return bad


def test_a_tokens_logits_do_not_depend_on_the_step_shape(bf16_engine):
    tokens = chat_prompts(bf16_engine, CONTENTS[:1])[0] + bf16_engine.tokenizer.encode(" Red, green and blue.")
    assert shape_mismatches(bf16_engine.runner.model, tokens) == []


def test_int8_activations_keep_a_tokens_logits_independent_of_the_step_shape(bf16_engine):
    """--cpu-activations int8: each row is quantized alone, so the invariance holds as it is."""
    tokens = chat_prompts(bf16_engine, CONTENTS[:1])[0] + bf16_engine.tokenizer.encode(" Red, green and blue.")
    model = bf16_engine.runner.model
    bf16_logits = Steps(model, 1, 128).run([(0, tokens, 0)])[0]
    with int8_activations(model) as switched:
        assert switched >= 4 * model.config.num_layers  # every projection
        assert not torch.equal(Steps(model, 1, 128).run([(0, tokens, 0)])[0], bf16_logits)  # int8 is really on
        assert shape_mismatches(model, tokens) == []


def test_mutation_routing_some_row_counts_elsewhere_breaks_invariance(bf16_engine, monkeypatch):
    original = layers._ParallelLinear.matmul
    dense: dict[int, torch.Tensor] = {}  # a layer packed from GGUF codes keeps no weight: read it from them

    def weight(layer) -> torch.Tensor:
        if layer.weight.numel():
            return layer.weight
        if id(layer) not in dense:
            dense[id(layer)] = layer.kernel.dense_rows(torch.arange(layer.kernel.n)).to(layer.weight.dtype)
        return dense[id(layer)]

    def oneDNN_for_mid_row_counts(self, x, out_dtype=None):
        rows = x.numel() // x.shape[-1]
        if 6 <= rows <= 32:  # the row counts of verify windows and small batches
            y = F.linear(x, weight(self))
            return y if out_dtype is None else y.to(out_dtype)
        return original(self, x, out_dtype)

    monkeypatch.setattr(layers._ParallelLinear, "matmul", oneDNN_for_mid_row_counts)
    monkeypatch.setattr(bf16_engine.runner.model, "native", None)  # the per-op layers, where the matmul is planted
    tokens = chat_prompts(bf16_engine, CONTENTS[:1])[0] + bf16_engine.tokenizer.encode(" Red, green and blue.")
    bad = shape_mismatches(bf16_engine.runner.model, tokens)
    assert "6-row verify window" in bad and "decode in a batch of 8" in bad, bad


FIXED = dict(speculative_policy="fixed")
CONFIGS = {
    "NONE overlap": dict(speculative_algorithm="NONE"),
    "NONE sync": dict(speculative_algorithm="NONE", disable_overlap_schedule=True),
    "NGRAM": dict(speculative_algorithm="NGRAM", **FIXED),
    "DSPARK static": dict(speculative_algorithm="DSPARK", speculative_verify_mode="static", **FIXED),
    "DSPARK compact": dict(speculative_algorithm="DSPARK", speculative_verify_mode="compact", **FIXED),
    "DSPARK sync eager": dict(speculative_algorithm="DSPARK", speculative_verify_mode="static",
                              disable_overlap_schedule=True, disable_cuda_graph=True, **FIXED),
    # The default: the adaptive policy over DSPARK and NGRAM (on a frozen table where drafting pays).
    "policy": policy_args(),
    "policy sync eager": dict(disable_overlap_schedule=True, disable_cuda_graph=True, **policy_args()),
}


@pytest.fixture(scope="module")
def greedy_reference(bf16_engine):
    prompts = chat_prompts(bf16_engine, CONTENTS)
    bf16_engine.scheduler.ledger.tree.reset()
    return prompts, [bf16_engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]


# Drafts depend only on the request when every window is verified whole (compact mode plans
# verify lengths for the whole batch), so acceptance must match alone and batched too.
SAME_ACCEPTANCE = {"NGRAM", "DSPARK static", "DSPARK sync eager"}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_output_is_identical_alone_batched_cold_and_warm(name, greedy_reference):
    prompts, reference = greedy_reference
    with Engine(dtype="bfloat16", cpu_activations="bf16", max_total_tokens=8192, **CONFIGS[name]) as engine:
        cold = [engine.generate(input_ids=p, sampling_params=GREEDY) for p in prompts]
        warm = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
        engine.scheduler.ledger.tree.reset()
        batched = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in cold] == reference, f"{name}: cold cache, one at a time"
    assert warm == reference, f"{name}: warm cache"
    assert [o["output_ids"] for o in batched] == reference, f"{name}: batched"
    if name in SAME_ACCEPTANCE:
        accepted = [[o["meta_info"]["spec_correct_drafts_histogram"] for o in outs] for outs in (cold, batched)]
        assert accepted[0] == accepted[1], f"{name}: accepted drafts differ alone and batched"
        assert sum(o["meta_info"]["spec_num_correct_drafts"] for o in cold) > 0, f"{name}: nothing was accepted"


INT8 = dict(cpu_activations="int8", dtype="bfloat16", max_total_tokens=8192)
INT8_CONFIGS = {"NGRAM": dict(speculative_algorithm="NGRAM", **FIXED),
                "DSPARK compact": dict(speculative_algorithm="DSPARK", speculative_verify_mode="compact", **FIXED)}


@pytest.fixture(scope="module")
def int8_reference(bf16_engine):
    prompts = chat_prompts(bf16_engine, CONTENTS)
    with Engine(speculative_algorithm="NONE", **INT8) as engine:
        return prompts, [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]


@pytest.mark.parametrize("name", list(INT8_CONFIGS))
def test_int8_activations_greedy_output_is_lossless_alone_batched_and_warm(name, int8_reference):
    prompts, reference = int8_reference
    with Engine(**INT8, **INT8_CONFIGS[name]) as engine:
        alone = [engine.generate(input_ids=p, sampling_params=GREEDY) for p in prompts]
        batched = engine.generate(input_ids=prompts, sampling_params=GREEDY)  # warm cache
    assert [o["output_ids"] for o in alone] == reference, f"int8 {name}: one at a time"
    assert sum(o["meta_info"]["spec_num_correct_drafts"] for o in alone) > 0, f"int8 {name}: nothing was accepted"
    assert [o["output_ids"] for o in batched] == reference, f"int8 {name}: batched, warm cache"


SEEDED = {"temperature": 0.7, "top_p": 0.95, "seed": 5, "max_new_tokens": 40}


@pytest.mark.parametrize("name", ["NGRAM", "DSPARK static"])
def test_seeded_sampling_in_bf16_is_plain_decodings_alone_and_batched(name, greedy_reference, bf16_engine):
    """The coupled accept's promise in bf16, the default: a seeded sampling request's tokens are
    plain decoding's whatever the drafter proposed, alone and batched."""
    prompts, _ = greedy_reference
    bf16_engine.scheduler.ledger.tree.reset()
    reference = [bf16_engine.generate(input_ids=p, sampling_params=SEEDED)["output_ids"] for p in prompts]
    with Engine(dtype="bfloat16", cpu_activations="bf16", max_total_tokens=8192, **CONFIGS[name]) as engine:
        alone = [engine.generate(input_ids=p, sampling_params=SEEDED) for p in prompts]
        engine.scheduler.ledger.tree.reset()
        batched = engine.generate(input_ids=prompts, sampling_params=SEEDED)
    assert [o["output_ids"] for o in alone] == reference, f"{name}: one at a time"
    assert [o["output_ids"] for o in batched] == reference, f"{name}: batched"
    assert sum(o["meta_info"].get("spec_verify_ct", 0) for o in alone) > 0, f"{name}: nothing was verified"
