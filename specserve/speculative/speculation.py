"""Speculation: the drafters of one engine behind one object, as the executor sees them.

Drafting is per request (each request of a verify step names its drafter, or none); verify and
accept run once per step over all windows. See speculative/worker.py for the protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional, Sequence, TypeVar

import torch

from specserve.drafters import Hints
from specserve.errors import InternalError
from specserve.kv.pool import KVPool
from specserve.runtime.stream import staged
from specserve.speculative.committed import CommittedRows, RequestTokens, TokenTable
from specserve.speculative.lagged import LAG, LaggedFeed
from specserve.speculative.planner import VerifyPlanner
from specserve.speculative.policy import AdaptivePolicy, StepPlan
from specserve.speculative.worker import DraftInput, DraftWorker, WorkerDefaults

T = TypeVar("T")


@dataclass
class Proposal:
    """The drafts of one verify step (written into the window ids) and how much of each window to
    verify. `probs` holds (rows, q) of drafters that sampled; rows None means every row."""

    verify_lens: Optional[list[int]] = None  # compact verify: rows per window; None: every row
    probs: list[tuple[Optional[torch.Tensor], torch.Tensor]] = field(default_factory=list)

    def draft_probs(self, ids: torch.Tensor, vocab: int) -> torch.Tensor:
        """[bs, gamma, V] q for rejection sampling: one-hot on each draft unless its drafter gave q."""
        if len(self.probs) == 1 and self.probs[0][0] is None:
            return self.probs[0][1]
        q = torch.nn.functional.one_hot(ids[:, 1:], vocab).float()
        for rows, probs in self.probs:
            if rows is None:
                q.copy_(probs)
            else:
                q[rows] = probs.to(q.dtype)
        return q


class Speculation:
    """Named draft workers and what decides each request's window: the adaptive policy, or (turned
    off) each request's own drafter with every draft, verified whole or by the compact planner."""

    def __init__(
        self,
        workers: Sequence[DraftWorker] = (),
        planner: Optional[VerifyPlanner] = None,
        policy: Optional[AdaptivePolicy] = None,
        disable_batch_size: Optional[int] = None,
        lagged_plans: bool = False,
    ):
        """lagged_plans (opt-in, meant for CUDA): the policy plans launch k from the commits of
        launches up to k - 2 (see `lagged`)."""
        self.workers = {w.name: w for w in workers}
        self.planner = planner
        self.policy = policy
        self.disable_batch_size = disable_batch_size  # --speculative-disable-batch-size: larger steps never draft
        if policy is not None and set(policy.drafters) - set(self.workers):
            raise InternalError(
                f"speculation: the policy's drafters {policy.drafters} are not all in this engine "
                f"(have {sorted(self.workers)})"
            )
        readers = [w for w in workers if w.capture_layer_ids]
        if len(readers) > 1:
            raise InternalError(
                f"speculation: at most one drafter may read the target's hidden states, got {[w.name for w in readers]}"
            )
        self.capture_layer_ids: tuple[int, ...] = readers[0].capture_layer_ids if readers else ()
        self._row_readers = readers
        # Whether any drafter reads committed target rows / tokens: the executor skips gathering them otherwise.
        self.reads_rows = bool(readers)
        self.reads_tokens = any(w.reads_tokens for w in workers)
        # Each request slot's committed tokens and the drafters' state of its request (while some drafter reads them).
        self.requests: dict[int, RequestTokens] = {}
        # The workers told of every commit, and of a slot's request being replaced (the rest keep WorkerDefaults' no-ops).
        self._following = [w for w in workers if _overrides(w, "commit_tokens")]
        self._retiring = [w for w in workers if _overrides(w, "retire")]
        self.lagged_plans = lagged_plans
        self.news: LaggedFeed[Callable[[], None]] = LaggedFeed("speculation policy")  # see `lagged`
        self._started: dict[int, int] = {}  # request slot -> the launch of its latest request's prefill

    @property
    def lagged(self) -> bool:
        """The policy and its hints learn each commit two launches later (speculative/lagged.py), so
        a plan never waits for the last step's results and both loops plan alike; a request's first
        step after its prefill then plans no drafts (nothing of it is known yet). Only where every
        drafter drafts from device state (a host-fed drafter needs the tokens at once anyway)."""
        return self.lagged_plans and self.policy is not None and not self.tokens_early

    @property
    def tokens_early(self) -> bool:
        """Some drafter drafts from host state (see DraftWorker.tokens_early; SUFFIX's may change)."""
        return any(w.tokens_early for w in self.workers.values())

    @property
    def token_table(self) -> Optional[TokenTable]:
        """Request tokens on the device, written by CommitPath (the drafters share one: NGRAM's, SUFFIX's)."""
        return next((t for w in self.workers.values() if (t := getattr(w, "token_table", None)) is not None), None)

    def worker(self, name: str) -> Optional[DraftWorker]:
        return self.workers.get(name)

    @property
    def kv_pools(self) -> list[KVPool]:
        return [pool for w in self.workers.values() for pool in w.kv_pools]

    # ------------------------------------------------------------ planning and drafting

    def plan(
        self,
        drafters: Sequence[Optional[str]],
        rows: list[int],
        gamma: int,
        refills: bool = True,
        greedy: Optional[list[bool]] = None,
        launch: Optional[int] = None,
    ) -> StepPlan:
        """Each request's drafter and draft count for this step, before any drafter runs: the one
        decision to speculate. A step of more than `disable_batch_size` requests has no drafts (its
        rows already fill the compute verify windows would need): it runs as a plain decode step.
        refills: a slot freed early lets a request in (see AdaptivePolicy.plan); greedy[i]: request
        i decodes greedily (SUFFIX drafts a sampled one from its own tokens only); launch: this
        step's launch count (with `lagged`, the commits it sees)."""
        known = [True] * len(rows)
        if self.lagged and launch is not None:  # before any early return: the news never piles up
            for tell in self.news.due(launch):
                tell()
            known = [self._started.get(row, 0) <= launch - LAG for row in rows]
        for worker in self.workers.values():
            if worker.advances:  # a plain attribute: a worker with nothing to do is not entered
                worker.advance(launch)
        if self.disable_batch_size is not None and len(rows) > self.disable_batch_size:
            return StepPlan.fixed([None] * len(rows), gamma)
        if self.policy is None:
            return StepPlan.fixed(drafters, gamma)
        speculating = [d is not None and k for d, k in zip(drafters, known)]
        return self.policy.plan(rows, speculating, self._hints(rows, speculating, known, greedy, refills), refills)

    def _hints(
        self, rows: list[int], speculating: list[bool], known: list[bool], greedy: Optional[list[bool]], refills: bool
    ) -> dict[str, list[tuple[int, int]]]:
        """The hints of the policy's drafters that have any (drafters/declaration.py `Hints`): the
        cheap ones every step, then an on-demand one where the plan may depend on it."""
        assert self.policy is not None
        hints: dict[str, list[tuple[int, int]]] = {}
        for kind in (Hints.EVERY_STEP, Hints.ON_DEMAND):
            for name in self.policy.drafters:
                if self.policy.declarations[name].hints is not kind:
                    continue
                if kind is Hints.ON_DEMAND and not self.policy.needs_hints(name, rows, speculating, hints, refills):
                    continue
                look = partial(self._hints_of, self.workers[name], greedy=_kept(known, greedy))
                hints[name] = _where_known(known, rows, look, (0, 0))
        return hints

    def _hints_of(self, worker: DraftWorker, rows: list[int], greedy: Optional[list[bool]]) -> list[tuple[int, int]]:
        return worker.hints([self.requests[row] for row in rows], greedy)

    def starting(self, rows: Sequence[int], launch: int) -> None:
        """Forward stream: these slots' new requests' prefills are launch `launch`."""
        for row in rows:
            self._started[row] = launch

    def start(self, row: int) -> None:
        """A new request's prefill finished in this request slot."""
        if self.policy is not None:
            self.policy.start(row)

    def propose(
        self, plan: StepPlan, step: DraftInput, host_rows: Sequence[int], ids: torch.Tensor, compact: bool
    ) -> Proposal:
        """Fill ids[:, 1:] (ids[:, 0] holds the anchors) as `plan` says: each request's drafter
        proposes its window from its part of `step` (the whole step's draft input; a drafter is told
        the most drafts any of its windows verifies); a request without a drafter repeats its anchor
        (the verify still yields its bonus token). host_rows: the request slots (step.rows on the
        host); compact: the planner may shorten windows (False: it would read the confidences back
        for nothing, the windows being verified whole, see CaptureConfig.static_windows)."""
        bs, gamma = ids.shape[0], ids.shape[1] - 1
        proposal, confidence = Proposal(), None
        for name, index in _groups(plan.drafters, bs).items():
            sel = None if len(index) == bs else staged(index, torch.int64, ids.device)
            target = slice(None) if sel is None else sel
            if name is None:
                ids[target, 1:] = ids[target, :1].expand(-1, gamma)
                continue
            worker = self.workers.get(name)
            if worker is None:
                raise InternalError(f"speculation: no drafter {name!r} in this engine (have {sorted(self.workers)})")
            requests = [self.requests[host_rows[i]] for i in index] if worker.reads_tokens else ()
            needed = None if plan.drafts is None else max(1, max(plan.drafts[i] for i in index))
            drafts = worker.draft(step.part(index, sel, needed, requests))
            ids[target, 1:] = drafts.tokens
            if drafts.probs is not None:
                proposal.probs.append((sel, drafts.probs))
            if drafts.confidence is not None:
                confidence = torch.ones(bs, gamma, device=ids.device) if confidence is None else confidence
                confidence[target] = drafts.confidence.float()
        if self.planner is not None and confidence is not None and compact:
            proposal.verify_lens = self.planner.verify_lens(confidence)
        return proposal

    # ------------------------------------------------------------ commit

    def commit_rows(self, rows: CommittedRows) -> None:
        """Every drafter that reads rows sees every committed row, whoever drafted the request:
        a request may switch drafter between steps."""
        for worker in self._row_readers:
            worker.commit_rows(rows)

    def flush(self) -> None:
        for worker in self.workers.values():
            worker.flush()

    def commit_tokens(self, row: int, tokens: list[int], restart: bool = False, new: int = 0, launch: int = 0) -> None:
        """Slot `row` committed `tokens`: appended to its RequestTokens, which the drafters read when
        they next hint or draft. `restart`: a new request in the slot, `tokens` its whole sequence so
        far, of which the last `new` were generated (the rest: its prompt), committed by launch
        `launch` (the replaced request is retired: SUFFIX keeps its output)."""
        if restart:
            done = self.requests.get(row)
            self.requests[row] = RequestTokens(list(tokens), len(tokens) - new)
            if done is not None:
                for worker in self._retiring:
                    worker.retire(row, done, launch)
            return
        request = self.requests[row]
        request.tokens.extend(tokens)
        for worker in self._following:
            worker.commit_tokens(request, tokens)


def _overrides(worker: DraftWorker, method: str) -> bool:
    return getattr(type(worker), method, None) is not getattr(WorkerDefaults, method)


def _kept(known: list[bool], values: Optional[list[bool]]) -> Optional[list[bool]]:
    return None if values is None else [v for v, k in zip(values, known) if k]


def _where_known(known: list[bool], rows: list[int], look: Callable[[list[int]], list[T]], unknown: T) -> list[T]:
    """look(rows) for the rows whose requests are known, `unknown` for the others, in rows' order."""
    if all(known):
        return look(rows)
    found = iter(look([row for row, k in zip(rows, known) if k]))
    return [next(found) if k else unknown for k in known]


def _groups(drafters: Sequence[Optional[str]], bs: int) -> dict[Optional[str], list[int]]:
    """Request indices by drafter name, in order of first appearance."""
    names = list(drafters) if drafters else [None] * bs
    out: dict[Optional[str], list[int]] = {}
    for i, name in enumerate(names):
        out.setdefault(name, []).append(i)
    return out
