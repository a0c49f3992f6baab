"""The speculation seam: what the executor tells a drafter, and what a drafter gives back.

A verify step runs, on the forward stream:
1. drafting, per request: each request names its drafter (or none); every drafter proposes the
   windows of its own requests (`DraftWorker.draft`), and `Speculation` assembles one batch of
   windows `[anchor, d_1..d_g]`;
2. the target's verify forward over all windows and the accept (greedy or rejection sampling),
   once for the whole batch (`speculative/accept.py`);
3. commit: every drafter that reads rows sees the rows whose target K/V were committed
   (`commit_rows`), whatever drafted them, so a request can switch drafter between steps; the
   committed tokens go once into each slot's `RequestTokens` (speculative/committed.py), which
   the drafters that read tokens are handed with each request they hint or draft for. Prefill and
   plain decode steps commit the same way.
A worker holds only state that is not per request (draft K/V pools, SUFFIX's index of past
outputs); its state of one request lives in that request's RequestTokens. It never sees the
scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Protocol, Sequence

import torch

from specserve.kv.pool import KVPool
from specserve.sampling_params import SamplingParams
from specserve.speculative.committed import CommittedRows, RequestTokens, TokenTable


@dataclass
class DraftContext:
    """What a drafter's worker is made from on one engine rank (drafters/declaration.py names the
    function): the flags, the window, the target's token slots and what the builder loaded."""

    args: Any  # ServerArgs (this layer sits below args.py)
    gamma: int  # drafts per window
    size: int  # the target's token slots (a draft K/V pool is indexed by them)
    dtype: torch.dtype
    device: str
    req_to_token: torch.Tensor  # [request slots, context] token slot per position
    token_table: Optional[TokenTable]  # the request tokens on the device, shared by the drafters that read them
    target: Any  # the loaded target (engine/builder.py: model, config, tokenizer, DSpark drafter, ...)
    captures: bool  # the target's decode steps are captured (a draft model's may be too)


@dataclass
class DraftInput:
    """The requests one drafter proposes windows for (a subset of the step's batch)."""

    rows: torch.Tensor  # [n] request slots
    anchors: torch.Tensor  # [n] last committed tokens, the first row of each window
    prefix_lens: torch.Tensor  # [n] tokens with K/V in the cache (the anchor's position)
    out_lens: torch.Tensor  # [n] output tokens so far (the sampling counters)
    params: Sequence[SamplingParams]
    seeds: Sequence[int]
    gamma: int  # drafts per window
    # The most drafts any of these windows verifies (None: gamma): a drafter may compute only the
    # first `needed` and fill the rest, which no verify reads.
    needed: Optional[int] = None
    # Known on the host: every prefix length is below it (the step's K/V bound; None: unknown),
    # so a drafter sizes its context without reading the prefix lengths back.
    ctx_bound: Optional[int] = None
    launch: Optional[int] = None  # the step's launch count (StepInput.launch; None: a tool's draft)
    # Each request's tokens (given to a worker that reads_tokens): views, never copies.
    requests: Sequence[RequestTokens] = ()

    def part(
        self, index: list[int], sel: Optional[torch.Tensor], needed: Optional[int], requests: Sequence[RequestTokens]
    ) -> "DraftInput":
        """The requests `index` of this input (sel: the same indices on the device; None: all)."""
        pick = (lambda t: t) if sel is None else (lambda t: t[sel])
        return replace(
            self,
            rows=pick(self.rows),
            anchors=pick(self.anchors),
            prefix_lens=pick(self.prefix_lens),
            out_lens=pick(self.out_lens),
            params=[self.params[i] for i in index],
            seeds=[self.seeds[i] for i in index],
            needed=needed,
            requests=requests,
        )

    def context_bound(self) -> int:
        """A bound on every prefix length: the host's ctx_bound, else the largest read back (a wait)."""
        return self.ctx_bound if self.ctx_bound is not None else int(self.prefix_lens.max())


