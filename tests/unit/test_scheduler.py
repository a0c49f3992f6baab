"""Scheduler with a deterministic FakeRunner: batching, chunking, policies, prefix sharing, stops, aborts,
memory pressure and bad input. The runner checks KV bookkeeping on every step (see tests/fake_runner.py);
run_to_completion checks Scheduler.check_integrity() and queue invariants after every step."""

import random

import pytest
from fake_runner import FakeRunner, assert_no_leak, check_step_invariants, make_req, make_scheduler, run_to_completion

from specserve.kv.radix_cache import RadixCache
from specserve.scheduler.batching import LPM_MAX_QUEUE, order_waiting
from specserve.scheduler.req import FinishReason

EOS = 1


def rand_prompt(rng, n):
    return [rng.randrange(3, 1000) for _ in range(n)]


def first_extend_step(runner, rid):
    for i, b in enumerate(runner.batches):
        if b.mode == "extend" and rid in b.rids:
            return i
    raise AssertionError(f"{rid} was never prefilled")


def admission_order(runner):
    seen = []
    for b in runner.batches:
        if b.mode == "extend":
            for rid in b.rids:
                if rid not in seen:
                    seen.append(rid)
    return seen


# ---------------------------------------------------------------- basics


def test_single_request_prefill_then_decode():
    sched = make_scheduler()
    runner = sched.runner
    prompt = [5, 6, 7, 8, 9]
    done = run_to_completion(sched, [make_req("a", prompt, max_new_tokens=8)])
    a = done["a"]
    assert a.output_ids == runner.reference(prompt, 8)
    assert a.finish_reason == FinishReason.LENGTH
    assert a.cached_tokens == 0
    assert [b.mode for b in runner.batches] == ["extend"] + ["decode"] * 7
    first = runner.batches[0]
    assert first.prefix_lens == [0] and first.extend_lens == [5] and first.sample == [True]
    assert [b.prefix_lens for b in runner.batches[1:]] == [[5 + i] for i in range(7)]
    assert_no_leak(sched)


def test_requests_queued_together_prefill_in_one_batch_and_decode_together():
    sched = make_scheduler()
    runner = sched.runner
    prompts = {"a": [10, 11, 12], "b": [20, 21, 22, 23, 24], "c": [30]}
    reqs = [make_req(rid, p, max_new_tokens=6) for rid, p in prompts.items()]
    done = run_to_completion(sched, reqs)
    first = runner.batches[0]
    assert first.mode == "extend" and first.rids == ["a", "b", "c"] and first.extend_lens == [3, 5, 1]
    assert all(b.mode == "decode" and sorted(b.rids) == ["a", "b", "c"] for b in runner.batches[1:])
    assert len(runner.batches) == 6
    for rid, p in prompts.items():
        assert done[rid].output_ids == runner.reference(p, 6)
    assert_no_leak(sched)


def test_continuous_batching_late_arrivals_join_running_batch():
    rng = random.Random(0)
    sched = make_scheduler()
    runner = sched.runner
    early = [make_req(f"e{i}", rand_prompt(rng, 6 + i), max_new_tokens=20) for i in range(2)]
    late = [make_req(f"l{i}", rand_prompt(rng, 4 + i), max_new_tokens=5) for i in range(2)]
    done = run_to_completion(sched, early, arrivals={5: late[:1], 9: late[1:]})
    # A request is prefilled on the step it arrives, then decodes in the same batch as the early ones.
    assert first_extend_step(runner, "l0") == 5 and runner.batches[5].rids == ["l0"]
    assert first_extend_step(runner, "l1") == 9
    assert runner.batches[6].mode == "decode" and sorted(runner.batches[6].rids) == ["e0", "e1", "l0"]
    assert any(sorted(b.rids) == ["e0", "e1", "l0", "l1"] for b in runner.batches if b.mode == "decode")
    # Early requests were never re-prefilled (no restart) and nobody's output was disturbed.
    assert sum(1 for b in runner.batches if b.mode == "extend" and "e0" in b.rids) == 1
    for r in early + late:
        assert done[r.rid].output_ids == runner.reference(r.input_ids, r.params.max_new_tokens)
    # The late ones finish first though they arrived later.
    assert done["l0"].finished and len(done["e0"].output_ids) == 20
    assert_no_leak(sched)


