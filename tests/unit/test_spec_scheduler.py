"""Speculative verify windows in the scheduler, with the FakeRunner committing true tokens:
outputs equal plain decoding, rejected slots stay with the request and are overwritten by the
next window, stops inside a run cut it, and the spec metrics add up."""

import pytest
from fake_runner import FakeRunner, assert_no_leak, make_req, make_scheduler, run_to_completion

from specserve.scheduler.req import FinishReason
from specserve.speculative.speculation import Speculation

EOS = 1


@pytest.mark.parametrize("gamma", [1, 3, 7])
@pytest.mark.parametrize("accept", ["none", "all", "hash"])
def test_windows_give_the_plain_output(gamma, accept):
    fixed = {"none": lambda req, w: 0, "all": lambda req, w: w - 1, "hash": None}[accept]
    runner = FakeRunner(accept=fixed)
    sched = make_scheduler(runner=runner, num_draft_tokens=gamma)
    prompts = {f"r{i}": [3 + i, 7, 9 + i, 11] * (i + 1) for i in range(6)}
    done = run_to_completion(sched, [make_req(rid, p, max_new_tokens=17 + i) for i, (rid, p) in enumerate(prompts.items())])
    for i, (rid, p) in enumerate(prompts.items()):
        req = done[rid]
        assert req.output_ids == runner.reference(p, 17 + i)
        # completion = first token from prefill + per verify step: accepted drafts + bonus,
        # except where max_new_tokens cut the last run.
        bonuses = len(req.output_ids) - 1 - req.spec_num_correct_drafts
        assert bonuses in (req.spec_verify_ct, req.spec_verify_ct - 1)
        assert sum(req.spec_correct_hist.values()) == req.spec_verify_ct
        if accept == "none":
            assert req.spec_num_correct_drafts == 0 and req.spec_verify_ct == len(req.output_ids) - 1
    assert {b.mode for b in runner.batches} == {"extend", "verify"}
    assert_no_leak(sched)


def test_rejected_slots_are_kept_and_overwritten_by_the_next_window():
    runner = FakeRunner(accept=lambda req, w: 1)  # commit 2 of 5 rows each step
    sched = make_scheduler(runner=runner, num_draft_tokens=4)
    sched.add_request(make_req("a", [5, 6, 7], max_new_tokens=20))
    sched.step()
    req = sched.queues.running[0]
    free_before = sched.ledger.allocator.available
    first = sched.schedule()
    first_window = sched.ledger.req_to_token.table[req.row, 3:8].tolist()  # where the executor reads it
    sched.process_result(first, runner.run_batch(first))
    assert req.kv_len == 3 + 2 and len(req.kv_slots) == 3 + 5  # 3 rejected slots stay with the request
    assert sched.ledger.allocator.available == free_before - 5
    second = sched.schedule()
    window = sched.ledger.req_to_token.table[req.row, 5:10].tolist()
    assert len(set(window)) == 5 and window[:3] == first_window[2:]  # reused, not freed and reallocated
    assert sched.ledger.allocator.available == free_before - 7  # only the shortfall was allocated
    sched.process_result(second, runner.run_batch(second))


def test_eos_inside_an_accepted_run_emits_nothing_past_it():
    prompt = [4, 5, 6, 7]
    runner = FakeRunner(eos_id=EOS, eos_at={tuple(prompt): 6}, accept=lambda req, w: w - 1)
    sched = make_scheduler(runner=runner, num_draft_tokens=7, eos_token_ids=(EOS,))
    done = run_to_completion(sched, [make_req("a", prompt, max_new_tokens=50)])
    req = done["a"]
    assert req.output_ids == runner.reference(prompt, 50, stop_ids=(EOS,))
    assert len(req.output_ids) == 7 and req.output_ids[-1] == EOS
    assert req.finish_reason == FinishReason.STOP
    assert req.spec_verify_ct == 1  # the first run (8 tokens) held the EOS at its 6th token
    assert_no_leak(sched)


def test_windows_under_memory_pressure_retract_and_resume():
    runner = FakeRunner(accept=lambda req, w: 0)
    sched = make_scheduler(pool_size=150, runner=runner, num_draft_tokens=7, context_length=200)
    reqs = [make_req(f"r{i}", [10 + i] * 12, max_new_tokens=90) for i in range(6)]
    done = run_to_completion(sched, reqs)
    assert sched.pressure.num_retractions > 0
    for r in reqs:
        assert done[r.rid].output_ids == runner.reference(r.input_ids, 90)
    assert_no_leak(sched)


def test_verify_outcomes_feed_the_histograms_and_the_log_line():
    from specserve.executor.step_io import StepOutcome, VerifyStats

    runner = FakeRunner()
    plain = runner.launch

    def launch(step):
        out = plain(step)
        if step.mode != "verify":
            return out
        return [StepOutcome(o.tokens, verify=VerifyStats(o.verify.drafter, o.verify.drafts, cap_trimmed=len(o.tokens) % 2))
                for o in out]

    runner.launch = launch
    sched = make_scheduler(runner=runner, num_draft_tokens=3)
    done = run_to_completion(sched, [make_req(f"r{i}", [5 + i, 6, 7], max_new_tokens=30) for i in range(3)])
    for req in done.values():
        assert req.output_ids == runner.reference(req.input_ids, 30)
        assert sum(req.spec_cap_trim_hist.values()) == req.spec_verify_ct
        assert set(req.spec_cap_trim_hist) == {0, 1}
    stats = sched.stats
    assert stats.verify_steps == sum(r.spec_verify_ct for r in done.values())
    assert stats.generated_tokens == 90
    line = stats.log_line(running=0, waiting=0)
    assert f"accept length {stats.accept_length:.2f}" in line and "cap-trim hist" in line
    assert stats.accept_length == pytest.approx(1 + stats.correct_drafts / stats.verify_steps)


@pytest.mark.parametrize("cap", [None, 0, 2, 3])
def test_speculative_disable_batch_size_is_a_constraint_of_the_plan(cap):
    """--speculative-disable-batch-size: the plan (the one decision to speculate) gives a step of
    more requests than the cap no drafts, so the executor runs it as a plain decode step; at or
    below the cap every request with a drafter drafts. The scheduler does not decide it: its
    decode steps keep their windows (test_windows_give_the_plain_output covers those)."""
    speculation = Speculation(disable_batch_size=cap)
    for bs in range(1, 6):
        plan = speculation.plan(["NGRAM"] * (bs - 1) + [None], list(range(bs)), 3)
        above = cap is not None and bs > cap
        assert plan.drafts == ([0] * bs if above else [3] * (bs - 1) + [0]), (cap, bs, plan.drafts)
        assert plan.speculates == (not above and bs > 1)
        assert plan.shape.verify_rows == (0 if above else 3 * (bs - 1))
