"""Randomised scheduler workloads: random pool / context / chunk / budget / policy / cache settings,
staggered arrivals, shared prefixes, EOS, stop ids, stop strings, ignore_eos, speculative verify
windows of 2-8 tokens with runs of every accepted length, and aborts (between steps and while a
prefill chunk, a decode or a verify step is in flight). Every request that was not aborted must output exactly what it
would output alone; aborted ones a prefix of that. The FakeRunner checks KV bookkeeping every step,
and every step ends with check_integrity; at the end nothing leaks."""

import functools
import random

import pytest
from fake_runner import FakeRunner, assert_no_leak, check_step_invariants, make_req, make_scheduler

from specserve.errors import InvalidRequestError
from specserve.scheduler.req import FinishReason

EOS = 1


def letters(ids):
    return "".join(chr(ord("a") + t % 5) for t in ids)


def reference(runner, req, eos_ids):
    p = req.params
    out = []
    while len(out) < p.max_new_tokens:
        out.append(runner.next_token(req.input_ids, out))
        t = out[-1]
        if (t in eos_ids and not p.ignore_eos) or t in p.stop_token_ids:
            return out, FinishReason.STOP
        if p.stop and any(s in letters(out) for s in p.stop):
            return out, FinishReason.STOP
    return out, FinishReason.LENGTH


def run_fuzz(seed):
    rng = random.Random(seed)
    ctx = rng.choice([32, 64, 128])
    eos_at = {}
    runner = FakeRunner(vocab=rng.choice([8, 50, 1000]), eos_id=EOS, eos_at=eos_at)
    sched = make_scheduler(
        pool_size=rng.choice([ctx, ctx + 5, 2 * ctx, 4 * ctx, 10_000]), context_length=ctx,
        max_running_requests=rng.choice([1, 2, 4, 8, 64]), disable_radix_cache=rng.random() < 0.3, runner=runner,
        eos_token_ids=(EOS,), chunked_prefill_size=rng.choice([0, 3, 8, 16, 2048]),
        max_prefill_tokens=rng.choice([4, 16, 64, 8192]),
        schedule_policy=rng.choice(["fcfs", "lpm", "shortest-prefill-first"]), decode_text=letters,
        num_draft_tokens=rng.choice([0, 0, 1, 3, 7]))
    systems = [[rng.randrange(3, 20) for _ in range(rng.randint(1, ctx // 2))] for _ in range(3)]
    arrivals, reqs = {}, []
    for i in range(rng.randint(1, 30)):
        prompt = (rng.choice(systems + [[]]) + [rng.randrange(3, 20) for _ in range(rng.randint(1, 10))])[:ctx - 1]
        if rng.random() < 0.3:
            eos_at[tuple(prompt)] = rng.randint(0, 10)
        extra = {}
        if rng.random() < 0.15:
            extra["stop_token_ids"] = [rng.randrange(3, 20)]
        if rng.random() < 0.15:
            extra["stop"] = ["".join(rng.choice("abcde") for _ in range(rng.randint(2, 3)))]
        req = make_req(f"r{i}", prompt, max_new_tokens=rng.randint(0, ctx), ignore_eos=rng.random() < 0.2, **extra)
        try:
            sched.validate_request(req)
        except InvalidRequestError:
            need = len(prompt) + min(req.params.max_new_tokens, ctx - len(prompt)) + sched.window - 1
            assert need > sched.ledger.allocator.size
            continue
        reqs.append(req)
        arrivals.setdefault(rng.randint(0, 30), []).append(req)
    by_rid = {r.rid: r for r in reqs}
    abort_at = {rng.randint(0, 80): rng.choice(reqs).rid for _ in range(rng.randint(0, 4))} if reqs else {}
    done, aborted = {}, set()
    prefill_aborts = 0  # aborts that arrived while the request's prefill chunk was in flight

    def finish(r):
        assert r.rid not in done
        done[r.rid] = r

    step = 0
    while sched.has_work() or arrivals:
        for r in arrivals.pop(step, []):
            early = sched.add_request(r)
            if early is not None:
                finish(early)
        rid = abort_at.get(step)
        if rid is not None and rng.random() < 0.5 and (got := sched.abort(rid)) is not None:
            aborted.add(rid)
            finish(got)
            rid = None
        batch = sched.schedule()
        if batch is None:
            assert not sched.has_work(), "work left but nothing scheduled"
        else:
            tokens = runner.run_batch(batch)
            # An abort that arrives while a step is in flight: a prefill chunk, a decode or a verify step.
            if rid is not None and batch.mode == "extend" and rng.random() < 0.5:
                rid = rng.choice(batch.reqs).rid  # one whose prefill chunk is in flight
            if rid is not None:
                got = sched.abort(rid)
                if got is not None:
                    aborted.add(rid)
                    finish(got)
                    prefill_aborts += batch.mode == "extend" and by_rid[rid] in batch.reqs
            for r in sched.process_result(batch, tokens).finished:
                finish(r)
        check_step_invariants(sched)
        step += 1
        assert step < 20_000
    assert set(done) == set(by_rid)
    for r in reqs:
        want, reason = reference(runner, r, (EOS,))
        if r.rid in aborted:
            assert r.finish_reason == FinishReason.ABORT
            assert r.output_ids == want[:len(r.output_ids)]
        else:
            assert (r.output_ids, r.finish_reason) == (want, reason), r.rid
    assert_no_leak(sched)
    return sched, reqs, aborted, prefill_aborts


SEEDS = range(48)


@functools.lru_cache(maxsize=None)
def fuzz_stats(seed):
    """Run one seed (once per session) and summarise what it exercised."""
    sched, reqs, aborted, prefill_aborts = run_fuzz(seed)
    batches = sched.runner.batches
    return {
        "retractions": sched.pressure.num_retractions,
        "cached_tokens": sum(r.cached_tokens for r in reqs),
        "aborts": len(aborted),
        "aborts_during_prefill": prefill_aborts,
        "partial_chunks": sum(1 for b in batches if b.mode == "extend" and not all(b.sample)),
        "stops": sum(1 for r in reqs if r.finish_reason == FinishReason.STOP and r.rid not in aborted),
        "verify_steps": sum(1 for b in batches if b.mode == "verify"),
        "retractions_while_speculating": sched.pressure.num_retractions if sched.window > 1 else 0,
    }


@pytest.mark.parametrize("seed", SEEDS)
def test_random_workload(seed):
    fuzz_stats(seed)


def test_fuzz_is_not_vacuous():
    """Across the seeds, requests really get retracted, reuse cached prefixes, abort (also while their
    prefill is in flight), chunk and stop."""
    totals = {}
    for seed in SEEDS:
        for k, v in fuzz_stats(seed).items():
            totals[k] = totals.get(k, 0) + v
    assert all(v > 0 for v in totals.values()), totals
