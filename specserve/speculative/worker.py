"""The speculation seam: what the executor tells a drafter, and what a drafter gives back.

A verify step runs, on the forward stream:
1. drafting, per request: each request names its drafter (or none); every drafter proposes the
   windows of its own requests (`DraftWorker.draft`), and `Speculation` assembles one batch of
   windows `[anchor, d_1..d_g]`;
2. the target's verify forward over all windows and the accept (greedy or rejection sampling),
   once for the whole batch (`speculative/accept.py`);
3. commit: every drafter sees the rows whose target K/V were committed (`commit_rows`) and the
   tokens each request committed (`commit_tokens`), whatever drafted them, so a request can
   switch drafter between steps. Prefill and plain decode steps commit the same way.
A worker holds only its own state (draft K/V, token histories); it never sees the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

import torch

from specserve.kv.pool import KVPool
from specserve.sampling_params import SamplingParams
from specserve.speculative.token_table import TokenTable


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


@dataclass
class CommittedRows:
    """Target rows whose K/V this step committed: their captured hidden states (at the layers
    the drafters asked for), absolute positions and token slots."""

    hidden: torch.Tensor  # [N, len(capture_layer_ids) * H]
    positions: torch.Tensor  # [N]
    slots: torch.Tensor  # [N]


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
        """Wants commit_tokens."""

    @property
    def tokens_early(self) -> bool:
        """Must have step N's tokens (commit_tokens) before step N+1 is launched: drafts from host
        state, so the launch waits for the device (runtime/host_waits.py counts it)."""

    @property
    def kv_pools(self) -> list[KVPool]:
        """K/V pools indexed by the target's token slots (shared by the prefix cache)."""

    def draft(self, inp: DraftInput) -> Drafts: ...

    def commit_rows(self, rows: CommittedRows) -> None: ...

    def advance(self, launch: Optional[int]) -> None:
        """Forward stream, every planned step, before the plan (`launch`: the step's launch count)."""

    def hints(self, rows: list[int], greedy: Optional[list[bool]] = None) -> list[tuple[int, int]]:
        """Per request (rate bucket, most useful drafts), for the adaptive policy: asked only of a
        drafter whose declaration has hints (drafters/declaration.py); greedy[i]: request i decodes
        greedily (None: all do)."""

    def commit_tokens(self, row: int, tokens: list[int], restart: bool, new: int = 0, launch: int = 0) -> None:
        """Request slot `row` committed `tokens`; `restart`: they are its whole sequence so far, of
        which the last `new` were generated (the rest: its prompt); `launch`: the committing step's
        launch count (StepInput.launch)."""

    def flush(self) -> None:
        """Apply any committed state the worker deferred (see DsparkWorker)."""


class WorkerDefaults:
    """What a drafter does where it needs nothing more (a base for workers): no target rows, no
    tokens, no K/V of its own, nothing deferred, no hints, nothing to do as a step begins."""

    @property
    def reads_tokens(self) -> bool:
        return False

    @property
    def tokens_early(self) -> bool:
        return False

    @property
    def capture_layer_ids(self) -> tuple[int, ...]:
        return ()

    @property
    def kv_pools(self) -> list[KVPool]:
        return []

    def advance(self, launch: Optional[int]) -> None:
        """Forward stream, every planned step (before the plan)."""

    def hints(self, rows: list[int], greedy: Optional[list[bool]] = None) -> list[tuple[int, int]]:
        """Per request (rate bucket, most useful drafts): asked where the declaration has hints."""
        raise NotImplementedError(f"{type(self).__name__} declares no hints")

    def commit_rows(self, rows: CommittedRows) -> None:
        """Target rows committed (asked only of a worker with capture_layer_ids)."""

    def commit_tokens(self, row: int, tokens: list[int], restart: bool, new: int = 0, launch: int = 0) -> None:
        """Tokens committed (asked only of a worker that reads_tokens)."""

    def flush(self) -> None:
        """Apply deferred state (nothing deferred)."""