# ---------------------------------------------------------------- chunked prefill


def test_chunked_prefill_splits_long_prompt_and_only_last_chunk_samples():
    rng = random.Random(1)
    prompt = rand_prompt(rng, 50)
    sched = make_scheduler(chunked_prefill_size=16)
    runner = sched.runner
    done = run_to_completion(sched, [make_req("a", prompt, max_new_tokens=5)])
    extends = [b for b in runner.batches if b.mode == "extend"]
    assert [b.extend_lens for b in extends] == [[16], [16], [16], [2]]
    assert [b.prefix_lens for b in extends] == [[0], [16], [32], [48]]
    assert [b.sample for b in extends] == [[False], [False], [False], [True]]
    assert done["a"].output_ids == runner.reference(prompt, 5)

    plain = make_scheduler(chunked_prefill_size=4096)
    out = run_to_completion(plain, [make_req("a", prompt, max_new_tokens=5)])
    assert [b.extend_lens for b in plain.runner.batches if b.mode == "extend"] == [[50]]
    assert out["a"].output_ids == done["a"].output_ids
    assert_no_leak(sched)


def test_chunked_request_is_tracked_between_chunks():
    sched = make_scheduler(chunked_prefill_size=8)
    req = make_req("a", list(range(3, 23)), max_new_tokens=3)
    sched.add_request(req)
    sched.step()
    assert sched.queues.chunked is req and req.kv_len == 8 and req.output_ids == [] and not sched.queues.running
    check_step_invariants(sched)
    sched.step()
    assert sched.queues.chunked is req and req.kv_len == 16
    result = sched.step()
    assert sched.queues.chunked is None and sched.queues.running == [req] and len(req.output_ids) == 1
    assert result.tokens == [(req, req.output_ids[0])]
    check_step_invariants(sched)


def test_chunked_request_with_others_in_the_queue():
    """Several long and short prompts, chunk 7, prefill budget 12: same outputs as unchunked."""
    rng = random.Random(2)
    prompts = [rand_prompt(rng, n) for n in (30, 3, 17, 5, 9, 25, 2)]

    def run(**kw):
        sched = make_scheduler(**kw)
        reqs = [make_req(f"r{i}", p, max_new_tokens=4 + i) for i, p in enumerate(prompts)]
        return sched, run_to_completion(sched, reqs)

    sched, done = run(chunked_prefill_size=7, max_prefill_tokens=12)
    _, ref = run()
    for b in sched.runner.batches:
        if b.mode == "extend":
            assert b.num_tokens <= 12
            assert all(n <= 7 for n in b.extend_lens)
            # A non-final chunk is always the last request of its batch (one chunked request at a time).
            partial = [i for i, s in enumerate(b.sample) if not s]
            assert partial in ([], [b.size - 1])
    assert {k: v.output_ids for k, v in done.items()} == {k: v.output_ids for k, v in ref.items()}
    assert_no_leak(sched)


def test_max_prefill_tokens_bounds_each_prefill_batch():
    rng = random.Random(3)
    reqs = [make_req(f"r{i}", rand_prompt(rng, 10), max_new_tokens=3) for i in range(6)]
    sched = make_scheduler(max_prefill_tokens=25)
    done = run_to_completion(sched, reqs)
    extends = [b for b in sched.runner.batches if b.mode == "extend"]
    assert all(b.num_tokens <= 25 for b in extends)
    assert extends[0].extend_lens == [10, 10, 5] and extends[0].sample == [True, True, False]
    for r in reqs:
        assert done[r.rid].output_ids == sched.runner.reference(r.input_ids, 3)
    assert_no_leak(sched)


# ---------------------------------------------------------------- policies


def _warm(sched, prompt, max_new_tokens=1):
    run_to_completion(sched, [make_req("warm", prompt, max_new_tokens=max_new_tokens)])
    sched.runner.batches.clear()


def test_fcfs_admits_in_arrival_order():
    rng = random.Random(4)
    sched = make_scheduler(max_running_requests=1, schedule_policy="fcfs")
    lens = [30, 10, 20, 5]
    reqs = [make_req(f"r{i}", rand_prompt(rng, n), max_new_tokens=2) for i, n in enumerate(lens)]
    run_to_completion(sched, reqs)
    assert admission_order(sched.runner) == ["r0", "r1", "r2", "r3"]
    assert max(b.size for b in sched.runner.batches) == 1
    assert_no_leak(sched)


