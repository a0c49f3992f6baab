"""The request and the batch: what one request is, where each request is, what one step runs,
and the rules about one request (when it stops, whether it can ever run).

- Req, FinishReason: one generation request as the scheduler sees it, its tokens, its KV slots
  and where it stands. KV bookkeeping (stated on Req): `kv_slots[i]` holds the KV of
  `fill_ids[i]` for i < kv_len; the first `cache_protected_len` slots belong to the radix tree,
  the rest to the request until it finishes or is retracted. Two requests are never "equal".
- ScheduleBatch: what one step runs, in plain Python lists, and the StepInput made from it (values
  only: the executor never sees a scheduler object).
- RequestQueues: where each request of the scheduler is: waiting, the one mid-prefill, running,
  and the launched batches whose results are not processed yet (`in_flight`, the only record of them).
- check_finish: when a request stops: EOS, a stop token id, a stop string, or its token budget.
- validate_request: whether a request can ever run: it has tokens, fits the context window and
  the KV pool (what depends on the scheduler's own state; its params were validated where it came in).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from specserve.errors import InvalidRequestError
from specserve.executor.step_io import EXTEND, VERIFY, StepInput
from specserve.logits.logprobs import TokenLogprob
from specserve.names import StepMode
from specserve.sampling_params import SamplingParams

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


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


# ------------------------------------------------------------ what one step runs


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


# ------------------------------------------------------------ where each request is


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


# ------------------------------------------------------------ the rules about one request


def check_finish(
    req: Req, eos_token_ids: Sequence[int], decode_text: Optional[Callable[[list[int]], str]]
) -> Optional[FinishReason]:
    """The reason req stops after its last output token (recording what matched), or None."""
    token, params = req.output_ids[-1], req.params
    if not params.ignore_eos and token in eos_token_ids:
        req.matched_stop = token
        return FinishReason.STOP
    if token in params.stop_token_ids:
        req.matched_stop = token
        return FinishReason.STOP
    if params.stop and decode_text is not None:
        # Only the tail can hold a new match: a few tokens per character of the longest stop string.
        longest = max(len(s) for s in params.stop)
        tail = decode_text(req.output_ids[-(4 * longest + 4) :])
        for s in params.stop:
            if s in tail:
                req.matched_stop = s
                return FinishReason.STOP
    if len(req.output_ids) >= params.max_new_tokens:
        return FinishReason.LENGTH
    return None


def validate_request(req: Req, context_length: int, window: int, pool_size: int) -> None:
    """Raise InvalidRequestError (param "prompt") for a request no schedule could serve."""
    n = len(req.input_ids)
    if n == 0:
        raise InvalidRequestError("prompt: must contain at least one token", param="prompt")
    if n >= context_length:
        raise InvalidRequestError(
            f"prompt: {n} tokens do not fit the context window of {context_length} (need prompt_tokens < context_length)",
            param="prompt",
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    # A verify window needs window - 1 slots past the last token it keeps.
    need = n + min(req.params.max_new_tokens, context_length - n) + window - 1
    if need > pool_size:
        raise InvalidRequestError(
            f"prompt: {n} tokens + max_new_tokens need {need} KV slots but the pool holds "
            f"{pool_size} (raise max_total_tokens or lower max_new_tokens)",
            param="prompt",
            code=CONTEXT_LENGTH_EXCEEDED,
        )
