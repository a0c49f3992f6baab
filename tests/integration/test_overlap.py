"""The overlap loop on the real model: same tokens and acceptance as the normal loop (also under
fault delays), finish-while-in-flight, the stale-accept race re-created with the alias fault and caught
by the loop comparison (wrong tokens) and by the stream sanitizer, and a launch without its
forward->copy event caught by the sanitizer."""

from __future__ import annotations

import json

import pytest

from helpers import chat_prompts, policy_args

from specserve import Engine
from specserve.runtime.sanitizer import StreamHazardError
from specserve.runtime.stream import StreamError

CONTENTS = ["Count from 1 to 20, separated by commas.", "What is the capital of France?",
            "List the days of the week.", "Write a haiku about rain."]
FAULT_VARS = ("SPECSERVE_FAULT_COPY_DELAY_MS", "SPECSERVE_FAULT_COPY_LAG_MS", "SPECSERVE_FAULT_FORWARD_DELAY_MS",
              "SPECSERVE_FAULT_SEED", "SPECSERVE_FAULT_ALIAS_ACCEPT_BUFFERS", "SPECSERVE_STREAM_SANITIZER")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in FAULT_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def prompts(fp32_engine):
    return chat_prompts(fp32_engine, CONTENTS)


def params_mix():
    """Greedy requests that end every way: stop string, stop id, EOS-or-length, max_new_tokens."""
    return [{"temperature": 0, "max_new_tokens": 40, "stop": ["7, 8"]},
            {"temperature": 0, "max_new_tokens": 40, "stop_token_ids": [314]},
            {"temperature": 0, "max_new_tokens": 40},
            {"temperature": 0, "max_new_tokens": 13}]


def engine_for(kind: str, overlap: bool, drafter_dir: str, tmp_path) -> Engine:
    kw = {"speculative_algorithm": "NONE"}
    if kind == "ngram":
        kw = {"speculative_algorithm": "NGRAM", "speculative_num_steps": 3, **policy_args()}
    elif kind.startswith("dspark"):
        # dspark-static and dspark-compact: the policy turned off (every window drafted whole);
        # dspark-policy: the adaptive policy on its frozen test table.
        policy = policy_args() if kind == "dspark-policy" else {"speculative_policy": "fixed"}
        kw = {"speculative_algorithm": "DSPARK", "speculative_draft_model_path": drafter_dir, **policy}
        if kind == "dspark-compact":  # the compact planner
            table = tmp_path / "sps.json"
            table.write_text(json.dumps({"tokens": [1, 10, 100], "steps_per_second": [100, 100, 5]}))
            kw = {"speculative_algorithm": "DSPARK", "speculative_draft_model_path": drafter_dir,
                  "speculative_policy": "fixed", "speculative_verify_mode": "compact",
                  "speculative_sps_table_path": str(table)}
    return Engine(dtype="float32", max_total_tokens=4096, disable_overlap_schedule=not overlap, **kw)


def run(engine: Engine, prompts) -> list[dict]:
    outs = engine.generate(input_ids=prompts, sampling_params=params_mix())
    outs.append(engine.generate(input_ids=prompts[2], sampling_params={"temperature": 0, "max_new_tokens": 24}))
    return outs


def summary(outs: list[dict]) -> list[tuple]:
    return [(o["output_ids"], o["meta_info"]["finish_reason"]["type"], o["meta_info"].get("spec_verify_ct"),
             o["meta_info"].get("spec_num_correct_drafts")) for o in outs]


def assert_idle_and_free(engine: Engine) -> None:
    engine.scheduler.check_integrity()
    engine.scheduler.ledger.tree.reset()
    assert engine.scheduler.ledger.allocator.available == engine.scheduler.ledger.allocator.size
    assert not engine.scheduler.queues.in_flight