def test_shortest_prefill_first_admits_shortest_first():
    rng = random.Random(5)
    sched = make_scheduler(max_running_requests=1, schedule_policy="shortest-prefill-first")
    lens = [30, 10, 20, 5]
    reqs = [make_req(f"r{i}", rand_prompt(rng, n), max_new_tokens=2) for i, n in enumerate(lens)]
    done = run_to_completion(sched, reqs)
    assert admission_order(sched.runner) == ["r3", "r1", "r2", "r0"]
    for r in reqs:
        assert done[r.rid].output_ids == sched.runner.reference(r.input_ids, 2)
    assert_no_leak(sched)


def test_shortest_prefill_first_counts_cached_tokens():
    rng = random.Random(6)
    base = rand_prompt(rng, 40)
    sched = make_scheduler(max_running_requests=1, schedule_policy="shortest-prefill-first")
    _warm(sched, base)
    fresh = make_req("fresh", rand_prompt(rng, 10), max_new_tokens=2)  # 10 to compute
    cached = make_req("cached", base + rand_prompt(rng, 5), max_new_tokens=2)  # 45 long, 5 to compute
    run_to_completion(sched, [fresh, cached])
    assert admission_order(sched.runner) == ["cached", "fresh"]
    assert cached.cached_tokens == 40
    assert_no_leak(sched)


def test_lpm_admits_longest_prefix_match_first():
    rng = random.Random(7)
    base = rand_prompt(rng, 40)
    sched = make_scheduler(max_running_requests=1, schedule_policy="lpm")
    _warm(sched, base)
    reqs = [make_req("none", rand_prompt(rng, 12), max_new_tokens=2),
            make_req("short", base[:5] + rand_prompt(rng, 30), max_new_tokens=2),
            make_req("long", base[:30] + rand_prompt(rng, 3), max_new_tokens=2)]
    done = run_to_completion(sched, reqs)
    assert admission_order(sched.runner) == ["long", "short", "none"]
    assert [done[r].cached_tokens for r in ("long", "short", "none")] == [30, 5, 0]
    for r in reqs:
        assert r.output_ids == sched.runner.reference(r.input_ids, 2)
    assert_no_leak(sched)


def test_lpm_without_cache_is_fcfs():
    rng = random.Random(8)
    sched = make_scheduler(max_running_requests=1, schedule_policy="lpm", disable_radix_cache=True)
    base = rand_prompt(rng, 20)
    _warm(sched, base)
    reqs = [make_req("a", rand_prompt(rng, 4), max_new_tokens=1), make_req("b", base + [5], max_new_tokens=1)]
    run_to_completion(sched, reqs)
    assert admission_order(sched.runner) == ["a", "b"]
    assert reqs[1].cached_tokens == 0
    assert_no_leak(sched)


def test_lpm_falls_back_to_fcfs_for_long_queues():
    rng = random.Random(18)
    tree = RadixCache(lambda slots: None)
    base = rand_prompt(rng, 10)
    tree.insert(base, list(range(1, 11)))
    reqs = [make_req(f"r{i}", rand_prompt(rng, 5), max_new_tokens=1) for i in range(LPM_MAX_QUEUE + 1)]
    reqs.append(make_req("hit", base + [3], max_new_tokens=1))
    for i, r in enumerate(reqs):
        r.arrival = i
    assert order_waiting(reqs[-LPM_MAX_QUEUE:], "lpm", tree)[0].rid == "hit"
    assert order_waiting(reqs, "lpm", tree) == reqs  # too long to match everything: arrival order
    shuffled = reqs[::-1]
    assert order_waiting(shuffled, "fcfs", tree) == reqs


