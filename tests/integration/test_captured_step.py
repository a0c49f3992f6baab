"""Captured decode and verify steps: same tokens and acceptance as eager steps (with and without
batch padding), outputs that are persistent buffers, the sanitizer catching one that escapes, and
on CUDA (when present) graph replays equal to eager steps."""

from __future__ import annotations

import pytest
import torch

from helpers import chat_prompts, policy_args

from specserve import Engine
from specserve.executor.captured_step import CapturedStep, batch_buckets, kv_bucket
from specserve.runtime.sanitizer import StreamHazardError
from specserve.runtime.stream import StreamError

CONTENTS = ["Count from 1 to 20, separated by commas.", "What is the capital of France?",
            "List the days of the week.", "Write a haiku about rain.", "Name three primary colours."]
SPEC_VARS = ("SPECSERVE_STREAM_SANITIZER", "SPECSERVE_FAULT_ALIAS_ACCEPT_BUFFERS", "SPECSERVE_FAULT_COPY_DELAY_MS",
             "SPECSERVE_FAULT_FORWARD_DELAY_MS", "SPECSERVE_FAULT_COPY_LAG_MS")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in SPEC_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def prompts(fp32_engine):
    return chat_prompts(fp32_engine, CONTENTS)


def test_buckets():
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]
    assert kv_bucket(1, 2048) == 128 and kv_bucket(129, 2048) == 256 and kv_bucket(5000, 2048) == 2048


def make_engine(kind: str, drafter_dir: str, **kw) -> Engine:
    """NONE, or DSPARK drafting every window whole (the policy off: these tests compare captured
    and eager steps), or ("dspark-policy") the adaptive policy on its frozen test table."""
    kw.update(speculative_algorithm="NONE")
    if kind == "dspark":
        kw.update(speculative_algorithm="DSPARK", speculative_draft_model_path=drafter_dir, speculative_policy="fixed")
    if kind == "dspark-policy":
        kw.update(speculative_algorithm="DSPARK", speculative_draft_model_path=drafter_dir, **policy_args())
    return Engine(dtype="float32", max_total_tokens=4096, **kw)


def generate(engine: Engine, prompts, sampled: bool) -> tuple[list[list[int]], int, list]:
    params = [{"temperature": 0, "max_new_tokens": 12} for _ in prompts]
    if sampled:
        params[1] = {"temperature": 0.8, "top_p": 0.9, "seed": 7, "max_new_tokens": 12}
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    tokens = [o["output_ids"] for o in outs]
    accept = [o["meta_info"].get("spec_accept_length") for o in outs]
    return tokens, engine.scheduler.stats.verify_steps, accept


@pytest.mark.parametrize("kind", ["none", "dspark"])
def test_captured_steps_match_eager(kind, drafter_dir, prompts):
    """Default (captured, exact batch), padded to buckets (as CUDA graphs run), capped by
    --cuda-graph-max-bs (mixed captured and eager) and --disable-cuda-graph: identical results."""
    results = {}
    for name, kw, pad in [("captured", {}, None), ("padded", {}, True), ("max-bs-2", {"cuda_graph_max_bs": 2}, None),
                          ("eager", {"disable_cuda_graph": True}, None)]:
        engine = make_engine(kind, drafter_dir, **kw)
        engine.runner.capture.pad_batches = pad
        results[name] = [generate(engine, prompts, sampled=kind == "dspark"), generate(engine, prompts[:2], False)]
        captured = engine.runner._captured
        assert (name == "eager") == (not captured), name
        if kind == "dspark" and name != "eager":
            assert engine.scheduler.stats.verify_steps > 0 and max(captured) > 1  # the verify step was captured
        engine.scheduler.check_integrity()
        engine.shutdown()
    for name in ("padded", "max-bs-2", "eager"):
        assert results[name] == results["captured"], name


def test_captured_outputs_are_persistent_buffers(fp32_engine, prompts):
    """A replay rewrites the previous replay's outputs in place: the caller must consume them on the
    forward stream before the next step (which is why read_accept clones)."""
    runner = fp32_engine.runner
    fp32_engine.generate(input_ids=prompts[0], sampling_params={"temperature": 0, "max_new_tokens": 2})
    step: CapturedStep = runner._captured[1]
    idx = fp32_engine.runner.req_to_token.alloc()  # a free request slot whose table row points at scratch
    fp32_engine.runner.req_to_token.table[idx] = 0
    try:
        first = step.run(torch.tensor([idx]), torch.tensor([3]), torch.tensor([[42]]), kv_bound=8)
        kept = first.logits.clone()
        assert first.logits.untyped_storage().data_ptr() == step.logits_out.untyped_storage().data_ptr()
        step.run(torch.tensor([idx]), torch.tensor([4]), torch.tensor([[43]]), kv_bound=8)
        assert not torch.equal(first.logits, kept)  # the view now shows the second replay's logits
    finally:
        fp32_engine.runner.req_to_token.free(idx)


def test_sanitizer_catches_captured_logits_escaping(drafter_dir, prompts, monkeypatch):
    """Mutation: a decode step hands the captured logits buffer (a view) to the copy stream."""
    monkeypatch.setenv("SPECSERVE_STREAM_SANITIZER", "1")
    engine = make_engine("none", drafter_dir)
    runner = engine.runner
    original = type(runner)._step

    def leaky_step(handle):
        original(runner, handle)
        if handle.step.mode == "decode":
            handle.device.tokens = runner._captured[1].logits_out[:len(handle.step.rows), 0]  # a view, not a copy

    monkeypatch.setattr(runner, "_step", leaky_step)
    with pytest.raises((StreamHazardError, StreamError)) as info:
        engine.generate(input_ids=prompts[:2], sampling_params={"temperature": 0, "max_new_tokens": 8})
    assert "stream hazard" in str(info.value) and "persistent buffer" in str(info.value)
    engine.shutdown()


@pytest.mark.parametrize("kind", ["dspark", "dspark-policy"])
def test_sanitizer_silent_on_captured_steps(kind, drafter_dir, prompts, monkeypatch):
    monkeypatch.setenv("SPECSERVE_STREAM_SANITIZER", "1")
    engine = make_engine(kind, drafter_dir)
    tokens, steps, _ = generate(engine, prompts, sampled=True)
    assert steps > 5 and all(tokens)
    if kind == "dspark":
        assert list(engine.runner._captured) == [5]  # every decode step was a captured verify (block size 4)
    engine.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_replay_matches_eager(drafter_dir):
    tokens = {}
    for graphs in (True, False):
        engine = Engine(dtype="float32", device="cuda", max_total_tokens=4096, disable_cuda_graph=not graphs,
                        speculative_algorithm="DSPARK", speculative_draft_model_path=drafter_dir)
        prompts = chat_prompts(engine, CONTENTS)
        tokens[graphs] = generate(engine, prompts, sampled=False)
        if graphs:
            assert any(step._graphs for step in engine.runner._captured.values())
        engine.shutdown()
    assert tokens[True] == tokens[False]