@pytest.mark.parametrize("kind", ["none", "ngram", "dspark-static", "dspark-compact", "dspark-policy"])
def test_overlap_matches_the_normal_loop(kind, drafter_dir, prompts, tmp_path, monkeypatch):
    normal = engine_for(kind, False, drafter_dir, tmp_path)
    want = summary(run(normal, prompts))
    overlap = engine_for(kind, True, drafter_dir, tmp_path)
    assert summary(run(overlap, prompts)) == want
    assert overlap.loop.overlapped_steps > 10, "the overlap loop never overlapped"
    assert_idle_and_free(overlap)
    # The same under random delays on both streams (worker threads: real concurrency on CPU).
    monkeypatch.setenv("SPECSERVE_FAULT_COPY_DELAY_MS", "3")
    monkeypatch.setenv("SPECSERVE_FAULT_FORWARD_DELAY_MS", "3")
    delayed = engine_for(kind, True, drafter_dir, tmp_path)
    assert delayed.runner.forward.threaded and delayed.runner.copy.threaded
    assert summary(run(delayed, prompts)) == want
    assert_idle_and_free(delayed)
    delayed.shutdown()


def test_overlap_stops_inside_runs_exactly_like_the_normal_loop(prompts, fp32_engine, tmp_path, drafter_dir):
    """NGRAM on a counting prompt accepts long runs; stops land inside them while the next step
    is already in flight."""
    full = fp32_engine.generate(input_ids=prompts[0], sampling_params={"temperature": 0, "max_new_tokens": 60})
    stop_id = full["output_ids"][17]
    cases = [{"temperature": 0, "max_new_tokens": 60, "stop": ["9, 1"]},
             {"temperature": 0, "max_new_tokens": 60, "stop_token_ids": [stop_id]},
             {"temperature": 0, "max_new_tokens": 23}]
    results = {}
    for overlap in (False, True):
        engine = engine_for("ngram", overlap, drafter_dir, tmp_path)
        results[overlap] = [engine.generate(input_ids=prompts[0], sampling_params=p) for p in cases]
        assert_idle_and_free(engine)
    assert summary(results[True]) == summary(results[False])
    assert [len(o["output_ids"]) for o in results[True]][2] == 23
    assert results[True][1]["output_ids"][-1] == stop_id


@pytest.fixture(scope="module")
def ngram_reference(prompts) -> list[tuple]:
    """The NGRAM engine's results in the normal loop, without faults."""
    return summary(run(engine_for("ngram", False, "", None), prompts))


def output_ids(results: list[tuple]) -> list[list[int]]:
    return [r[0] for r in results]


# The copy lag's bound: each step's host copy runs once the next step's forward has finished, or
# after this long when no next step was launched before the host waited (the run's last steps).
LAG_MS = 1000


def assert_copies_were_late(engine: Engine) -> None:
    """Most copies really ran after the next step (a lag that always timed out tests nothing)."""
    lag, steps = engine.runner.copy_lag, engine.loop.overlapped_steps
    assert lag is not None and lag.timeouts < steps / 2, f"{lag.timeouts} of the copies waited out the bound"


def test_alias_fault_with_late_copies_corrupts_the_overlap_loop(ngram_reference, prompts, monkeypatch):
    """The stale-accept race on CPU: read_accept hands out views, the late copy reads the next step's
    values, and the engine commits wrong tokens. The run itself completes (nothing here may hide
    the symptom behind an exception): the output tokens must differ from the reference."""
    monkeypatch.setenv("SPECSERVE_FAULT_ALIAS_ACCEPT_BUFFERS", "1")
    monkeypatch.setenv("SPECSERVE_FAULT_COPY_LAG_MS", str(LAG_MS))
    broken = engine_for("ngram", True, "", None)
    assert broken.runner.alias_accept_buffers and broken.runner.copy.threaded
    got = summary(run(broken, prompts))
    assert broken.loop.overlapped_steps > 10 and broken.scheduler.stats.verify_steps > 10
    assert_copies_were_late(broken)
    corrupted = [i for i, (g, w) in enumerate(zip(output_ids(got), output_ids(ngram_reference))) if g != w]
    assert corrupted, "the alias fault with late copies left every request's tokens intact"
    assert len(got) == len(ngram_reference)
    broken.shutdown()


