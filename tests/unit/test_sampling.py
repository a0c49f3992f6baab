"""SamplingParams validation and the batched, counter-seeded sampler."""

import math

import pytest
import torch

from specserve.sampler import counter_uniform, filtered_probs, sample
from specserve.sampling_params import SamplingParams

# ---------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize("field,value", [
    ("max_new_tokens", -1),
    ("max_new_tokens", 1.5),
    ("max_new_tokens", True),
    ("temperature", -0.1),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", 0),
    ("top_k", -2),
    ("top_k", 2.0),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("seed", -1),
    ("seed", 1.0),
    ("stop", [""]),
    ("stop", [1]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["a"]),
    ("stop_token_ids", 3),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"sampling_params\.{field}"):
        SamplingParams.from_dict({field: value})


def test_unknown_key_is_rejected_and_named():
    with pytest.raises(ValueError, match="unknown key.*'tempreature'"):
        SamplingParams.from_dict({"tempreature": 0.5})


def test_stop_token_ids_checked_against_vocab():
    sp = SamplingParams.from_dict({"stop_token_ids": [5, 99]})
    sp.validate(vocab_size=100)
    with pytest.raises(ValueError, match=r"sampling_params\.stop_token_ids.*99"):
        sp.validate(vocab_size=99)


def test_defaults_and_normalisation():
    sp = SamplingParams.from_dict(None)
    assert sp == SamplingParams()
    assert SamplingParams.from_dict({"stop": "END"}).stop == ["END"]
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7, top_k=2).is_greedy
    SamplingParams.from_dict({"max_new_tokens": 0, "temperature": 0, "top_p": 1, "top_k": -1, "min_p": 1,
                              "seed": 0, "stop": ["x"], "stop_token_ids": [0]})  # boundary values are valid


# ---------------------------------------------------------------- counter_uniform


def test_counter_uniform_is_reproducible_and_in_range():
    values = [counter_uniform(seed, c) for seed in (0, 1, 12345, 2**63 - 1) for c in range(200)]
    assert values == [counter_uniform(seed, c) for seed in (0, 1, 12345, 2**63 - 1) for c in range(200)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert len(set(values)) == len(values)  # no collisions over seeds and counters
    mean = sum(values) / len(values)
    assert abs(mean - 0.5) < 0.03
    # Streams of different seeds differ, and neighbouring counters are not correlated trivially.
    assert [counter_uniform(1, c) for c in range(10)] != [counter_uniform(2, c) for c in range(10)]


def test_counter_uniform_is_roughly_uniform():
    n = 20000
    buckets = [0] * 10
    for c in range(n):
        buckets[int(counter_uniform(7, c) * 10)] += 1
    for b in buckets:
        assert abs(b - n / 10) < 0.1 * n / 10


# ---------------------------------------------------------------- sample()


def _logits(n=6, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * 3


def test_greedy_is_argmax():
    logits = _logits()
    params = [SamplingParams(temperature=0.0)] * logits.shape[0]
    got = sample(logits, params, seeds=[1] * 6, counters=list(range(6)))
    assert got == logits.argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_and_min_p_one_equal_greedy():
    logits = _logits(n=8)
    want = logits.argmax(-1).tolist()
    for sp in (SamplingParams(temperature=1.0, top_k=1),
               SamplingParams(temperature=2.0, top_p=1e-6),
               SamplingParams(temperature=5.0, min_p=1.0)):
        for counter in range(20):
            got = sample(logits, [sp] * 8, seeds=list(range(8)), counters=[counter] * 8)
            assert got == want, sp


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    logits = _logits(n=1, vocab=200) / 3  # flat-ish so that draws differ
    sp = SamplingParams(temperature=1.0)
    run = [sample(logits, [sp], seeds=[42], counters=[c])[0] for c in range(50)]
    assert run == [sample(logits, [sp], seeds=[42], counters=[c])[0] for c in range(50)]
    other = [sample(logits, [sp], seeds=[43], counters=[c])[0] for c in range(50)]
    assert run != other
    assert len(set(run)) > 10  # it really samples


def test_sampling_is_batch_invariant():
    """A row gets the same token alone or in a mixed batch (greedy and sampled rows, various params)."""
    logits = _logits(n=7, vocab=300, seed=3)
    params = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.3, top_k=20), SamplingParams(temperature=1.0, top_p=0.9),
              SamplingParams(temperature=1.0, min_p=0.05), SamplingParams(temperature=0.5, top_k=5, top_p=0.8),
              SamplingParams(temperature=1.0)]
    seeds = [11, 12, 13, 14, 15, 16, 17]
    for counter in range(25):
        counters = [counter + i for i in range(7)]
        batched = sample(logits, params, seeds, counters)
        alone = [sample(logits[i:i + 1], [params[i]], [seeds[i]], [counters[i]])[0] for i in range(7)]
        assert batched == alone
        # Reordering the batch does not change any row's token either.
        perm = [6, 2, 0, 5, 1, 4, 3]
        shuffled = sample(logits[perm], [params[i] for i in perm], [seeds[i] for i in perm], [counters[i] for i in perm])
        assert shuffled == [batched[i] for i in perm]


