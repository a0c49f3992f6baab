"""A deterministic stand-in for the executor (ModelRunner), plus helpers to build and drive a Scheduler.

`FakeRunner.run_batch` returns, for every request that samples, a token that is a pure function of
the request's full token history (prompt + outputs so far). Scheduling decisions (batching, chunking,
prefix reuse, retraction) therefore must not change any output, which is what most scheduler tests
assert.

Every step it also checks the KV bookkeeping the real model depends on:

* the batch is well formed (input ids, positions, sample flags agree with the request),
* `req_to_token.table[req_pool_idx, :seq_len] == req.kv_slots[:seq_len]`,
* every new slot (`out_cache_loc`) is nonzero, distinct, allocated (not on the free list), not
  held by the radix tree and not used by any other request of the batch,
* a shadow map slot -> (position, token, hash of the whole prefix up to it) is written for every
  new slot; a request's prefix slots (computed earlier or matched from the radix cache) must hold
  exactly its own tokens at the same positions after the same prefix. That is what makes prefix
  sharing correct: attention over those slots sees the KV this request would have computed.

Any violation raises AssertionError from inside the loop's step. `make_scheduler` returns a
`DrivenScheduler`: the scheduler with this runner and a NormalLoop, whose `step()` runs one loop step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from specserve.executor.step_io import StepInput, StepOutcome, VerifyOutcome
from specserve.kv.pool import ReqToTokenPool, TokenSlotAllocator
from specserve.kv.radix_cache import RadixCache
from specserve.sampling_params import SamplingParams
from specserve.scheduler.batch import ScheduleBatch
from specserve.scheduler.loops import NormalLoop
from specserve.scheduler.req import Req
from specserve.scheduler.scheduler import Scheduler, SchedulerConfig

_MOD = (1 << 61) - 1
_BASE = 1_000_003
FIRST_NORMAL_TOKEN = 3  # ids below this are never produced by the hash (room for EOS / specials)


def _extend_hash(h: int, token: int) -> int:
    return (h * _BASE + token + 1) % _MOD


def prefix_hashes(tokens: Sequence[int]) -> list[int]:
    """h[i] = hash of tokens[:i+1]."""
    out, h = [], 0
    for t in tokens:
        h = _extend_hash(h, t)
        out.append(h)
    return out


@dataclass
class BatchRecord:
    mode: str
    rids: list[str]
    prefix_lens: list[int]
    extend_lens: list[int]
    sample: list[bool]

    @property
    def size(self) -> int:
        return len(self.rids)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)


class FakeRunner:
    """Deterministic next-token oracle with KV bookkeeping checks."""

    def __init__(self, vocab: int = 1000, eos_id: Optional[int] = None,
                 eos_at: Optional[dict[tuple[int, ...], int]] = None, check_kv: bool = True,
                 accept: Optional[Callable[[Req, int], int]] = None):
        """eos_at maps a prompt (tuple of ids) to the output index at which `eos_id` is emitted.
        accept(req, window) gives how many drafts a verify step accepts (0..window-1); the default
        is a hash of the request and its length, so runs of every length occur."""
        if vocab <= FIRST_NORMAL_TOKEN:
            raise ValueError("vocab too small")
        self.vocab = vocab
        self.eos_id = eos_id
        self.eos_at = dict(eos_at or {})
        self.check_kv = check_kv
        self.accept = accept or (lambda req, w: prefix_hashes([len(req.output_ids), len(req.input_ids)])[-1] % w)
        self.batches: list[BatchRecord] = []
        self.shadow: dict[int, tuple[int, int, int]] = {}  # slot -> (position, token, prefix hash)
        self.sched: Optional[Scheduler] = None

    def attach(self, sched: Scheduler) -> None:
        self.sched = sched

    # ------------------------------------------------------------ the oracle

    def next_token(self, input_ids: Sequence[int], output_ids: Sequence[int]) -> int:
        """The token that follows input_ids + output_ids: a pure function of the history."""
        if self.eos_id is not None and self.eos_at.get(tuple(input_ids)) == len(output_ids):
            return self.eos_id
        h = 0
        for t in list(input_ids) + list(output_ids):
            h = _extend_hash(h, t)
        h = (h ^ (h >> 29)) * 0x9E3779B97F4A7C15 % _MOD
        return FIRST_NORMAL_TOKEN + h % (self.vocab - FIRST_NORMAL_TOKEN)

    def reference(self, prompt: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()) -> list[int]:
        """What a request would output if run alone, stopping at the first id in stop_ids."""
        out: list[int] = []
        while len(out) < max_new_tokens:
            out.append(self.next_token(prompt, out))
            if out[-1] in stop_ids:
                break
        return out

    # ------------------------------------------------------------ the executor protocol

    def launch(self, step: StepInput) -> list[StepOutcome]:
        """Runs at once (a loop's handle is the result): the batch is the scheduler's in-flight one."""
        assert self.sched is not None, "FakeRunner.launch needs attach(scheduler)"
        batch = next((b for b in reversed(self.sched.in_flight)
                      if b.mode == step.mode and [r.rid for r in b.reqs] == step.rids), None)
        assert batch is not None, f"launched a step that is not in flight: {step.mode} {step.rids}"
        assert step.rows == [r.req_pool_idx for r in batch.reqs], "step input rows differ from the batch"
        return self.run_batch(batch)

    def resolve(self, handle: list[StepOutcome]) -> list[StepOutcome]:
        return handle

    def run_batch(self, batch: ScheduleBatch) -> list[Optional[int]]:
        assert batch.mode in ("extend", "decode", "verify"), batch.mode
        n = batch.size
        assert n > 0, "empty batch"
        assert len(batch.prefix_lens) == len(batch.extend_lens) == len(batch.sample) == n
        if batch.mode == "extend":
            assert len(batch.input_ids) == len(batch.out_cache_loc) == sum(batch.extend_lens)
        else:  # the executor reads anchors (its FutureMap) and window slots (the table) itself
            assert batch.input_ids == batch.out_cache_loc == [], "a decode batch carries data no executor reads"
        assert len({id(r) for r in batch.reqs}) == n, "a request appears twice in one batch"
        if batch.mode == "decode":
            assert batch.extend_lens == [1] * n and all(batch.sample)
        self.batches.append(BatchRecord(batch.mode, [r.rid for r in batch.reqs], list(batch.prefix_lens),
                                        list(batch.extend_lens), list(batch.sample)))
        if self.check_kv:
            self._check_batch(batch)
        if batch.mode == "verify":
            return [self._verify(req, prefix, w, self._window_slots(req, prefix, w))
                    for req, prefix, w in zip(batch.reqs, batch.prefix_lens, batch.extend_lens)]
        out: list[Optional[int]] = []
        for req, wanted in zip(batch.reqs, batch.sample):
            out.append(self.next_token(req.input_ids, req.output_ids) if wanted else None)
        return out

    def _verify(self, req: Req, prefix: int, width: int, slots: list[int]) -> VerifyOutcome:
        """What a speculative runner commits: the true next tokens, as many as the drafts it
        accepted plus the bonus, from a window of width - 1 drafts by the "FAKE" drafter.
        Shadow KV: committed rows hold their tokens, the rest is stale."""
        chain: list[int] = []
        for _ in range(width):
            chain.append(self.next_token(req.input_ids, req.output_ids + chain))
        accepted = self.accept(req, width)
        assert 0 <= accepted < width
        committed = chain[:accepted + 1]
        if self.check_kv:
            tokens = req.fill_ids + committed[:-1]  # row j holds the token at position prefix + j
            hashes = prefix_hashes(tokens)
            for j, slot in enumerate(slots):
                pos = prefix + j
                self.shadow[slot] = (pos, tokens[pos], hashes[pos]) if j <= accepted else ("stale", pos)
        return VerifyOutcome(committed, drafter="FAKE", drafts=width - 1)

    # ------------------------------------------------------------ checks

    def _window_slots(self, req: Req, prefix: int, width: int) -> list[int]:
        """A decode or verify window's slots, where the executor reads them: the req_to_token table."""
        assert self.sched is not None and req.req_pool_idx is not None
        return self.sched.req_to_token.table[req.req_pool_idx, prefix:prefix + width].tolist()

    def _new_tokens_and_slots(self, batch: ScheduleBatch) -> list[tuple[list[int], list[int]]]:
        """Per request: the tokens and slots this step writes KV for."""
        if batch.mode != "extend":  # the anchor (the last token) and the window's slots
            return [([req.fill_ids[prefix]], self._window_slots(req, prefix, w))
                    for req, prefix, w in zip(batch.reqs, batch.prefix_lens, batch.extend_lens)]
        out, offset = [], 0
        for ext in batch.extend_lens:
            out.append((batch.input_ids[offset:offset + ext], batch.out_cache_loc[offset:offset + ext]))
            offset += ext
        return out

    def _check_batch(self, batch: ScheduleBatch) -> None:
        per_request = self._new_tokens_and_slots(batch)
        new = [s for _, slots in per_request for s in slots]
        assert all(s != 0 for s in new), "a new token was written to the scratch slot 0"
        assert len(set(new)) == len(new), f"out_cache_loc has duplicate slots: {new}"
        if self.sched is not None:
            free = set(self.sched.allocator._free)
            assert not free & set(new), "out_cache_loc uses a slot that is on the free list"
            tree_slots = set(self.sched.tree.all_slots())
            assert not tree_slots & set(new), "out_cache_loc overwrites a slot held by the radix cache"
            table = self.sched.req_to_token.table
        else:
            table = None
        owner: dict[int, str] = {}
        for req in batch.reqs:
            for s in req.kv_slots:
                owner.setdefault(s, req.rid)
        for (req, prefix, ext, wanted), (own_tokens, own_slots) in zip(
                zip(batch.reqs, batch.prefix_lens, batch.extend_lens, batch.sample), per_request):
            fill = req.fill_ids
            seq = prefix + ext
            assert ext >= 1, f"{req.rid}: extend of {ext} tokens"
            assert req.req_pool_idx is not None, f"{req.rid}: no request slot"
            assert len(req.kv_slots) == seq, f"{req.rid}: {len(req.kv_slots)} kv slots for seq_len {seq}"
            assert req.kv_len == prefix, f"{req.rid}: kv_len {req.kv_len} != prefix_len {prefix}"
            if batch.mode == "verify":  # the anchor is the last token; the rest are drafts
                assert wanted and len(fill) == prefix + 1, f"{req.rid}: verify window not at its last token"
                assert own_slots == req.kv_slots[prefix:seq], f"{req.rid}: the table's window differs from kv_slots"
                self._check_prefix(req, prefix, table)
                continue
            assert seq <= len(fill), f"{req.rid}: seq_len {seq} beyond its {len(fill)} tokens"
            assert wanted == (seq == len(fill)), f"{req.rid}: sample={wanted} but seq {seq} / fill {len(fill)}"
            assert own_tokens == fill[prefix:seq], f"{req.rid}: batch input ids differ from its tokens"
            assert own_slots == req.kv_slots[prefix:seq], f"{req.rid}: the step's slots differ from kv_slots"
            if table is not None:
                row = table[req.req_pool_idx, :seq].tolist()
                assert row == req.kv_slots[:seq], f"{req.rid}: req_to_token row differs from kv_slots"
            for s in own_slots:
                assert owner.get(s) == req.rid, f"slot {s} written by {req.rid} is also used by {owner.get(s)}"
            self._check_prefix(req, prefix, None)
            hashes = prefix_hashes(fill[:seq])
            for pos in range(prefix, seq):
                self.shadow[req.kv_slots[pos]] = (pos, fill[pos], hashes[pos])

    def _check_prefix(self, req: Req, prefix: int, table) -> None:
        """The prefix must hold exactly this request's KV."""
        fill = req.fill_ids
        if table is not None:
            row = table[req.req_pool_idx, :len(req.kv_slots)].tolist()
            assert row == req.kv_slots, f"{req.rid}: req_to_token row differs from kv_slots"
        hashes = prefix_hashes(fill[:prefix])
        for pos in range(prefix):
            slot = req.kv_slots[pos]
            got = self.shadow.get(slot)
            want = (pos, fill[pos], hashes[pos])
            assert got == want, f"{req.rid}: prefix slot {slot} at position {pos} holds {got}, expected {want}"


# ---------------------------------------------------------------- building and driving a scheduler


class DrivenScheduler:
    """A Scheduler driven by a NormalLoop over a FakeRunner: `step()` is one loop step, `runner`
    the fake executor; every other attribute is the scheduler's own."""

    def __init__(self, sched: Scheduler, runner: FakeRunner):
        object.__setattr__(self, "scheduler", sched)
        object.__setattr__(self, "runner", runner)
        object.__setattr__(self, "loop", NormalLoop(sched, runner))

    def step(self):
        return self.loop.step()

    def __getattr__(self, name: str):
        return getattr(self.scheduler, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.scheduler, name, value)


def make_scheduler(pool_size: int = 4096, context_length: int = 512, max_running_requests: int = 64,
                   disable_radix_cache: bool = False, runner: Optional[FakeRunner] = None,
                   decode_text: Optional[Callable[[list[int]], str]] = None, **cfg_kwargs) -> DrivenScheduler:
    """A Scheduler over a fresh pool, wired like Engine does, with a fake runner (`sched.runner`)."""
    allocator = TokenSlotAllocator(pool_size)
    req_to_token = ReqToTokenPool(max_running_requests + 1, context_length + 16)  # room for a verify window
    tree = RadixCache(allocator.free, disabled=disable_radix_cache)
    cfg = SchedulerConfig(context_length=context_length, max_running_requests=max_running_requests, **cfg_kwargs)
    runner = runner if runner is not None else FakeRunner()
    sched = Scheduler(cfg, allocator, req_to_token, tree, decode_text=decode_text)
    runner.attach(sched)
    return DrivenScheduler(sched, runner)


def make_req(rid: str, prompt: Sequence[int], max_new_tokens: int = 16, seed: int = 0, **params) -> Req:
    return Req(rid=rid, input_ids=list(prompt), params=SamplingParams(max_new_tokens=max_new_tokens, **params),
               seed=seed)


def check_step_invariants(sched: Scheduler) -> None:
    sched.check_integrity()
    cfg = sched.cfg
    assert len(sched.running) <= cfg.max_running_requests
    assert len(sched.live_requests()) <= cfg.max_running_requests
    ids = [id(r) for r in sched.waiting + sched.live_requests()]
    assert len(ids) == len(set(ids)), "a request is in two queues at once"
    for r in sched.waiting:
        assert r.req_pool_idx is None and not r.kv_slots and r.last_node is None, f"{r.rid} waits holding KV"
    for r in sched.live_requests():
        assert not r.finished
        # A verify window leaves its rejected rows' slots with the request, for the next window.
        spare = len(r.kv_slots) - r.kv_len
        assert 0 <= spare <= sched.window - 1, f"{r.rid}: {len(r.kv_slots)} slots for kv_len {r.kv_len}"
    used = cfg.max_running_requests + 1 - sched.req_to_token.available
    assert used == len(sched.live_requests()), "request slots leaked or double-booked"


def run_to_completion(sched: Scheduler, reqs: Sequence[Req] = (), arrivals: Optional[dict[int, Sequence[Req]]] = None,
                      max_steps: int = 100_000, check_every_step: bool = True) -> dict[str, Req]:
    """Add reqs, step until idle (adding arrivals[k] before step k); returns finished requests by rid."""
    arrivals = {k: list(v) for k, v in (arrivals or {}).items()}
    done: dict[str, Req] = {}

    def add(r: Req) -> None:
        early = sched.add_request(r)
        if early is not None:
            done[early.rid] = early

    for r in reqs:
        add(r)
    step = 0
    while sched.has_work() or any(k >= step for k in arrivals):
        if step >= max_steps:
            raise AssertionError(f"scheduler did not finish within {max_steps} steps")
        for r in arrivals.pop(step, []):
            add(r)
        ran = len(sched.runner.batches)
        had_work = sched.has_work()
        result = sched.step()
        if had_work and len(sched.runner.batches) == ran:
            raise AssertionError(f"step {step}: scheduler has work but scheduled nothing (stuck)")
        for r in result.finished:
            assert r.rid not in done, f"{r.rid} finished twice"
            assert r.finished and r.req_pool_idx is None and not r.kv_slots
            done[r.rid] = r
        if check_every_step:
            check_step_invariants(sched)
        step += 1
    sched.check_integrity()
    return done


def assert_no_leak(sched: Scheduler) -> None:
    """Idle scheduler: after dropping the prefix cache every token slot and request slot is free."""
    assert not sched.has_work()
    sched.check_integrity()
    assert sched.tree.evictable_size == sched.tree.total_size
    sched.tree.reset()
    assert sched.allocator.available == sched.allocator.size
    assert sorted(sched.allocator._free) == list(range(1, sched.allocator.size + 1))
    assert sched.req_to_token.available == sched.cfg.max_running_requests + 1
