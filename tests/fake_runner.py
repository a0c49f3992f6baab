"""A deterministic stand-in for the executor (ModelRunner), plus helpers to build and drive a Scheduler.

`FakeRunner` runs a step from its StepInput alone, as the real executor does: the prefill chunk's
tokens and slots, the request slots (rows of the req_to_token table) and, for decode and verify
steps, its own per-row state (the FutureMap's part: each request's tokens and KV length). Every
sampled token is a pure function of the request's full token history (prompt + outputs so far),
so scheduling decisions (batching, chunking, prefix reuse, retraction) must not change any
output, which is what most scheduler tests assert.

Every step it also checks the KV bookkeeping the real model depends on, through the same table:

* the step is well formed (sizes, modes, widths, kv_bound; no request slot twice),
* every slot the step writes is nonzero, distinct, allocated (not on the free list), not held by
  the radix tree and not read by any other request of the step,
* a shadow map slot -> (position, token, hash of the whole prefix up to it) is written for every
  written slot; the tokens a row's KV holds (read through its table row) must be exactly the
  request's own, at the same positions after the same prefix. That is what makes prefix sharing
  correct: attention over those slots sees the KV this request would have computed.

Any violation raises AssertionError from inside the loop's step. `make_scheduler` returns a
`DrivenScheduler`: the scheduler with this runner and a NormalLoop, whose `step()` runs one loop step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from specserve.executor.step_io import StepInput, StepOutcome, VerifyStats
from specserve.kv.pool import ReqToTokenPool, TokenSlotAllocator
from specserve.kv.radix_cache import RadixCache
from specserve.sampling_params import SamplingParams
from specserve.scheduler.batching import SchedulerConfig
from specserve.scheduler.loops import NormalLoop
from specserve.scheduler.req import Req, ScheduleBatch
from specserve.scheduler.scheduler import Scheduler

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
        self.shadow: dict[int, tuple] = {}  # slot -> (position, token, prefix hash), or ("stale", position)
        self._rows: dict[int, _Row] = {}  # request slot -> the request's state, from its last prefill
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
        """Runs at once (a loop's handle is the result), from the StepInput alone: what the real
        executor gets, plus the KV it can read (the req_to_token table and its own shadow KV)."""
        assert self.sched is not None, "FakeRunner.launch needs attach(scheduler)"
        n = step.size
        assert n > 0, "empty step"
        assert len(step.rids) == len(step.params) == len(step.sample) == n
        assert len(set(step.rows)) == n, "a request slot appears twice in one step"
        if step.mode == "extend":
            return self._extend(step)
        assert step.mode in ("decode", "verify") and all(step.sample), step.mode
        assert step.width == (1 if step.mode == "decode" else self.sched.window), (step.mode, step.width)
        rows = [self._rows[r] for r in step.rows]
        assert [r.rid for r in rows] == step.rids, "a request slot holds another request than the executor's"
        prefixes = [r.seq_len for r in rows]
        self.batches.append(BatchRecord(step.mode, list(step.rids), prefixes, [step.width] * n, list(step.sample)))
        slots = [self._table(row, p, p + step.width) for row, p in zip(step.rows, prefixes)]
        assert all(max(p + step.width, 1) <= step.kv_bound for p in prefixes), "kv_bound below a window's end"
        if self.check_kv:
            self._check_new_slots(step.rows, prefixes, slots)
            for row, state in zip(step.rows, rows):
                self._check_history(row, state)
        return [self._window(state, p, s, step.width) for state, p, s in zip(rows, prefixes, slots)]

    def resolve(self, handle: list[StepOutcome]) -> list[StepOutcome]:
        return handle

    def run_batch(self, batch: ScheduleBatch) -> list[StepOutcome]:
        """Launch a scheduled batch through its StepInput (what the loops do)."""
        return self.launch(batch.step_input())

    def _extend(self, step: StepInput) -> list[StepOutcome]:
        n = step.size
        assert len(step.prefix_lens) == len(step.extend_lens) == len(step.fills) == len(step.out_lens) == n
        assert len(step.input_ids) == len(step.out_cache_loc) == sum(step.extend_lens)
        self.batches.append(BatchRecord("extend", list(step.rids), list(step.prefix_lens), list(step.extend_lens),
                                        list(step.sample)))
        per_request, offset = [], 0
        for ext in step.extend_lens:
            assert ext >= 1, f"extend of {ext} tokens"
            per_request.append((step.input_ids[offset:offset + ext], step.out_cache_loc[offset:offset + ext]))
            offset += ext
        if self.check_kv:
            self._check_new_slots(step.rows, step.prefix_lens, [slots for _, slots in per_request])
        out: list[StepOutcome] = []
        for i, (row, prefix, (tokens, slots)) in enumerate(zip(step.rows, step.prefix_lens, per_request)):
            assert self._table(row, prefix, prefix + len(slots)) == slots, "the table differs from out_cache_loc"
            history = self._kv_tokens(row, prefix) + tokens  # what attention over this row would see
            self._write_shadow(slots, prefix, history)
            if not step.sample[i]:
                out.append(StepOutcome())
                continue
            fill = step.fills[i]
            assert fill is not None and history == fill, f"{step.rids[i]}: its KV holds other tokens than its own"
            prompt = fill[:len(fill) - step.out_lens[i]]
            state = _Row(step.rids[i], prompt, fill[len(prompt):], len(fill))
            token = self.next_token(state.prompt, state.output)
            state.output.append(token)
            self._rows[row] = state
            out.append(StepOutcome([token]))
        return out

    def _window(self, state: "_Row", prefix: int, slots: list[int], width: int) -> StepOutcome:
        """A decode step's token, or what a speculative runner commits for a window of width - 1
        drafts by the "FAKE" drafter: the true next tokens, as many as the drafts it accepted plus
        the bonus. Shadow KV: the anchor and accepted rows hold their tokens, the rest is stale."""
        chain: list[int] = []
        for _ in range(width):
            chain.append(self.next_token(state.prompt, state.output + chain))
        accepted = self.accept(state, width) if width > 1 else 0
        assert 0 <= accepted < width
        committed = chain[:accepted + 1]
        history = state.prompt + state.output + committed[:-1]  # row j holds the token at position prefix + j
        hashes = prefix_hashes(history)
        for j, slot in enumerate(slots):
            pos = prefix + j
            self.shadow[slot] = (pos, history[pos], hashes[pos]) if j <= accepted else ("stale", pos)
        state.output += committed
        state.seq_len += len(committed)
        if width == 1:
            return StepOutcome(committed)
        return StepOutcome(committed, verify=VerifyStats(drafter="FAKE", drafts=width - 1))

    # ------------------------------------------------------------ the KV it can read, and checks

    def _table(self, row: int, start: int, end: int) -> list[int]:
        assert self.sched is not None
        return self.sched.ledger.req_to_token.table[row, start:end].tolist()

    def _kv_tokens(self, row: int, length: int) -> list[int]:
        """The tokens whose K/V positions 0..length-1 of this row hold (checked against the shadow's
        positions and prefix hashes: a slot written for another position or prefix fails here)."""
        tokens: list[int] = []
        for pos, slot in enumerate(self._table(row, 0, length)):
            got = self.shadow.get(slot)
            assert got is not None and got[0] == pos, f"row {row}: slot {slot} at position {pos} holds {got}"
            tokens.append(got[1])
            assert got[2] == prefix_hashes(tokens)[-1], f"row {row}: slot {slot} was written after another prefix"
        return tokens

    def _write_shadow(self, slots: list[int], start: int, history: list[int]) -> None:
        hashes = prefix_hashes(history)
        for j, slot in enumerate(slots):
            self.shadow[slot] = (start + j, history[start + j], hashes[start + j])

    def _check_history(self, row: int, state: "_Row") -> None:
        """A decode or verify row's KV holds its own tokens before the anchor."""
        want = (state.prompt + state.output)[:state.seq_len]
        assert self._kv_tokens(row, state.seq_len) == want, f"{state.rid}: its KV holds other tokens"

    def _check_new_slots(self, rows: list[int], prefixes: list[int], slots: list[list[int]]) -> None:
        """Every slot this step writes is nonzero, allocated, not the cache's, and no other request's."""
        assert self.sched is not None
        new = [s for own in slots for s in own]
        assert all(s != 0 for s in new), "a new token was written to the scratch slot 0"
        assert len(set(new)) == len(new), f"the step writes a slot twice: {new}"
        assert not set(self.sched.ledger.allocator._free) & set(new), "the step writes a slot that is on the free list"
        assert not set(self.sched.ledger.tree.all_slots()) & set(new), "the step overwrites a slot of the radix cache"
        for row, prefix, own in zip(rows, prefixes, slots):
            others = {s for r, p in zip(rows, prefixes) if r != row for s in self._table(r, 0, p)}
            assert not others & set(own), f"row {row} writes a slot another request of the step reads"


@dataclass
class _Row:
    """What the fake executor knows of a request slot (the real one keeps it in its FutureMap)."""

    rid: str
    prompt: list[int]
    output: list[int]  # every output token so far (the last is the next step's anchor)
    seq_len: int  # positions with K/V: every token but the last output (the anchor, the next window's first row)

    @property
    def input_ids(self) -> list[int]:  # what `accept(req, width)` callables read
        return self.prompt

    @property
    def output_ids(self) -> list[int]:
        return self.output


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
    assert len(sched.queues.running) <= cfg.max_running_requests
    assert len(sched.live_requests()) <= cfg.max_running_requests
    ids = [id(r) for r in sched.queues.waiting + sched.live_requests()]
    assert len(ids) == len(set(ids)), "a request is in two queues at once"
    for r in sched.queues.waiting:
        assert r.req_pool_idx is None and not r.kv_slots and r.last_node is None, f"{r.rid} waits holding KV"
    for r in sched.live_requests():
        assert not r.finished
        # A verify window leaves its rejected rows' slots with the request, for the next window.
        spare = len(r.kv_slots) - r.kv_len
        assert 0 <= spare <= sched.window - 1, f"{r.rid}: {len(r.kv_slots)} slots for kv_len {r.kv_len}"
    used = cfg.max_running_requests + 1 - sched.ledger.req_to_token.available
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
    assert sched.ledger.tree.evictable_size == sched.ledger.tree.total_size
    sched.ledger.tree.reset()
    assert sched.ledger.allocator.available == sched.ledger.allocator.size
    assert sorted(sched.ledger.allocator._free) == list(range(1, sched.ledger.allocator.size + 1))
    assert sched.ledger.req_to_token.available == sched.cfg.max_running_requests + 1