def test_top_k_restricts_support():
    logits = _logits(n=1, vocab=100, seed=5)
    top3 = set(logits[0].topk(3).indices.tolist())
    sp = SamplingParams(temperature=3.0, top_k=3)
    got = {sample(logits, [sp], [9], [c])[0] for c in range(300)}
    assert got == top3


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = filtered_probs(logits, [SamplingParams(top_p=0.8)])[0]
    assert torch.allclose(probs, torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]), atol=1e-6)
    probs = filtered_probs(logits, [SamplingParams(top_p=0.81)])[0]
    assert probs[2] > 0 and probs[3] == 0
    probs = filtered_probs(logits, [SamplingParams(top_p=1.0)])[0]
    assert torch.allclose(probs, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=1e-6)


def test_min_p_filters_relative_to_the_top_token():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    probs = filtered_probs(logits, [SamplingParams(min_p=0.45)])[0]  # keep p >= 0.18
    assert (probs > 0).tolist() == [True, True, True, False]
    assert torch.allclose(probs.sum(), torch.tensor(1.0))
    probs = filtered_probs(logits, [SamplingParams(min_p=0.6)])[0]  # keep p >= 0.24
    assert (probs > 0).tolist() == [True, True, False, False]
    sp = SamplingParams(min_p=0.6)
    drawn = {sample(logits, [sp], [3], [c])[0] for c in range(400)}
    assert drawn == {0, 1}


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    cold = filtered_probs(logits, [SamplingParams(temperature=0.25)])[0]
    hot = filtered_probs(logits, [SamplingParams(temperature=4.0)])[0]
    assert torch.allclose(cold, torch.softmax(logits[0] / 0.25, -1), atol=1e-6)
    assert torch.allclose(hot, torch.softmax(logits[0] / 4.0, -1), atol=1e-6)
    assert cold[0] > 0.95 and hot[0] < 0.45


