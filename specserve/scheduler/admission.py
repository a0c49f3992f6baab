"""Admission: the prefill part of the scheduler.

A prefill batch holds the chunked request's next chunk (if one is mid-prefill) and then waiting
requests in the queue's order (scheduler/policy.py), each after its cached prefix, while the
token budget (`max_prefill_tokens`), the request slots and the KV (with every running request's
reserve) allow. A request longer than `chunked_prefill_size` is prefilled a chunk per step, and
a chunk ends the batch. There is no skipping ahead: a large request is not starved by smaller
ones behind it.
"""

from __future__ import annotations

from typing import Optional

from specserve.executor.step_io import EXTEND
from specserve.scheduler.batch import ScheduleBatch
from specserve.scheduler.config import SchedulerConfig
from specserve.scheduler.kv_ledger import KVLedger
from specserve.scheduler.policy import order_waiting
from specserve.scheduler.pressure import MemoryPressure
from specserve.scheduler.queues import RequestQueues
from specserve.scheduler.req import Req


class Admission:
    """Plans prefill batches (see the module docstring)."""

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