def test_without_the_alias_fault_the_same_delays_are_harmless(ngram_reference, prompts, monkeypatch):
    monkeypatch.setenv("SPECSERVE_FAULT_COPY_LAG_MS", str(LAG_MS))
    fine = engine_for("ngram", True, "", None)
    assert not fine.runner.alias_accept_buffers and fine.runner.copy.threaded
    assert summary(run(fine, prompts)) == ngram_reference  # token-identical, same finish and spec counts
    assert_copies_were_late(fine)
    fine.shutdown()


def hazard_raised(info: pytest.ExceptionInfo) -> StreamHazardError:
    """The sanitizer's error, raised directly (inline streams) or as the cause of the StreamError
    with which a stream re-raises its task's failure at the next sync point."""
    exc = info.value
    hazard = exc if isinstance(exc, StreamHazardError) else exc.__cause__
    assert isinstance(hazard, StreamHazardError), f"not a stream hazard: {exc!r}"
    return hazard


@pytest.mark.parametrize("threads", [False, True], ids=["inline", "threaded"])
def test_sanitizer_catches_the_alias_fault_on_the_first_verify_steps(drafter_dir, prompts, tmp_path, monkeypatch,
                                                                     threads):
    monkeypatch.setenv("SPECSERVE_STREAM_SANITIZER", "1")
    monkeypatch.setenv("SPECSERVE_FAULT_ALIAS_ACCEPT_BUFFERS", "1")
    if threads:
        monkeypatch.setenv("SPECSERVE_FAULT_COPY_DELAY_MS", "1")
    engine = engine_for("dspark-static", True, drafter_dir, tmp_path)
    with pytest.raises((StreamHazardError, StreamError), match="stream hazard") as info:
        engine.generate(input_ids=prompts[:2], sampling_params={"temperature": 0, "max_new_tokens": 30})
    text = str(hazard_raised(info))
    assert "'forward'" in text and "'copy'" in text and "persistent buffer" in text
    # Caught at the first verify step's copy, before any verify result was processed.
    assert engine.scheduler.stats.verify_steps == 0
    engine.shutdown()


def drop_the_copy_wait_of_verify_steps(runner, monkeypatch) -> None:
    """Mutation: a verify step's launch no longer orders the copy stream after the forward stream
    (`Event().record(self.forward).wait(self.copy)` in ModelRunner.launch becomes a no-op), so the
    device-to-host copy of the accept results is unordered with the step that writes them."""
    import specserve.executor.model_runner as model_runner

    class NoWaitEvent(model_runner.Event):
        def wait(self, stream=None) -> None:
            return None

    launch = runner.launch

    def mutated(step):
        if step.mode != "verify":
            return launch(step)
        with monkeypatch.context() as m:
            m.setattr(model_runner, "Event", NoWaitEvent)
            return launch(step)

    runner.launch = mutated


def test_sanitizer_catches_a_launch_without_the_forward_to_copy_event(fp32_engine, drafter_dir, prompts, tmp_path,
                                                                      monkeypatch):
    """Inline streams: the sanitizer's happens-before comes from the streams' vector clocks, so the
    missing event is reported whatever the timing. (Threaded, the unordered copy may even run
    before the step has produced anything to copy, and the loop then fails on missing results.)"""
    monkeypatch.setenv("SPECSERVE_STREAM_SANITIZER", "1")
    params = {"temperature": 0, "max_new_tokens": 8}
    want = [o["output_ids"] for o in fp32_engine.generate(input_ids=prompts[:2], sampling_params=params)]
    # Unpatched: silent, token-identical, and it did run verify steps.
    engine = engine_for("dspark-static", True, drafter_dir, tmp_path)
    assert engine.runner.forward.sanitizer is not None and engine.loop.executor is engine.runner
    assert [o["output_ids"] for o in engine.generate(input_ids=prompts[:2], sampling_params=params)] == want
    assert engine.scheduler.stats.verify_steps > 0
    engine.shutdown()
    # Mutated: the first verify step's copy reads the accept results unordered with their write.
    engine = engine_for("dspark-static", True, drafter_dir, tmp_path)
    drop_the_copy_wait_of_verify_steps(engine.runner, monkeypatch)
    with pytest.raises(StreamError, match="stream hazard") as info:
        engine.generate(input_ids=prompts[:2], sampling_params=params)
    text = str(hazard_raised(info))
    assert "on stream 'copy'" in text and "copy_to_host" in text, text
    assert "is not ordered after the write" in text and "on stream 'forward'" in text, text
    assert engine.scheduler.stats.verify_steps == 0  # caught at the first verify step's copy
    engine.shutdown()


