"""What the scheduler hands the executor for one step, and what it gets back: plain values only.

`StepInput` is a snapshot: the executor's forward stream never reads scheduler objects, which the
host keeps changing while an (overlapped) step runs. Decode and verify steps take their anchors
and prefix lengths from the executor's FutureMap, not from here, so that step N+1 can be launched
before step N's results reached the host.

FutureMap: what the last launched step left for the next one, indexed by request slot. With the
overlap loop the scheduler launches step N+1 before it has processed step N's results, so step N+1
cannot take its anchors and sequence lengths from the host. Every decode or verify step reads them
there, on the forward stream, and writes its own results back by value (never by keeping a view of
a persistent buffer). Both loops use it, so they compute the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from specserve.logits.logprobs import TokenLogprob
from specserve.names import StepMode
from specserve.sampling_params import SamplingParams

EXTEND, DECODE, VERIFY = StepMode.EXTEND, StepMode.DECODE, StepMode.VERIFY


@dataclass
class StepInput:
    """One batch: per request its slot in the request-to-token table, sampling settings and, for
    a verify step, which drafter proposes its window (None: no drafts, the window repeats the anchor)."""

    mode: StepMode  # EXTEND (prefill or a prefill chunk, after any cached prefix), DECODE or VERIFY
    rids: list[str]
    rows: list[int]  # request slots (req_to_token rows)
    params: list[SamplingParams]
    seeds: list[int]
    sample: list[bool]  # a next token is sampled (False for a non-final prefill chunk)
    width: int = 1  # window rows per request: 1 for decode, gamma + 1 for verify, 0 for extend
    drafters: list[Optional[str]] = field(default_factory=list)  # verify: drafter name per request
    # extend only (decode and verify read prefix lengths from the FutureMap):
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)  # flat new tokens
    out_cache_loc: list[int] = field(default_factory=list)  # flat token slots for their K/V
    out_lens: list[int] = field(default_factory=list)  # output tokens so far (sampling counters)
    fills: list[Optional[list[int]]] = field(default_factory=list)  # every token of a sampling request
    prompt_logprobs: list[bool] = field(default_factory=list)  # extend: logprobs of this chunk's prompt tokens
    kv_bound: int = 0  # decode/verify: K/V slots the longest request holds (>= its prefix + window)
    refills: bool = True  # decode/verify: a slot freed early lets a request in (waiting, or not a closed batch)
    launch: int = 0  # the runner's launch count, set by ModelRunner.launch (DeviceSegments orders by it)

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens) if self.mode == EXTEND else self.size * self.width


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens at positions start, start + 1, ... (a prefill chunk's)."""

    start: int
    logprobs: list[TokenLogprob]


@dataclass
class VerifyStats:
    """What a verify step planned for one request's window, and the matches its verify length cut off."""

    drafter: Optional[str] = None  # who drafted the window (None: no drafts, one row verified)
    drafts: int = 0  # drafts verified (k)
    predicted: float = 0.0  # the policy's expected accept length (0.0 without the policy)
    cap_trimmed: int = 0


@dataclass
class StepOutcome:
    """One request's result of any step (prefill chunk, decode, verify; greedy or sampled; either
    loop): the one shape the scheduler consumes.

    tokens: what the request emits, in order (a verify window's accepted drafts then its bonus;
    one token for a decode step or a prompt's last prefill chunk; none for an earlier chunk);
    logprobs: one per token, if the request asked; prompt_logprobs: this chunk's prompt tokens',
    if asked; verify: the window's statistics (a speculating engine's decode step only)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: Optional[list[TokenLogprob]] = None
    prompt_logprobs: Optional[PromptLogprobs] = None
    verify: Optional[VerifyStats] = None


class FutureMap:
    """Per request slot: the next anchor token, the committed length and the output length."""

    def __init__(self, max_reqs: int, device: str | torch.device = "cpu"):
        i64: dict[str, Any] = dict(dtype=torch.int64, device=device)
        self.tokens = torch.zeros(max_reqs, **i64)  # the last committed token: the next anchor
        self.seq_lens = torch.zeros(max_reqs, **i64)  # tokens whose KV is in the cache
        self.out_lens = torch.zeros(max_reqs, **i64)  # output tokens so far (sampling counters)

    def read(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Owned copies (advanced indexing copies) of anchors, prefix lengths and output lengths."""
        return self.tokens[rows], self.seq_lens[rows], self.out_lens[rows]

    def write(self, rows: torch.Tensor, tokens: torch.Tensor, seq_lens: torch.Tensor, out_lens: torch.Tensor) -> None:
        """Store values (index_copy_ copies; nothing here aliases the caller's tensors)."""
        self.tokens.index_copy_(0, rows, tokens.long())
        self.seq_lens.index_copy_(0, rows, seq_lens.long())
        self.out_lens.index_copy_(0, rows, out_lens.long())