@dataclass
class Drafts:
    """A drafter's proposals for its n requests.

    tokens [n, gamma] int64. probs [n, gamma, V]: the distribution each draft was drawn from, which
    rejection sampling needs; None means one-hot on the tokens (a deterministic drafter).
    confidence [n, gamma]: the drafter's estimate that slot k survives given slots < k did; None
    when the drafter has no estimate (the compact-verify planner then verifies the whole window).
    """

    tokens: torch.Tensor
    probs: Optional[torch.Tensor] = None
    confidence: Optional[torch.Tensor] = None


class DraftWorker(Protocol):
    """One drafting algorithm's worker (its declaration: specserve/drafters/); WorkerDefaults gives the
    parts a simple drafter does not need. Its attributes are read-only
    here (properties), so a class attribute or a property of a narrower type (`Algorithm`) implements them."""

    @property
    def name(self) -> str: ...

    @property
    def capture_layer_ids(self) -> tuple[int, ...]:
        """Target layers whose outputs commit_rows carries (empty: no rows)."""

    @property
    def reads_tokens(self) -> bool:
        """Drafts or hints from the requests' committed tokens (RequestTokens, in DraftInput.requests
        and `hints`): the speculation keeps them only while some drafter reads them."""

    # Must have step N's tokens before step N+1 is launched: drafts from host state, so the launch
    # waits for the device (runtime/host_waits.py counts it). A plain attribute, read every step.
    tokens_early: bool

    @property
    def kv_pools(self) -> list[KVPool]:
        """K/V pools indexed by the target's token slots (shared by the prefix cache)."""

    def draft(self, inp: DraftInput) -> Drafts: ...

    def commit_rows(self, rows: CommittedRows) -> None: ...

    # Whether `advance` must run as each step begins: a plain attribute (the step reads it without
    # entering the worker), which a worker may change as its state does.
    advances: bool

    def advance(self, launch: Optional[int]) -> None:
        """Forward stream, every planned step where `advances`, before the plan (`launch`: the
        step's launch count)."""

    def hints(self, requests: Sequence[RequestTokens], greedy: Optional[list[bool]] = None) -> list[tuple[int, int]]:
        """Per request (rate bucket, most useful drafts), for the adaptive policy: asked only of a
        drafter whose declaration has hints (drafters/declaration.py); greedy[i]: request i decodes
        greedily (None: all do)."""

    def commit_tokens(self, request: RequestTokens, tokens: list[int]) -> None:
        """`request` committed `tokens` (already appended to request.tokens): asked only of a worker
        that overrides WorkerDefaults' (one whose state must follow every commit)."""

    def retire(self, row: int, done: RequestTokens, launch: int) -> None:
        """Slot `row`'s request `done` was replaced by the next one, whose prefill committed at
        `launch` (asked only of a worker that overrides WorkerDefaults')."""

    def flush(self) -> None:
        """Apply any committed state the worker deferred (see DsparkWorker)."""


class WorkerDefaults:
    """What a drafter does where it needs nothing more (a base for workers): no target rows, no
    tokens, no K/V of its own, nothing deferred, no hints, nothing to do as a step begins."""

    advances = False
    tokens_early = False

    @property
    def reads_tokens(self) -> bool:
        return False

    @property
    def capture_layer_ids(self) -> tuple[int, ...]:
        return ()

    @property
    def kv_pools(self) -> list[KVPool]:
        return []

    def advance(self, launch: Optional[int]) -> None:
        """Forward stream, every planned step (before the plan)."""

    def hints(self, requests: Sequence[RequestTokens], greedy: Optional[list[bool]] = None) -> list[tuple[int, int]]:
        """Per request (rate bucket, most useful drafts): asked where the declaration has hints."""
        raise NotImplementedError(f"{type(self).__name__} declares no hints")

    def commit_rows(self, rows: CommittedRows) -> None:
        """Target rows committed (asked only of a worker with capture_layer_ids)."""

    def commit_tokens(self, request: RequestTokens, tokens: list[int]) -> None:
        """Tokens committed: nothing to follow (a worker that overrides this is told every commit)."""

    def retire(self, row: int, done: RequestTokens, launch: int) -> None:
        """A slot's request replaced: nothing kept past a request."""

    def flush(self) -> None:
        """Apply deferred state (nothing deferred)."""
