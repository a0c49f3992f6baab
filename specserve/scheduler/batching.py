"""Forming the next batch: the order of the waiting queue, prefill admission and its chunks,
decode windows, and the KV reserve and retraction that both plan with, under the scheduling knobs.
The Scheduler (scheduler.py) composes these parts and picks a prefill batch when anything can be
admitted, else a decode batch; each part can be read and tested alone.

SchedulerConfig: the scheduling knobs (a subset of ServerArgs plus model facts). They are defined
here, below the Scheduler, so that the parts read them without importing the Scheduler that
composes them.

Order of the waiting queue (order_waiting): fcfs, lpm (longest prefix match) or
shortest-prefill-first. Matching every waiting request against the tree costs time: past
LPM_MAX_QUEUE waiting requests, lpm falls back to fcfs.

Admission (prefill): a prefill batch holds the chunked request's next chunk (if one is
mid-prefill) and then waiting requests in the queue's order (order_waiting), each after its
cached prefix, while the token budget (`max_prefill_tokens`), the request slots and the KV (with
every running request's reserve) allow. A request longer than `chunked_prefill_size` is
prefilled a chunk per step, and a chunk ends the batch. There is no skipping ahead: a large
request is not starved by smaller ones behind it.

DecodeWindows (decode): every running request advances in a decode step: one token, or with
speculation a window [anchor, d_1..d_g] at positions kv_len..kv_len+g (whether the window
carries drafts is the executor's plan, not the scheduler's). Window slots a request still holds
from its previous window (rejected drafts) are reused; only the shortfall is allocated,
retracting requests if the pool runs out.

MemoryPressure (reserve, retraction): how much KV admission reserves for running requests, and
retraction when the slots run out anyway. Admission reserves an estimate of each request's
future decode tokens (`new_token_ratio` of its remaining budget, which decays while decoding
goes well); if a step still runs out of slots, unlocked cache is evicted first (KVLedger.alloc),
then the most recently admitted running request is retracted: its computed KV goes into the
prefix cache and it is requeued, resuming where it stopped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from specserve.errors import ConfigError
from specserve.executor.step_io import DECODE, EXTEND, VERIFY
from specserve.kv.radix_cache import RadixCache
from specserve.scheduler.kv_ledger import KVLedger
from specserve.scheduler.req import Req, RequestQueues, ScheduleBatch

logger = logging.getLogger(__name__)


# ------------------------------------------------------------ the knobs


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


# ------------------------------------------------------------ the order of the waiting queue


# Matching every waiting request against the tree costs time; past this many, lpm falls back to fcfs.
LPM_MAX_QUEUE = 128


def order_waiting(waiting: list[Req], policy: str, tree: RadixCache) -> list[Req]:
    """The waiting requests in the policy's order (see the module docstring)."""
    by_arrival = sorted(waiting, key=lambda r: r.arrival)
    if policy == "fcfs" or tree.disabled and policy == "lpm":
        return by_arrival
    if policy == "lpm" and len(waiting) > LPM_MAX_QUEUE:
        return by_arrival
    cached = {id(r): len(tree.match_prefix(r.fill_ids[:-1])[0]) for r in by_arrival}
    if policy == "lpm":
        return sorted(by_arrival, key=lambda r: -cached[id(r)])
    if policy == "shortest-prefill-first":
        return sorted(by_arrival, key=lambda r: len(r.fill_ids) - cached[id(r)])
    raise ConfigError(f"schedule_policy: unknown policy {policy!r}")


# ------------------------------------------------------------ reserve and retraction


# Admission never plans for more than this many future tokens of one request.
CLIP_MAX_NEW_TOKENS = 4096
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


class MemoryPressure:
    """The new-token estimate and retraction (see the module docstring: MemoryPressure)."""

    def __init__(self, ledger: KVLedger, queues: RequestQueues, window: int):
        self.ledger, self.queues, self.window = ledger, queues, window
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.num_retractions = 0

    def reserve(self, req: Req) -> int:
        """Slots to keep for req's future tokens; a verify window needs window - 1 beyond the kept ones."""
        return int(min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio) + self.window - 1

    def reserved_for_running(self) -> int:
        return sum(self.reserve(r) for r in self.queues.running)

    def decode_step_done(self) -> None:
        """Decoding went on without a retraction: reserve a little less."""
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)

    def alloc_or_retract(self, n: int) -> list[int]:
        """n slots for a prefill, evicting cache, then retracting running requests."""
        while True:
            slots = self.ledger.alloc(n)
            if slots is not None:
                return slots
            if not self.queues.running:
                raise RuntimeError(
                    f"scheduler: {n} KV slots needed, {self.ledger.available} available, nothing "
                    "left to retract (admission should have prevented this)"
                )
            self.retract_one()

    def retract_one(self) -> None:
        queues = self.queues
        victim = max(queues.running, key=lambda r: r.arrival)
        queues.running.remove(victim)
        self.ledger.release(victim)
        victim.num_retractions += 1
        self.num_retractions += 1
        queues.waiting.append(victim)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)
        logger.info("retracted request %s under memory pressure", victim.rid)


# ------------------------------------------------------------ prefill