def test_unknown_policy_is_rejected():
    sched = make_scheduler(schedule_policy="random")
    sched.add_request(make_req("a", [5, 6], max_new_tokens=1))
    with pytest.raises(ValueError, match="schedule_policy"):
        sched.step()


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "shortest-prefill-first"])
def test_max_running_requests_is_respected(policy):
    rng = random.Random(9)
    sched = make_scheduler(max_running_requests=4, schedule_policy=policy)
    reqs = [make_req(f"r{i}", rand_prompt(rng, rng.randint(2, 12)), max_new_tokens=rng.randint(1, 9))
            for i in range(20)]
    peak = 0
    for r in reqs:
        sched.add_request(r)
    while sched.has_work():
        sched.step()
        check_step_invariants(sched)
        assert len(sched.queues.running) <= 4
        peak = max(peak, len(sched.queues.running))
    assert peak == 4
    assert all(b.size <= 4 for b in sched.runner.batches)
    for r in reqs:
        assert r.output_ids == sched.runner.reference(r.input_ids, r.params.max_new_tokens)
    assert_no_leak(sched)


# ---------------------------------------------------------------- prefix sharing


def test_identical_prompt_reuses_all_but_last_token():
    rng = random.Random(10)
    prompt = rand_prompt(rng, 12)
    sched = make_scheduler()
    runner = sched.runner
    a = run_to_completion(sched, [make_req("a", prompt, max_new_tokens=4)])["a"]
    runner.batches.clear()
    b = run_to_completion(sched, [make_req("b", prompt, max_new_tokens=4)])["b"]
    assert a.cached_tokens == 0
    assert b.cached_tokens == 11
    first = runner.batches[0]
    assert first.prefix_lens == [11] and first.extend_lens == [1] and first.sample == [True]
    assert b.output_ids == a.output_ids == runner.reference(prompt, 4)
    assert_no_leak(sched)


def test_prefix_includes_previous_outputs():
    """The tree keeps a finished request's prompt and computed outputs; a continuation reuses both."""
    rng = random.Random(11)
    prompt = rand_prompt(rng, 10)
    sched = make_scheduler()
    runner = sched.runner
    a = run_to_completion(sched, [make_req("a", prompt, max_new_tokens=6)])["a"]
    nxt = next(t for t in range(3, 1000) if t != a.output_ids[3])
    follow = prompt + a.output_ids[:3] + [nxt, 7, 8]
    b = run_to_completion(sched, [make_req("b", follow, max_new_tokens=4)])["b"]
    assert b.cached_tokens == 13
    assert b.output_ids == runner.reference(follow, 4)
    # Only the 5 computed outputs of a were cached, so a prompt equal to prompt + all 6 outputs matches 15.
    c = run_to_completion(sched, [make_req("c", prompt + a.output_ids + [9], max_new_tokens=1)])["c"]
    assert c.cached_tokens == 15
    assert_no_leak(sched)


def test_shared_prefix_between_many_requests_and_cache_off_gives_same_outputs():
    rng = random.Random(12)
    system = rand_prompt(rng, 20)
    prompts = [system + rand_prompt(rng, rng.randint(1, 6)) for _ in range(12)]

    def run(disabled):
        sched = make_scheduler(disable_radix_cache=disabled, max_running_requests=3)
        reqs = [make_req(f"r{i}", p, max_new_tokens=5) for i, p in enumerate(prompts)]
        done = run_to_completion(sched, reqs)
        assert_no_leak(sched)
        return {k: (v.output_ids, v.cached_tokens) for k, v in done.items()}

    on, off = run(False), run(True)
    assert {k: v[0] for k, v in on.items()} == {k: v[0] for k, v in off.items()}
    assert all(c == 0 for _, c in off.values())
    # Requests admitted after the first batch finished reuse the whole system prompt.
    assert sum(1 for _, c in on.values() if c >= 20) >= 6


def test_pool_pressure_evicts_least_recently_used_prefix():
    rng = random.Random(19)
    x, y, z = rand_prompt(rng, 15), rand_prompt(rng, 15), rand_prompt(rng, 40)
    sched = make_scheduler(pool_size=60)
    run_to_completion(sched, [make_req("x", x, max_new_tokens=1)])
    run_to_completion(sched, [make_req("y", y, max_new_tokens=1)])
    again = run_to_completion(sched, [make_req("x2", x, max_new_tokens=1)])["x2"]  # touches x's path
    assert again.cached_tokens == 14
    assert sched.ledger.tree.total_size == 30 and sched.ledger.allocator.available == 30
    done = run_to_completion(sched, [make_req("z", z, max_new_tokens=1)])  # needs 40 slots: evict 10+
    assert done["z"].output_ids == sched.runner.reference(z, 1)
    assert len(sched.ledger.tree.match_prefix(x)[0]) == 15
    assert sched.ledger.tree.match_prefix(y)[0] == []
    # A prompt whose prefix was evicted is simply recomputed.
    again_y = run_to_completion(sched, [make_req("y2", y, max_new_tokens=2)])["y2"]
    assert again_y.cached_tokens == 0 and again_y.output_ids == sched.runner.reference(y, 2)
    assert_no_leak(sched)


