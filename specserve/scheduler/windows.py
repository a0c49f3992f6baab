"""DecodeWindows: the decode part of the scheduler.

Every running request advances in a decode step: one token, or with speculation a window
[anchor, d_1..d_g] at positions kv_len..kv_len+g (whether the window carries drafts is the
executor's plan, not the scheduler's). Window slots a request still holds from its previous
window (rejected drafts) are reused; only the shortfall is allocated, retracting requests if the
pool runs out.
"""

from __future__ import annotations

from specserve.executor.step_io import DECODE, EXTEND, VERIFY
from specserve.scheduler.batch import ScheduleBatch
from specserve.scheduler.kv_ledger import KVLedger
from specserve.scheduler.pressure import MemoryPressure
from specserve.scheduler.queues import RequestQueues
from specserve.scheduler.req import Req


class DecodeWindows:
    """Plans decode batches and the KV of their windows (see the module docstring)."""

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
