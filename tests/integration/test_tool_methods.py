"""The engine's tool methods (engine/tools.py: what bench/, train/, benchmarks/ and scripts/ use
instead of the runner's attributes), on the shared fp32 engine; each test leaves it as it found it
(the `checked` fixture asserts the KV bookkeeping after)."""

from __future__ import annotations

import pytest

GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


def test_reset_prefix_cache_makes_the_next_request_prefill_from_scratch(checked):
    ids = checked.tokenizer.encode("The tools' surface drops every cached prefix when asked to.")
    checked.generate(input_ids=ids, sampling_params=GREEDY)
    assert checked.generate(input_ids=ids, sampling_params=GREEDY)["meta_info"]["cached_tokens"] > 0
    checked.reset_prefix_cache()
    assert checked.generate(input_ids=ids, sampling_params=GREEDY)["meta_info"]["cached_tokens"] == 0
    assert checked.prefix_cache_stats() == {}  # the radix cache keeps no tier counters


def test_forward_rows_from_position_zero_is_the_prefill(checked):
    """With nothing cached the scratch rows' forward is a prefill: its last row's argmax is the first
    greedy token; the scratch rows are cleared after, and serving gives the same tokens again."""
    ids = checked.tokenizer.encode("A forward of N rows after P cached ones, for timing.")
    first = checked.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
    with checked.forward_rows(len(ids), 0, input_ids=ids, last_logit_only=True) as forward:
        logits = forward()
    assert logits.shape == (1, checked.model.config.vocab_size) and int(logits[0].argmax()) == first[0]
    with checked.forward_rows(5, 16, width=2) as forward:  # three scratch requests of 2, 2 and 1 rows
        assert forward().shape == (5, checked.model.config.vocab_size)
    assert not checked.runner.req_to_token.table.any()
    assert checked.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] == first


def test_forward_rows_refuses_while_requests_run_and_when_too_large(checked):
    from specserve.errors import ConfigError

    with pytest.raises(ConfigError, match="raise --max-running-requests"):
        with checked.forward_rows(100_000, 0, width=1):
            pass
    checked.submit(checked.tokenizer.encode("running"), GREEDY)
    checked.step()
    try:
        with pytest.raises(RuntimeError, match="requests are running"):
            with checked.forward_rows(2, 0):
                pass
    finally:
        while checked.has_work():
            checked.step()


def test_the_target_model_and_the_speculation_facts_of_a_plain_engine(checked):
    assert checked.target_model is checked.runner.model
    assert checked.target_model.config.vocab_size == checked.model.config.vocab_size
    assert checked.dspark_drafter() is None and checked.speculation_cost_coefficients() is None
    assert checked.verified_draft_length() == 0
    checked.forget_past_outputs()  # no drafter learns from outputs here: nothing to forget
    kv = checked.runner.kv
    assert checked.kv_pool_bytes() == sum(t.numel() * t.element_size() for t in (*kv.k, *kv.v)) > 0


def test_step_choices_loops_and_instruments(checked):
    from specserve.runtime.host_waits import HostWaitDetector
    from specserve.scheduler.loops import NormalLoop, OverlapLoop

    capture = checked.runner.capture
    enabled, static = capture.enabled, capture.static_windows
    try:
        checked.set_step_choices(captured=not enabled, static_windows=not static)
        assert (capture.enabled, capture.static_windows) == (not enabled, not static)
    finally:
        checked.set_step_choices(captured=enabled, static_windows=static)
    assert isinstance(checked.new_loop(overlap=False), NormalLoop)
    assert isinstance(checked.new_loop(overlap=True), OverlapLoop)

    launches: list[str] = []
    original = checked.runner.launch

    def counting(launch):
        def counted(step):
            launches.append(step.mode.value)
            return launch(step)

        return counted

    with pytest.raises(ValueError, match="no step part 'forward'"):
        checked.instrument("forward", counting)
    checked.instrument("launch", counting)
    try:
        checked.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)
    finally:
        checked.instrument("launch", lambda _: original)
    assert len(launches) >= GREEDY["max_new_tokens"]

    with pytest.raises(RuntimeError, match="no host-wait detector"):
        checked.take_host_waits()
    checked.runner.host_waits = HostWaitDetector("count")
    try:
        assert isinstance(checked.take_host_waits(), list) and checked.take_host_waits() == []
    finally:
        checked.runner.host_waits = None
    facts = checked.step_facts()
    assert facts["copy_lag"] is None and isinstance(facts["threaded_streams"], bool)
    assert facts["cuda_graphs"] == 0 or checked.args.device != "cpu"