def test_cache_disabled_never_reports_cached_tokens():
    prompt = [5, 6, 7, 8]
    sched = make_scheduler(disable_radix_cache=True)
    run_to_completion(sched, [make_req("a", prompt, max_new_tokens=3)])
    b = run_to_completion(sched, [make_req("b", prompt, max_new_tokens=3)])["b"]
    assert b.cached_tokens == 0
    assert sched.ledger.tree.total_size == 0
    assert sched.ledger.allocator.available == sched.ledger.allocator.size
    assert sched.runner.batches[-3].extend_lens == [4]
    assert_no_leak(sched)


# ---------------------------------------------------------------- stop conditions


def test_eos_stops_and_ignore_eos_continues():
    prompt = [40, 41, 42]
    runner = FakeRunner(eos_id=EOS, eos_at={tuple(prompt): 4})
    sched = make_scheduler(runner=runner, eos_token_ids=(EOS,))
    a = run_to_completion(sched, [make_req("a", prompt, max_new_tokens=20)])["a"]
    assert a.finish_reason == FinishReason.STOP and a.matched_stop == EOS
    assert len(a.output_ids) == 5 and a.output_ids[-1] == EOS
    assert a.output_ids[:4] == runner.reference(prompt, 4)
    b = run_to_completion(sched, [make_req("b", prompt, max_new_tokens=9, ignore_eos=True)])["b"]
    assert b.finish_reason == FinishReason.LENGTH and b.matched_stop is None
    assert len(b.output_ids) == 9 and b.output_ids[4] == EOS
    assert b.output_ids == runner.reference(prompt, 9)
    assert_no_leak(sched)


def test_eos_not_configured_is_a_normal_token():
    prompt = [40, 41, 42]
    runner = FakeRunner(eos_id=EOS, eos_at={tuple(prompt): 2})
    sched = make_scheduler(runner=runner, eos_token_ids=(2,))
    a = run_to_completion(sched, [make_req("a", prompt, max_new_tokens=6)])["a"]
    assert a.finish_reason == FinishReason.LENGTH and a.output_ids[2] == EOS and len(a.output_ids) == 6
    assert_no_leak(sched)


def test_stop_token_ids():
    rng = random.Random(13)
    prompt = rand_prompt(rng, 5)
    sched = make_scheduler()
    ref = sched.runner.reference(prompt, 30)
    k = next(i for i in range(3, 30) if ref[i] not in ref[:i])
    a = run_to_completion(sched, [make_req("a", prompt, max_new_tokens=30, stop_token_ids=[ref[k], 2])])["a"]
    assert a.output_ids == ref[:k + 1]
    assert a.finish_reason == FinishReason.STOP and a.matched_stop == ref[k]
    # ignore_eos does not switch off stop_token_ids
    b = run_to_completion(sched, [make_req("b", prompt, max_new_tokens=30, stop_token_ids=[ref[k]],
                                           ignore_eos=True)])["b"]
    assert b.output_ids == ref[:k + 1] and b.finish_reason == FinishReason.STOP
    assert_no_leak(sched)


def test_stop_token_on_the_first_token():
    prompt = [7, 8, 9]
    sched = make_scheduler()
    first = sched.runner.reference(prompt, 1)[0]
    a = run_to_completion(sched, [make_req("a", prompt, max_new_tokens=10, stop_token_ids=[first])])["a"]
    assert a.output_ids == [first] and a.finish_reason == FinishReason.STOP
    assert [b.mode for b in sched.runner.batches] == ["extend"]
    assert_no_leak(sched)


def _letters(ids):
    return "".join(chr(ord("a") + t % 26) for t in ids)


