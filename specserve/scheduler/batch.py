"""ScheduleBatch: what one step runs, in plain Python lists, and the StepInput made from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specserve.executor.step_io import EXTEND, VERIFY, StepInput
from specserve.names import StepMode
from specserve.scheduler.req import Req


@dataclass(eq=False)
class ScheduleBatch:
    """The requests of one forward step and, per request, the new tokens and their KV slots."""

    mode: StepMode  # EXTEND (prefill, possibly after a cached prefix or as one chunk), DECODE or VERIFY
    reqs: list[Req]
    prefix_lens: list[int]  # tokens already in the KV cache, per request
    extend_lens: list[int]  # new tokens this step, per request
    input_ids: list[int]  # flat new tokens
    out_cache_loc: list[int]  # flat token slots for the new tokens' K/V
    sample: list[bool]  # whether a next token is sampled for the request (False for a non-final chunk)
    handle: Any = None  # the executor's handle while the launched step runs (see scheduler/loops.py)
    refills: bool = True  # decode/verify: a slot freed early lets a request in (RequestQueues.closed)

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    def positions(self) -> list[int]:
        return [p + i for p, e in zip(self.prefix_lens, self.extend_lens) for i in range(e)]

    def step_input(self) -> StepInput:
        """A snapshot of this batch for the executor: values only, no scheduler objects."""
        reqs = self.reqs
        step = StepInput(
            self.mode,
            [r.rid for r in reqs],
            [r.row for r in reqs],
            [r.params for r in reqs],
            [r.seed for r in reqs],
            list(self.sample),
            width=self.extend_lens[0] if self.mode != EXTEND else 0,
            drafters=[r.drafter for r in reqs] if self.mode == VERIFY else [],
            refills=self.refills,
        )
        if self.mode == EXTEND:
            step.prefix_lens, step.extend_lens = list(self.prefix_lens), list(self.extend_lens)
            step.input_ids, step.out_cache_loc = list(self.input_ids), list(self.out_cache_loc)
            step.out_lens = [len(r.output_ids) for r in reqs]
            step.prompt_logprobs = [r.wants_prompt_logprobs for r in reqs]
            step.fills = [list(r.fill_ids) if s or p else None for r, s, p in zip(reqs, self.sample, step.prompt_logprobs)]
        else:
            step.kv_bound = max(len(r.kv_slots) for r in reqs)
        return step
