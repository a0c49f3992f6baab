"""MemoryPressure: how much KV admission reserves for running requests, and retraction when the
slots run out anyway.

Admission reserves an estimate of each request's future decode tokens (`new_token_ratio` of its
remaining budget, which decays while decoding goes well); if a step still runs out of slots,
unlocked cache is evicted first (KVLedger.alloc), then the most recently admitted running
request is retracted: its computed KV goes into the prefix cache and it is requeued, resuming
where it stopped.
"""

from __future__ import annotations

import logging

from specserve.scheduler.kv_ledger import KVLedger
from specserve.scheduler.queues import RequestQueues
from specserve.scheduler.req import Req

logger = logging.getLogger(__name__)

# Admission never plans for more than this many future tokens of one request.
CLIP_MAX_NEW_TOKENS = 4096
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


class MemoryPressure:
    """The new-token estimate and retraction (see the module docstring)."""

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
