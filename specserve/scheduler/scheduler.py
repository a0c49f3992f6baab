"""Scheduler: continuous batching over a paged KV cache, in pure Python.

Each step is either one prefill batch (new requests, after their cached prefixes, chunked to
`chunked_prefill_size`) or one decode batch (every running request advances one token). It
never touches the model: a loop (scheduler/loops.py) hands each batch's StepInput to an executor
and the outcomes back to `process_result`, which keeps the whole policy testable with a fake one.

Memory pressure: admission reserves an estimate of each request's future decode tokens
(`new_token_ratio` of its remaining budget); if decode still runs out of slots, unlocked cache
is evicted first, then the most recently admitted requests are retracted: their computed KV goes
into the prefix cache and they are requeued, resuming where they stopped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from specserve.executor.step_io import (
    DECODE,
    EXTEND,
    VERIFY,
    SampledToken,
    StepOutcome,
    VerifyOutcome,
    emitted_tokens,
)
from specserve.kv.pool import ReqToTokenPool, TokenSlotAllocator
from specserve.kv.radix_cache import RadixCache
from specserve.scheduler.batch import ScheduleBatch
from specserve.scheduler.finish import check_finish
from specserve.scheduler.integrity import check_kv_integrity
from specserve.scheduler.policy import order_waiting
from specserve.scheduler.req import FinishReason, Req
from specserve.scheduler.stats import SchedulerStats
from specserve.scheduler.validation import validate_request

logger = logging.getLogger(__name__)

# Admission never plans for more than this many future tokens of one request.
CLIP_MAX_NEW_TOKENS = 4096
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduling knobs (a subset of ServerArgs plus model facts)."""

    context_length: int
    eos_token_ids: tuple[int, ...] = ()
    max_running_requests: int = 64
    max_prefill_tokens: int = 8192
    chunked_prefill_size: int = 2048
    schedule_policy: str = "fcfs"
    num_draft_tokens: int = 0  # gamma: the window of a decode step is 1 + gamma positions (0: plain decode)


@dataclass
class StepResult:
    """What one step produced: (request, new token) pairs and the requests that finished."""

    tokens: list[tuple[Req, int]] = field(default_factory=list)
    finished: list[Req] = field(default_factory=list)
    flushed: list[tuple[str, int]] = field(default_factory=list)  # (flush token, cache slots freed)


