"""The recorded speculation cost prior (engine/start_cache.py): a restart with the same file,
flags and machine reads the prior the first start timed instead of timing it again; another flag,
or `--weight-cache off`, times it afresh (a planted key without the flags would not, and the check
catches it)."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as QType
from tiny_gguf import TinySpec, write_tiny_gguf

import specserve.engine.start_cache as start_cache
from specserve.engine import Engine

SPEC = TinySpec("qwen2", hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2)
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd")
TYPES = {n: QType.Q4_K for n in LINEARS}


@pytest.fixture
def model(tmp_path) -> str:
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(path, SPEC, TYPES, seed=3)
    return path


@pytest.fixture
def timings(monkeypatch) -> list[int]:
    """How many times a prior was timed (each call appends)."""
    calls: list[int] = []
    real = start_cache.measure_cost_prior

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(start_cache, "measure_cost_prior", counted)
    return calls


def start(model: str, cache: str, **flags) -> dict[str, float]:
    """The adaptive policy's coefficients right after a start (NGRAM under the adaptive default)."""
    with Engine(model_path=model, weight_cache=cache, max_total_tokens=1024, **flags) as engine:
        return engine.runner.speculation.policy.cost.coefficients()


def test_a_restart_reads_the_recorded_prior(model, tmp_path, timings):
    cache = str(tmp_path / "cache")
    first = start(model, cache)
    assert len(timings) == 1
    assert start(model, cache) == first and len(timings) == 1
    start(model, cache, max_running_requests=8)  # another flag: another key
    assert len(timings) == 2
    start(model, "off")
    start(model, "off")
    assert len(timings) == 4


def test_a_planted_key_without_the_flags_reuses_a_prior_it_should_not(model, tmp_path, timings, monkeypatch):
    real_init = start_cache.RecordedCostPrior.__init__

    def without_flags(self, directory, model_path, args, gamma):
        real_init(self, directory, model_path, args, gamma)
        self.identity.pop("args")
        self.path = f"{directory}/planted-prior.json"

    monkeypatch.setattr(start_cache.RecordedCostPrior, "__init__", without_flags)
    cache = str(tmp_path / "cache")
    start(model, cache)
    start(model, cache, max_running_requests=8)
    assert len(timings) == 1  # the check above (2 timings) fails under this key