def test_sanitizer_is_silent_over_a_long_mixed_run(drafter_dir, prompts, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_STREAM_SANITIZER", "1")
    engine = engine_for("dspark-static", True, drafter_dir, tmp_path)
    mixed = params_mix()
    mixed[2] = {"temperature": 0.8, "top_p": 0.9, "seed": 3, "max_new_tokens": 30}
    engine.generate(input_ids=prompts, sampling_params=mixed)
    engine.generate(input_ids=prompts[1], sampling_params={"temperature": 0, "max_new_tokens": 20})
    assert engine.runner.forward.sanitizer.accesses > 10_000
    assert engine.scheduler.stats.verify_steps > 20
    assert_idle_and_free(engine)


def adopt_seq_lens_by_view(runner, positions: list) -> None:
    """Mutation: inject with the previous step's `new_seq_lens` object as this step's S (the sync
    loop's 'seq_lens' adopted from read_accept), read after this step's accept."""
    adopted = {}

    def inject(hidden, out, prefix, window_slots, verify_lens):
        s = adopted["seq_lens"] if "seq_lens" in adopted else prefix
        rows = type(runner)._verified_rows(runner, hidden, out, s, window_slots, verify_lens)
        adopted["seq_lens"] = out.new_seq_lens  # kept by reference, as the first design's loop kept it
        return rows

    runner._verified_rows = inject
    spy_positions(runner, positions)


def spy_positions(runner, positions: list) -> None:
    drafter = runner.speculation.worker("DSPARK").drafter
    original = drafter.inject

    def inject(hidden, pos, slots, kv):
        # Every window row is injected (a fixed shape, nothing read back); the uncommitted ones go to
        # the scratch slot 0, so the committed positions are those with a real slot.
        positions.append(pos[slots != 0].tolist())
        return original(hidden, pos, slots, kv)

    drafter.inject = inject


def committed_positions(engine: Engine, prompt: list[int], positions: list, steps: int = 3) -> list[tuple]:
    """Run a prefill and `steps` verify steps in the normal loop; per verify step, the injected
    positions and the expected S..S+commit_len-1."""
    sched = engine.scheduler
    sched.add_request(engine._make_req(list(prompt), engine._normalize_params({"temperature": 0, "max_new_tokens": 50}, 1)[0]))
    engine.loop.step()
    req = sched.queues.running[0]
    seen = []
    for _ in range(steps):
        start, before = req.kv_len, len(positions)
        engine.loop.step()
        commit = req.kv_len - start
        seen.append((positions[before:], [list(range(start, start + commit))]))
    return seen


@pytest.mark.parametrize("alias", [False, True])
def test_sync_loop_symptom_adopting_new_seq_lens_by_view(drafter_dir, prompts, tmp_path, monkeypatch, alias):
    if alias:
        monkeypatch.setenv("SPECSERVE_FAULT_ALIAS_ACCEPT_BUFFERS", "1")
    # The real code injects at S..S+commit_len-1, with or without the fault.
    engine = engine_for("dspark-static", False, drafter_dir, tmp_path)
    real: list = []
    spy_positions(engine.runner, real)
    for got, want in committed_positions(engine, prompts[1], real):
        assert got == want
    # Adopting new_seq_lens by reference is harmless while read_accept returns clones, and shifts
    # every injection by commit_len once it returns views: the stale-accept race's lost acceptance.
    engine = engine_for("dspark-static", False, drafter_dir, tmp_path)
    adopted: list = []
    adopt_seq_lens_by_view(engine.runner, adopted)
    steps = committed_positions(engine, prompts[1], adopted)
    wrong = [got != want for got, want in steps[1:]]
    assert all(wrong) if alias else not any(wrong), steps