def test_empirical_frequencies_match_softmax():
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5, -3.0]])
    n = 20000
    sp = SamplingParams(temperature=1.0)
    rows = logits.expand(n, -1).contiguous()
    tokens = sample(rows, [sp] * n, seeds=[2024] * n, counters=list(range(n)))
    freq = torch.bincount(torch.tensor(tokens), minlength=5).double() / n
    want = torch.softmax(logits[0].double(), -1)
    for f, p in zip(freq.tolist(), want.tolist()):
        assert abs(f - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3, (freq, want)


def test_filtered_sampling_frequencies_match_renormalised_distribution():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    n = 20000
    sp = SamplingParams(temperature=1.0, top_k=3)
    tokens = sample(logits.expand(n, -1).contiguous(), [sp] * n, seeds=[5] * n, counters=list(range(n)))
    freq = torch.bincount(torch.tensor(tokens), minlength=4).double() / n
    want = torch.tensor([0.4, 0.3, 0.2, 0.0], dtype=torch.float64) / 0.9
    assert freq[3] == 0
    assert torch.allclose(freq, want, atol=0.015), freq


def test_sampled_token_never_has_zero_probability():
    logits = torch.full((1, 64), -1e9)
    logits[0, 17] = 0.0
    logits[0, 40] = 0.0
    sp = SamplingParams(temperature=1.0)
    drawn = {sample(logits, [sp], [1], [c])[0] for c in range(300)}
    assert drawn == {17, 40}


def test_filtered_probs_stays_on_the_logits_device():
    """Every tensor the filters build is on the logits' device: on an H200 the verify step's
    sampling accept failed with temperatures built on the host. The meta device stands in for a
    GPU here: it refuses host tensors the same way."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=5, min_p=0.01), SamplingParams(temperature=1.0)]
    probs = filtered_probs(torch.randn(2, 10, device="meta"), params)
    assert probs.device.type == "meta" and probs.shape == (2, 10)


def test_device_uniforms_are_the_host_uniforms_bit_for_bit():
    """counter_uniforms (on the device, int64 wrap-around) equals counter_uniform (Python integers)
    for seeds across the whole 64-bit range, including those past 2^63, and large counters."""
    import random

    from specserve.sampler import counter_uniforms, seeds_tensor

    rng = random.Random(5)
    seeds = [rng.randrange(2**64) for _ in range(300)] + [0, 2**63 - 1, 2**63, 2**64 - 1]
    counters = [rng.randrange(2**40) for _ in seeds]
    got = counter_uniforms(seeds_tensor(seeds, "cpu"), torch.tensor(counters))
    want = torch.tensor([counter_uniform(s, c) for s, c in zip(seeds, counters)], dtype=torch.float64)
    assert torch.equal(got, want)


TRAITS = ("is_greedy", "seeded_sampling", "penalises", "constrained", "shapes_logits")
# One valid value per field that differs from its default (the traits must follow each change).
CHANGED = {"max_new_tokens": 7, "temperature": 0.0, "top_p": 0.5, "top_k": 1, "min_p": 0.1, "stop": ["x"],
           "stop_token_ids": [3], "ignore_eos": True, "seed": 5, "skip_special_tokens": False,
           "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "logit_bias": {3: 1.0},
           "logprobs": True, "top_logprobs": 2, "prompt_logprobs": True, "json_schema": "{}", "regex": "a+",
           "ebnf": "root ::= \"a\"", "lark": "start: \"a\""}


def _traits(p: SamplingParams) -> tuple[bool, ...]:
    return tuple(getattr(p, name) for name in TRAITS)


def test_the_traits_a_step_reads_follow_every_field_changed_after_construction():
    """The traits are plain attributes worked out once: a field changed later (on a sampled,
    seeded base, so that each change can flip one) must leave them as a fresh object's."""
    import dataclasses

    assert set(CHANGED) == {f.name for f in dataclasses.fields(SamplingParams)}, "a field without a test value"
    for name, value in CHANGED.items():
        changed = SamplingParams(temperature=0.8, seed=1)
        setattr(changed, name, value)
        fresh = SamplingParams(**{"temperature": 0.8, "seed": 1, name: value})
        assert _traits(changed) == _traits(fresh), name
    assert _traits(SamplingParams(temperature=0.0, regex="a+")) == (True, False, False, True, True)
    assert _traits(SamplingParams(temperature=0.8, seed=1, logit_bias={1: 2.0})) == (False, True, True, False, True)


def test_the_traits_check_is_not_blind(monkeypatch):
    """Mutation: traits that do not follow a later change (the field left out of what they follow)
    are caught by the check above."""
    from specserve import sampling_params

    monkeypatch.setattr(sampling_params, "_TRAIT_INPUTS", sampling_params._TRAIT_INPUTS - {"temperature"})
    with pytest.raises(AssertionError, match="temperature"):
        test_the_traits_a_step_reads_follow_every_field_changed_after_construction()