def test_stop_strings_via_decode_text():
    rng = random.Random(14)
    prompt = rand_prompt(rng, 6)
    sched = make_scheduler(decode_text=_letters)
    ref = sched.runner.reference(prompt, 40)
    text = _letters(ref)
    stop = text[9:12]
    expected_len = text.find(stop) + len(stop)
    a = run_to_completion(sched, [make_req("a", prompt, max_new_tokens=40, stop=[stop, "#never#"])])["a"]
    assert a.finish_reason == FinishReason.STOP and a.matched_stop == stop
    assert a.output_ids == ref[:expected_len]
    b = run_to_completion(sched, [make_req("b", prompt, max_new_tokens=40, stop=["#never#"])])["b"]
    assert b.finish_reason == FinishReason.LENGTH and b.output_ids == ref
    assert_no_leak(sched)


def test_max_new_tokens_is_exact():
    sched = make_scheduler()
    reqs = [make_req(f"r{n}", [9, 9, n + 3], max_new_tokens=n) for n in (1, 2, 7)]
    done = run_to_completion(sched, reqs)
    for n in (1, 2, 7):
        r = done[f"r{n}"]
        assert len(r.output_ids) == n and r.finish_reason == FinishReason.LENGTH
    assert_no_leak(sched)


def test_max_new_tokens_zero_finishes_without_a_step():
    sched = make_scheduler()
    req = make_req("a", [5, 6, 7], max_new_tokens=0)
    assert sched.add_request(req) is req
    assert req.finish_reason == FinishReason.LENGTH and req.output_ids == []
    assert not sched.has_work() and sched.step().tokens == []
    assert sched.runner.batches == []


def test_max_new_tokens_clamped_to_context_window():
    sched = make_scheduler(context_length=64)
    done = run_to_completion(sched, [make_req("a", list(range(3, 63)), max_new_tokens=100),
                                     make_req("b", list(range(3, 66)), max_new_tokens=100)])
    assert len(done["a"].output_ids) == 4 and done["a"].finish_reason == FinishReason.LENGTH
    assert len(done["b"].output_ids) == 1
    assert_no_leak(sched)


# ---------------------------------------------------------------- abort


