"""RequestQueues: where each request of the scheduler is."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from specserve.scheduler.batch import ScheduleBatch
from specserve.scheduler.req import Req


@dataclass
class RequestQueues:
    """Waiting for admission, the one mid-prefill (chunked), running (decoding), and the launched
    batches whose results are not processed yet: one in the normal loop, up to two in the overlap
    loop (step N+1 is scheduled before step N's results are processed). The loops keep the
    executor's handle on the batch itself, so `in_flight` is the only record of them."""

    waiting: list[Req] = field(default_factory=list)
    running: list[Req] = field(default_factory=list)
    chunked: Optional[Req] = None
    in_flight: list[ScheduleBatch] = field(default_factory=list)
    # A closed batch runs: every request it will see is submitted (Engine.generate), so a slot
    # freed while nothing waits stays empty.
    closed: bool = False

    def live(self) -> list[Req]:
        """Requests holding KV: running, the chunked one, and those of the in-flight batches."""
        live = list(self.running) + ([self.chunked] if self.chunked else [])
        for batch in self.in_flight:
            live += [r for r in batch.reqs if not r.finished and r not in live]
        return live