class Scheduler:
    """Owns the waiting queue, the running batch and all KV bookkeeping."""

    def __init__(self, cfg: SchedulerConfig, allocator: TokenSlotAllocator, req_to_token: ReqToTokenPool,
                 tree: RadixCache, decode_text: Optional[Callable[[list[int]], str]] = None,
                 consensus=None):
        self.cfg = cfg
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.tree = tree
        self.decode_text = decode_text
        # Each decode step covers this many positions per request: the anchor plus its drafts,
        # which the executor's drafters propose on the forward stream (DSPARK or NGRAM).
        self.window = 1 + cfg.num_draft_tokens
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Optional[Req] = None
        # Scheduled, results not yet processed: one batch in the normal loop, up to two in the
        # overlap loop (step N+1 is scheduled before step N's results are processed). The loops
        # keep the executor's handle on the batch itself, so this is the only record of them.
        self.in_flight: list[ScheduleBatch] = []
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self._arrivals = 0
        self.num_retractions = 0
        self.stats = SchedulerStats(self.window - 1)
        self.consensus = consensus  # a RankConsensusChecker under tensor parallelism

    def _agree(self, site: str, value) -> None:
        """An event the other tensor-parallel ranks must reproduce exactly (see distributed/consensus.py)."""
        if self.consensus is not None:
            self.consensus.record(site, value)

    # ------------------------------------------------------------ requests in and out

    def add_request(self, req: Req) -> Optional[Req]:
        """Queue a request; returns it at once if it needs no step (max_new_tokens == 0)."""
        self.validate_request(req)
        room = self.cfg.context_length - len(req.input_ids)
        req.params.max_new_tokens = min(req.params.max_new_tokens, room)
        req.arrival = self._arrivals
        self._arrivals += 1
        if req.params.max_new_tokens == 0:
            req.finish_reason = FinishReason.LENGTH
            return req
        self.waiting.append(req)
        return None

    def validate_request(self, req: Req) -> None:
        validate_request(req, self.cfg.context_length, self.window, self.allocator.size)

    def abort(self, rid: str) -> Optional[Req]:
        """Stop a request wherever it is; its KV is released exactly once."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                return self._finish(req, FinishReason.ABORT)
        for req in self.live_requests():
            if req.rid == rid and not req.finished:
                if req is self.chunked_req:
                    self.chunked_req = None
                elif req in self.running:
                    self.running.remove(req)
                # A request in the in-flight batch only; process_result skips it once finished.
                self._release(req)
                return self._finish(req, FinishReason.ABORT)
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req)

    # ------------------------------------------------------------ one step

    def schedule(self) -> Optional[ScheduleBatch]:
        """Next batch: a prefill when anything can be admitted, else a decode of all running requests."""
        batch = self._schedule_prefill()
        if batch is None and self.running:
            batch = self._schedule_decode()
        if batch is not None:
            self.in_flight.append(batch)
            self._agree("batch", (batch.mode, [(r.rid, n) for r, n in zip(batch.reqs, batch.extend_lens)]))
        return batch

    def process_result(self, batch: ScheduleBatch,
                       tokens: Sequence[StepOutcome | list[int]]) -> StepResult:
        result = StepResult()
        self.in_flight.remove(batch)
        for req, n, sampled, token in zip(batch.reqs, batch.extend_lens, batch.sample, tokens):
            if req.finished:  # aborted while its step was in flight; its KV is already released
                continue
            if isinstance(token, SampledToken) and token.prompt is not None:
                req.add_prompt_logprobs(token.prompt.start, token.prompt.logprobs)
            if not sampled:
                req.kv_len += n
                self.chunked_req = req
                continue
            window = token if isinstance(token, VerifyOutcome) else None
            logprobs = token.logprobs if isinstance(token, (VerifyOutcome, SampledToken)) else None
            emitted = emitted_tokens(token)
            start = req.kv_len
            reason, appended = None, 0
            for tok in emitted:  # stop conditions apply inside an accepted run: nothing past a stop
                req.output_ids.append(tok)
                result.tokens.append((req, tok))
                appended += 1
                self.stats.generated_tokens += 1
                reason = self._check_finish(req)
                if reason is not None:
                    break
            if logprobs is not None:
                req.output_logprobs.extend(logprobs[:appended])
            if batch.mode == EXTEND:
                req.kv_len += n
                self.running.append(req)
            else:
                # Window rows 0..appended-1 (the anchor and the emitted drafts) hold committed KV.
                # The slots past them stay with the request: the next window overwrites them.
                req.kv_len = start + appended
                if window is not None:
                    self.stats.record_window(req, window, appended, len(emitted))
            if reason is not None:
                self.running.remove(req)
                self._release(req)
                result.finished.append(self._finish(req, reason))
        if batch.mode != EXTEND:
            self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        self._agree("committed", [(r.rid, r.kv_len, len(r.output_ids)) for r in batch.reqs])
        return result

    # ------------------------------------------------------------ prefill

    def _schedule_prefill(self) -> Optional[ScheduleBatch]:
        budget = self.cfg.max_prefill_tokens
        chunk_cap = self.cfg.chunked_prefill_size if self.cfg.chunked_prefill_size > 0 else 1 << 62
        planned = self._reserved_for_running()  # slots promised to running requests and to this plan
        plan: list[tuple[Req, int]] = []
        if self.chunked_req is not None:
            req, self.chunked_req = self.chunked_req, None
            n = min(len(req.fill_ids) - req.kv_len, chunk_cap, budget)
            plan.append((req, n))
            budget -= n
            planned += n
        for req in order_waiting(self.waiting, self.cfg.schedule_policy, self.tree):
            if budget <= 0 or any(n < len(r.fill_ids) - r.kv_len for r, n in plan):
                break  # one chunked request at a time, and it ends the batch
            if len(self.running) + len(plan) >= self.cfg.max_running_requests or self.req_to_token.available == 0:
                break
            admitted = self._try_admit(req, min(chunk_cap, budget), planned)
            if admitted is None:
                break  # no skipping ahead: a large request is not starved by smaller ones behind it
            self.waiting.remove(req)
            plan.append((req, admitted))
            budget -= admitted
            planned += len(req.fill_ids) - req.kv_len + self._reserve(req)
        if not plan:
            return None
        return self._build_extend(plan)

    def _try_admit(self, req: Req, max_tokens: int, planned: int) -> Optional[int]:
        """Lock req's cached prefix and give it a request slot if it fits; returns tokens to compute now."""
        fill = req.fill_ids
        # always recompute at least one token; all of a prompt whose logprobs are asked for
        prefix_slots, node = self.tree.match_prefix([] if req.wants_prompt_logprobs else fill[:-1])
        self.tree.inc_lock_ref(node)  # now unevictable, so _available() no longer counts it
        need = len(fill) - len(prefix_slots) + self._reserve(req)
        if need > self._available() - planned:
            self.tree.dec_lock_ref(node)
            return None
        req.req_pool_idx = self.req_to_token.alloc()
        req.kv_slots = list(prefix_slots)
        req.kv_len = req.cache_protected_len = len(prefix_slots)
        req.last_node = node
        if not req.admitted_once:
            req.cached_tokens = len(prefix_slots)
            req.admitted_once = True
        self.req_to_token.write(req.row, 0, prefix_slots)
        return min(len(fill) - len(prefix_slots), max_tokens)

    def _build_extend(self, plan: list[tuple[Req, int]]) -> ScheduleBatch:
        slots = self._alloc_or_retract(sum(n for _, n in plan))
        batch = ScheduleBatch(EXTEND, [], [], [], [], [], [])
        offset = 0
        for req, n in plan:
            own = slots[offset:offset + n]
            offset += n
            self.req_to_token.write(req.row, req.kv_len, own)
            req.kv_slots.extend(own)
            batch.reqs.append(req)
            batch.prefix_lens.append(req.kv_len)
            batch.extend_lens.append(n)
            batch.input_ids.extend(req.fill_ids[req.kv_len:req.kv_len + n])
            batch.out_cache_loc.extend(own)
            batch.sample.append(req.kv_len + n == len(req.fill_ids))
        return batch

    # ------------------------------------------------------------ decode

    def _schedule_decode(self) -> ScheduleBatch:
        """Every running request advances: one token, or a verify window [anchor, d_1..d_g] at
        positions kv_len..kv_len+g. Window slots a request still holds from its previous window
        (rejected drafts) are reused; only the shortfall is allocated."""
        w = self._grow_windows()
        reqs = list(self.running)
        input_ids: list[int] = []
        out_cache_loc: list[int] = []
        for req in reqs:
            input_ids.append(req.output_ids[-1])
            input_ids.extend([req.output_ids[-1]] * (w - 1))  # draft placeholders: the executor drafts
            out_cache_loc.extend(req.kv_slots[req.kv_len:req.kv_len + w])
        # Whether a window carries drafts is the executor's plan (speculative/speculation.py), not ours.
        mode = VERIFY if w > 1 else DECODE
        return ScheduleBatch(mode, reqs, [r.kv_len for r in reqs], [w] * len(reqs), input_ids, out_cache_loc,
                             [True] * len(reqs))

    def _window_need(self, req: Req) -> int:
        """Slots req must hold for its next window. A request in an unprocessed decode step may
        commit up to a whole window there first, so the overlap loop plans for that too."""
        pending = sum(1 for b in self.in_flight if b.mode != EXTEND and req in b.reqs)
        return req.kv_len + self.window * (1 + pending) - len(req.kv_slots)

    def overlap_ready(self) -> bool:
        """Can the next decode step be scheduled before the in-flight one is processed? Only a
        decode after a decode, with nobody waiting and no retraction needed (a retraction would
        take KV from a request whose step is still running)."""
        if len(self.in_flight) != 1 or self.in_flight[0].mode == EXTEND or self.waiting or self.chunked_req:
            return False
        need = sum(max(0, self._window_need(r)) for r in self.running)
        return need <= self._available()

    def _grow_windows(self) -> int:
        """Give every running request slots for the positions of its next window."""
        w = self.window
        while True:
            short = {id(r): self._window_need(r) for r in self.running}
            slots = self._alloc_slots(sum(max(0, n) for n in short.values()))
            if slots is not None:
                break
            if len(self.running) <= 1:
                raise RuntimeError(f"scheduler: decode needs {sum(short.values())} KV slots, {self._available()} "
                                   "available, nothing left to retract (admission should have prevented this)")
            self._retract_one()
        offset = 0
        for req in self.running:
            n = max(0, short[id(req)])
            own = slots[offset:offset + n]
            offset += n
            self.req_to_token.write(req.row, len(req.kv_slots), own)
            req.kv_slots.extend(own)
        return w

    def _alloc_or_retract(self, n: int) -> list[int]:
        """Allocate n slots for a prefill, evicting cache, then retracting running requests."""
        while True:
            slots = self._alloc_slots(n)
            if slots is not None:
                return slots
            if not self.running:
                raise RuntimeError(f"scheduler: {n} KV slots needed, {self._available()} available, nothing "
                                   "left to retract (admission should have prevented this)")
            self._retract_one()

    def _retract_one(self) -> None:
        victim = max(self.running, key=lambda r: r.arrival)
        self.running.remove(victim)
        self._release(victim)
        victim.num_retractions += 1
        self.num_retractions += 1
        self.waiting.append(victim)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)
        logger.info("retracted request %s under memory pressure", victim.rid)

    # ------------------------------------------------------------ memory

    def _available(self) -> int:
        return self.allocator.available + self.tree.evictable_size

    def _reserve(self, req: Req) -> int:
        # A verify window needs window - 1 slots beyond the tokens it will keep.
        return int(min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio) + self.window - 1

    def _reserved_for_running(self) -> int:
        return sum(self._reserve(r) for r in self.running)

    def _alloc_slots(self, n: int) -> Optional[list[int]]:
        return self.tree.alloc_evicting(self.allocator, n)

    def _release(self, req: Req) -> None:
        """Hand a request's KV to the prefix cache (or free it) and drop its locks, exactly once."""
        if req.req_pool_idx is None:
            return
        computed = req.kv_len
        self._agree("cache_finished_req", (req.rid, computed, req.cache_protected_len, len(req.output_ids)))
        self.allocator.free(req.kv_slots[computed:])  # allocated but never computed
        if self.tree.disabled:
            self.allocator.free(req.kv_slots[req.cache_protected_len:computed])
        else:
            cached = self.tree.insert(req.fill_ids[:computed], req.kv_slots[:computed])
            self.allocator.free(req.kv_slots[req.cache_protected_len:cached])
        self.tree.dec_lock_ref(req.last_node)
        self.req_to_token.free(req.req_pool_idx)
        req.req_pool_idx, req.kv_slots, req.last_node, req.cache_protected_len, req.kv_len = None, [], None, 0, 0

    # ------------------------------------------------------------ finishing

    def _check_finish(self, req: Req) -> Optional[FinishReason]:
        try:
            return check_finish(req, self.cfg.eos_token_ids, self.decode_text)
        except Exception as exc:  # one request's host work (detokenizing for its stop strings) fails it alone
            logger.error("request %s failed in its stop check", req.rid, exc_info=True)
            req.error = f"stop check failed: {type(exc).__name__}: {exc}"
            return FinishReason.ERROR

    @staticmethod
    def _finish(req: Req, reason: FinishReason) -> Req:
        req.finish_reason = reason
        return req

    # ------------------------------------------------------------ integrity

    def live_requests(self) -> list[Req]:
        """Requests holding KV: running, the chunked one, and those of the in-flight batch."""
        live = list(self.running) + ([self.chunked_req] if self.chunked_req else [])
        for batch in self.in_flight:
            live += [r for r in batch.reqs if not r.finished and r not in live]
        return live

    def check_integrity(self) -> None:
        """free + cached + in use == total, no slot counted twice, and locks balanced when idle."""
        check_kv_integrity(self.allocator, self.tree, self.live_requests())