class Admission:
    """Plans prefill batches (see the module docstring: Admission)."""

    def __init__(self, cfg: SchedulerConfig, ledger: KVLedger, queues: RequestQueues, pressure: MemoryPressure):
        self.cfg, self.ledger, self.queues, self.pressure = cfg, ledger, queues, pressure

    def schedule(self) -> Optional[ScheduleBatch]:
        """This step's prefill batch, or None when nothing can be prefilled."""
        queues = self.queues
        budget = self.cfg.max_prefill_tokens
        chunk_cap = self.cfg.chunked_prefill_size if self.cfg.chunked_prefill_size > 0 else 1 << 62
        planned = self.pressure.reserved_for_running()  # slots promised to running requests and to this plan
        plan: list[tuple[Req, int]] = []
        if queues.chunked is not None:
            req, queues.chunked = queues.chunked, None
            n = min(len(req.fill_ids) - req.kv_len, chunk_cap, budget)
            plan.append((req, n))
            budget -= n
            planned += n
        for req in order_waiting(queues.waiting, self.cfg.schedule_policy, self.ledger.tree):
            if budget <= 0 or any(n < len(r.fill_ids) - r.kv_len for r, n in plan):
                break  # one chunked request at a time, and it ends the batch
            if len(queues.running) + len(plan) >= self.cfg.max_running_requests or not self.ledger.has_request_slot:
                break
            admitted = self._try_admit(req, min(chunk_cap, budget), planned)
            if admitted is None:
                break  # no skipping ahead
            queues.waiting.remove(req)
            plan.append((req, admitted))
            budget -= admitted
            planned += len(req.fill_ids) - req.kv_len + self.pressure.reserve(req)
        return self._build(plan) if plan else None

    def _try_admit(self, req: Req, max_tokens: int, planned: int) -> Optional[int]:
        """Lock req's cached prefix and give it a request slot if it fits; returns tokens to compute now."""
        fill = req.fill_ids
        # always recompute at least one token; all of a prompt whose logprobs are asked for
        prefix_slots, node = self.ledger.lock_prefix([] if req.wants_prompt_logprobs else fill[:-1])
        need = len(fill) - len(prefix_slots) + self.pressure.reserve(req)
        if need > self.ledger.available - planned:  # the locked prefix no longer counts as available
            self.ledger.unlock(node)
            return None
        self.ledger.bind(req, prefix_slots, node)
        if not req.admitted_once:
            req.cached_tokens = len(prefix_slots)
            req.admitted_once = True
        return min(len(fill) - len(prefix_slots), max_tokens)

    def _build(self, plan: list[tuple[Req, int]]) -> ScheduleBatch:
        slots = self.pressure.alloc_or_retract(sum(n for _, n in plan))
        batch = ScheduleBatch(EXTEND, [], [], [], [], [], [])
        offset = 0
        for req, n in plan:
            own = slots[offset : offset + n]
            offset += n
            batch.reqs.append(req)
            batch.prefix_lens.append(req.kv_len)
            batch.extend_lens.append(n)
            batch.input_ids.extend(req.fill_ids[req.kv_len : req.kv_len + n])
            batch.out_cache_loc.extend(own)
            batch.sample.append(req.kv_len + n == len(req.fill_ids))
            self.ledger.append(req, own)
        return batch


# ------------------------------------------------------------ decode


class DecodeWindows:
    """Plans decode batches and the KV of their windows (see the module docstring: DecodeWindows)."""

    def __init__(self, window: int, ledger: KVLedger, queues: RequestQueues, pressure: MemoryPressure):
        self.window, self.ledger, self.queues, self.pressure = window, ledger, queues, pressure

    def schedule(self) -> ScheduleBatch:
        """A decode batch of every running request, each holding the slots of its window."""
        self._grow()
        reqs, w = list(self.queues.running), self.window
        # The executor reads anchors, positions and slots itself (FutureMap, req_to_token).
        return ScheduleBatch(
            VERIFY if w > 1 else DECODE,
            reqs,
            [r.kv_len for r in reqs],
            [w] * len(reqs),
            [],
            [],
            [True] * len(reqs),
            refills=bool(self.queues.waiting) or not self.queues.closed,
        )

    def need(self, req: Req) -> int:
        """Slots req must hold for its next window. A request in an unprocessed decode step may
        commit up to a whole window there first, so the overlap loop plans for that too."""
        pending = sum(1 for b in self.queues.in_flight if b.mode != EXTEND and req in b.reqs)
        return req.kv_len + self.window * (1 + pending) - len(req.kv_slots)

    def overlap_ready(self) -> bool:
        """Can the next decode step be scheduled before the in-flight one is processed? Only a
        decode after a decode, with nobody waiting and no retraction needed (a retraction would
        take KV from a request whose step is still running)."""
        queues = self.queues
        if len(queues.in_flight) != 1 or queues.in_flight[0].mode == EXTEND or queues.waiting or queues.chunked:
            return False
        return sum(max(0, self.need(r)) for r in queues.running) <= self.ledger.available

    def _grow(self) -> None:
        """Give every running request slots for the positions of its next window."""
        running = self.queues.running
        while True:
            short = {id(r): self.need(r) for r in running}
            slots = self.ledger.alloc(sum(max(0, n) for n in short.values()))
            if slots is not None:
                break
            if len(running) <= 1:
                raise RuntimeError(
                    f"scheduler: decode needs {sum(short.values())} KV slots, {self.ledger.available} "
                    "available, nothing left to retract (admission should have prevented this)"
                )
            self.pressure.retract_one()
        offset = 0
        for req in running:
            n = max(0, short[id(req)])
            self.ledger.append(req, slots[offset : offset + n])
            offset += n
