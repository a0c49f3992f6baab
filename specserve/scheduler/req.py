"""Req: one generation request as the scheduler sees it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

from specserve.logits.logprobs import TokenLogprob
from specserve.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens or the context window
    ABORT = "abort"
    ERROR = "error"  # its own host work failed (see Req.error); the other requests go on


@dataclass(eq=False)  # identity: two requests are never "equal"
class Req:
    """A request's tokens, its KV slots and where it stands.

    KV bookkeeping: `kv_slots[i]` holds the KV of `fill_ids[i]` for i < kv_len. The first
    `cache_protected_len` slots belong to the radix tree (locked through `last_node`); the rest
    are owned by this request until it finishes or is retracted.
    """

    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int = 0
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, if asked
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.., if asked
    req_pool_idx: Optional[int] = None
    kv_slots: list[int] = field(default_factory=list)
    kv_len: int = 0
    cache_protected_len: int = 0
    last_node: Any = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    finish_reason: Optional[FinishReason] = None
    matched_stop: Optional[str | int] = None
    error: Optional[str] = None  # why it finished with FinishReason.ERROR
    num_retractions: int = 0
    admitted_once: bool = False
    drafter: Optional[str] = None  # the drafter of its verify windows (an Algorithm); None: no drafts
    spec_verify_ct: int = 0  # verify steps this request took part in
    spec_num_correct_drafts: int = 0  # drafts accepted and emitted
    spec_correct_hist: dict[int, int] = field(default_factory=dict)  # accepted drafts per step -> steps
    spec_emitted_trace: list[int] = field(default_factory=list)  # accepted and emitted drafts, per verify step
    spec_cap_trim_hist: dict[int, int] = field(default_factory=dict)  # matches cut by verify_len -> steps
    spec_draft_len_hist: dict[int, int] = field(default_factory=dict)  # drafts planned (k, 0 included) -> steps
    spec_drafter_steps: dict[str, int] = field(default_factory=dict)  # windows with drafts, per drafter
    spec_predicted_sum: float = 0.0  # the policy's expected accept length, summed over windows with drafts
    spec_plans: list[tuple[Optional[str], int]] = field(default_factory=list)  # (drafter, k) per verify step

    @property
    def fill_ids(self) -> list[int]:
        """Tokens whose KV the request needs before its next decode step."""
        return self.input_ids + self.output_ids

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's logprobs are asked for and not all computed yet (its prefill then skips the cache)."""
        return self.params.prompt_logprobs and len(self.prompt_logprobs) < len(self.input_ids) - 1

    def add_prompt_logprobs(self, start: int, logprobs: list[TokenLogprob]) -> None:
        """Logprobs of prompt positions start.. (a recomputed chunk may repeat some: each is kept once)."""
        have = len(self.prompt_logprobs) + 1  # the next position wanted (position 0 has none)
        for pos, lp in enumerate(logprobs, start):
            if pos == have and pos < len(self.input_ids):
                self.prompt_logprobs.append(lp)
                have += 1

    @property
    def row(self) -> int:
        """Its request slot (the row of the req_to_token table) while it is admitted."""
        assert self.req_pool_idx is not None, f"request {self.rid} holds no request slot"
        return self.req_pool_idx

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining_new_tokens(self) -> int:
        return max(0, self.params.max_new_tokens - len(self.output_ids))

    def record_plan(self, drafter: Optional[str], drafts: int) -> None:
        self.spec_plans.append((drafter, drafts))
        self.spec_draft_len_hist[drafts] = self.spec_draft_len_hist.get(drafts, 0) + 1
        if drafter is not None and drafts > 0:
            self.spec_drafter_steps[drafter] = self.spec_drafter_steps.get(drafter, 0) + 1

    def record_verify(self, appended: int, committed: int, cap_trimmed: int) -> int:
        """Count one verify step; returns its correct drafts. Only emitted drafts count as
        accepted: a stop inside the run cuts both the drafts and the bonus."""
        correct = committed - 1
        self.spec_verify_ct += 1
        self.spec_num_correct_drafts += min(appended, correct)
        self.spec_emitted_trace.append(min(appended, correct))
        self.spec_correct_hist[correct] = self.spec_correct_hist.get(correct, 0) + 1
        self.spec_cap_trim_hist[cap_trimmed] = self.spec_cap_trim_hist.get(cap_trimmed, 0) + 1
        return correct