def test_abort_waiting_request():
    sched = make_scheduler(max_running_requests=1)
    a, b = make_req("a", [5, 6, 7], max_new_tokens=5), make_req("b", [8, 9], max_new_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    sched.step()
    assert sched.queues.waiting == [b]
    assert sched.abort("b") is b and b.finish_reason == FinishReason.ABORT
    assert sched.abort("b") is None  # only once
    check_step_invariants(sched)
    run_to_completion(sched)
    assert all("b" not in batch.rids for batch in sched.runner.batches)
    assert a.output_ids == sched.runner.reference([5, 6, 7], 5)
    assert_no_leak(sched)


def test_abort_running_request_releases_its_kv():
    rng = random.Random(15)
    sched = make_scheduler()
    a = make_req("a", rand_prompt(rng, 10), max_new_tokens=20)
    b = make_req("b", rand_prompt(rng, 8), max_new_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(4):
        sched.step()
    assert sched.abort("a") is a
    assert a.finish_reason == FinishReason.ABORT and a.req_pool_idx is None and a.kv_slots == []
    assert sched.queues.running == [b]
    check_step_invariants(sched)
    assert a.output_ids == sched.runner.reference(a.input_ids, 20)[:4]
    run_to_completion(sched)
    assert b.output_ids == sched.runner.reference(b.input_ids, 20)
    assert len(a.output_ids) == 4
    assert sched.abort("a") is None and sched.abort("nope") is None
    assert_no_leak(sched)


def test_abort_chunked_request():
    sched = make_scheduler(chunked_prefill_size=8)
    a = make_req("a", list(range(3, 40)), max_new_tokens=5)
    sched.add_request(a)
    sched.step()
    assert sched.queues.chunked is a
    assert sched.abort("a") is a and sched.queues.chunked is None
    check_step_invariants(sched)
    assert not sched.has_work()
    assert_no_leak(sched)


def test_abort_while_decode_step_in_flight():
    sched = make_scheduler()
    a = make_req("a", [5, 6, 7], max_new_tokens=10)
    b = make_req("b", [8, 9], max_new_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    sched.step()
    batch = sched.schedule()
    assert batch.mode == "decode"
    tokens = sched.runner.run_batch(batch)  # the forward pass is in flight when the abort arrives
    assert sched.abort("a") is a
    result = sched.process_result(batch, tokens)
    assert [r.rid for r, _ in result.tokens] == ["b"]
    assert len(a.output_ids) == 1 and sched.queues.running == [b]
    check_step_invariants(sched)
    run_to_completion(sched)
    assert b.output_ids == sched.runner.reference([8, 9], 10)
    assert_no_leak(sched)


def test_abort_while_prefill_step_in_flight():
    sched = make_scheduler()
    a = make_req("a", [5, 6, 7], max_new_tokens=10)
    sched.add_request(a)
    batch = sched.schedule()
    assert batch.mode == "extend" and batch.reqs == [a]
    tokens = sched.runner.run_batch(batch)  # the forward pass is in flight when the abort arrives
    aborted = sched.abort("a")
    sched.process_result(batch, tokens)
    assert aborted is a and a.finish_reason == FinishReason.ABORT
    assert not sched.has_work()
    assert_no_leak(sched)


# ---------------------------------------------------------------- memory pressure


def pressure_workload(seed, n=64):
    rng = random.Random(seed)
    systems = [rand_prompt(rng, 16), rand_prompt(rng, 10)]
    reqs = []
    for i in range(n):
        head = systems[i % 3] if i % 3 < 2 else []
        reqs.append(make_req(f"r{i}", head + rand_prompt(rng, rng.randint(1, 12)),
                             max_new_tokens=rng.randint(1, 30)))
    return reqs


def _outputs(done):
    return {rid: (r.output_ids, r.finish_reason) for rid, r in done.items()}


@pytest.fixture(scope="module")
def unconstrained_outputs():
    sched = make_scheduler(pool_size=100_000)
    done = run_to_completion(sched, pressure_workload(0), check_every_step=False)
    assert max(b.size for b in sched.runner.batches) == 64
    return _outputs(done)


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "shortest-prefill-first"])
@pytest.mark.parametrize("disabled", [False, True])
@pytest.mark.parametrize("chunk", [4096, 8])
def test_small_pool_runs_everything_with_same_outputs(unconstrained_outputs, policy, disabled, chunk):
    # Requests need up to ~57 slots; 400 slots hold about 8 of them at a time.
    sched = make_scheduler(pool_size=400, schedule_policy=policy, disable_radix_cache=disabled,
                           chunked_prefill_size=chunk)
    peak = 0
    reqs = pressure_workload(0)
    for r in reqs:
        sched.add_request(r)
    done = {}
    steps = 0
    while sched.has_work():
        res = sched.step()
        check_step_invariants(sched)
        peak = max(peak, len(sched.queues.running))
        for r in res.finished:
            done[r.rid] = r
        steps += 1
        assert steps < 5000
    assert len(done) == 64
    assert _outputs(done) == unconstrained_outputs
    assert peak < 64  # the pool really limited concurrency
    assert_no_leak(sched)


@pytest.mark.parametrize("disabled", [False, True])
def test_retraction_under_decode_pressure_resumes_correctly(disabled):
    """Long generations admitted on a 0.7 estimate outgrow the pool: some are retracted and resumed."""
    rng = random.Random(16)
    reqs = [make_req(f"r{i}", rand_prompt(rng, 10), max_new_tokens=100) for i in range(12)]
    sched = make_scheduler(pool_size=400, disable_radix_cache=disabled)
    retracted_victims = []
    original = sched.pressure.retract_one

    def spy():
        victim = max(sched.queues.running, key=lambda r: r.arrival)
        retracted_victims.append((victim.rid, len(victim.output_ids)))
        original()
        assert victim in sched.queues.waiting and victim.req_pool_idx is None

    sched.pressure.retract_one = spy
    done = run_to_completion(sched, reqs)
    assert sched.pressure.num_retractions > 0 and len(retracted_victims) == sched.pressure.num_retractions
    assert sum(r.num_retractions for r in done.values()) == sched.pressure.num_retractions
    for r in reqs:
        assert done[r.rid].output_ids == sched.runner.reference(r.input_ids, 100)
        assert done[r.rid].finish_reason == FinishReason.LENGTH
        # cached_tokens reports the first admission, not the resumption after a retraction.
        first = sched.runner.batches[first_extend_step(sched.runner, r.rid)]
        assert r.cached_tokens == first.prefix_lens[first.rids.index(r.rid)]
    if not disabled:
        # A resumed request reuses the KV it computed before retraction (unless it was evicted meanwhile).
        resumed = [b for b in sched.runner.batches if b.mode == "extend" and any(p > 0 for p in b.prefix_lens)]
        assert resumed
    assert_no_leak(sched)


def test_one_request_at_a_time_pool():
    """A pool that fits exactly one request at its worst case: requests run one after another."""
    rng = random.Random(17)
    reqs = [make_req(f"r{i}", rand_prompt(rng, 20), max_new_tokens=20) for i in range(5)]
    sched = make_scheduler(pool_size=40)
    done = run_to_completion(sched, reqs)
    for r in reqs:
        assert done[r.rid].output_ids == sched.runner.reference(r.input_ids, 20)
    assert_no_leak(sched)


# ---------------------------------------------------------------- bad input


def test_empty_prompt_rejected():
    sched = make_scheduler()
    with pytest.raises(ValueError, match="prompt"):
        sched.add_request(make_req("a", [], max_new_tokens=1))
    assert not sched.has_work()


@pytest.mark.parametrize("n", [64, 65])
def test_prompt_at_or_over_context_rejected(n):
    sched = make_scheduler(context_length=64)
    with pytest.raises(ValueError, match="context"):
        sched.add_request(make_req("a", list(range(3, 3 + n)), max_new_tokens=1))
    assert not sched.has_work()


def test_prompt_plus_max_new_must_fit_the_pool():
    sched = make_scheduler(pool_size=40, context_length=128)
    with pytest.raises(ValueError, match="KV slots"):
        sched.add_request(make_req("a", list(range(3, 23)), max_new_tokens=21))
    # Context clamping counts: 20 + min(1000, 128 - 20) > 40.
    with pytest.raises(ValueError, match="KV slots"):
        sched.add_request(make_req("b", list(range(3, 23)), max_new_tokens=1000))
    assert not sched.has_work()
    ok = make_req("c", list(range(3, 23)), max_new_tokens=20)  # exactly the pool
    done = run_to_completion(sched, [ok])
    assert len(done["c"].output_ids) == 20
    assert_no_leak(sched)


# ---------------------------------------------------------------- the harness can fail


def test_fake_runner_detects_corrupted_req_to_token():
    sched = make_scheduler()
    a = make_req("a", [5, 6, 7, 8], max_new_tokens=5)
    sched.add_request(a)
    sched.step()
    sched.ledger.req_to_token.table[a.req_pool_idx, 1] = 999
    with pytest.raises(AssertionError, match="slot 999 at position 1 holds None"):
        sched.step()


def test_fake_runner_detects_wrong_prefix_kv():
    """If the tree maps a prefix to slots holding other tokens' KV, the next match is caught."""
    sched = make_scheduler()
    prompt = [5, 6, 7, 8, 9, 10]
    run_to_completion(sched, [make_req("a", prompt, max_new_tokens=2)])
    node = next(iter(sched.ledger.tree.root.children.values()))
    node.value[1], node.value[2] = node.value[2], node.value[1]
    sched.add_request(make_req("b", prompt, max_new_tokens=2))
    with pytest.raises(AssertionError, match="at position 1 holds \\(2,"):  # the slot of position 2
        sched.step()


def test_fake_runner_output_depends_on_history():
    r = FakeRunner()
    assert r.next_token([5, 6], [7]) == r.next_token([5, 6, 7], [])
    assert len({r.next_token([5, 6], [t]) for t in range(100)}) > 50
    assert len({r.next_token([t], []) for t in range(100)}) > 50
    assert all(r.next_token([t], []) >= 3 for t in range(100))  # ids < 3 are reserved for EOS and specials
    eos = FakeRunner(eos_id=EOS, eos_at={(5, 6): 2})
    assert eos.reference([5, 6], 5, stop_ids=[EOS]) == r.reference([5, 6], 2) + [EOS]
