"""The one path by which a step's committed tokens reach every party that reads them.

Every step kind (a prefill chunk, a decode step, a verify step) ends by handing its outcome to
`CommitPath.commit`, which tells, in this order (the device parties 1-2 at once, the host parties
0 and 3-5 at once or late, see CommitPath):
0. the speculation policy (a verify step): each window's accepted drafts against its plan;
1. the drafters that read the target's hidden rows (DSpark): the rows this pass committed;
2. the FutureMap: each request's next anchor (its last committed token) and lengths, which the
   next step reads on the forward stream;
3. the drafters that read tokens (n-gram): the committed tokens (a prefill: the prompt and its
   first token, from scratch);
4. the request logits: penalty counts (on the device, at once) and grammar states (on the host)
   advance by the committed tokens;
5. the speculation policy: a prefill starts the request's record; the tokens feed its estimates.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from specserve.executor.request_logits import RequestLogits
from specserve.executor.step_io import FutureMap, StepInput
from specserve.runtime.stream import staged
from specserve.speculative.accept import AcceptOuts
from specserve.speculative.committed import CommittedRows
from specserve.speculative.policy import StepPlan
from specserve.speculative.speculation import Speculation


@dataclass
class Committed:
    """What one step committed for some of its requests (indices into the step), on the device:
    nothing here has been read back, so the step's launch never waits for it."""

    indices: list[int]
    tokens: torch.Tensor  # [n, W]: per request its committed tokens, the first `lens` of its row
    lens: torch.Tensor  # [n]: tokens committed per request (>= 1; the last is the next anchor)
    seq_lens: torch.Tensor  # [n]: sequence length after the commit
    out_lens: torch.Tensor  # [n]: output length after the commit
    first: bool = False  # a prefill's first token: the request starts here
    plan: Optional[StepPlan] = None  # a verify step's plan, and below its accepted drafts per window
    correct: Optional[torch.Tensor] = None

    @staticmethod
    def nothing() -> "Committed":
        empty = torch.empty(0, dtype=torch.int64)
        return Committed([], empty.view(0, 1), empty, empty, empty)

    @staticmethod
    def one_each(
        indices: list[int], tokens: torch.Tensor, seq_lens: torch.Tensor, out_lens: torch.Tensor, first: bool = False
    ) -> "Committed":
        """One token per request (a decode step, a prefill's first token)."""
        return Committed(indices, tokens.view(-1, 1), torch.ones_like(tokens), seq_lens, out_lens, first)

    @staticmethod
    def accepted(out: AcceptOuts, out_lens: torch.Tensor, plan: StepPlan) -> "Committed":
        """A verify step's commit, from its owned accept results: each window's first commit_lens tokens."""
        indices, lens = list(range(out.commit_lens.shape[0])), out.commit_lens
        correct = out.correct_len
        return Committed(indices, out.out_tokens, lens, out.new_seq_lens, out_lens + lens, plan=plan, correct=correct)

    def anchors(self) -> torch.Tensor:
        """Each request's last committed token, the next step's anchor (a gather, no read)."""
        return self.tokens.gather(1, (self.lens - 1).unsqueeze(1)).squeeze(1)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Committed":
        """The same commit with what the host parties read through `fn` (the step's late copy):
        tokens, lens, output lengths and accepted drafts (see `HostCommit.of`)."""
        correct = fn(self.correct) if self.correct is not None else None
        return replace(self, tokens=fn(self.tokens), lens=fn(self.lens), out_lens=fn(self.out_lens), correct=correct)


@dataclass
class HostCommit:
    """A commit as the host parties read it: plain values."""

    indices: list[int]
    tokens: list[list[int]]
    out_lens: list[int]
    first: bool
    plan: Optional[StepPlan]
    correct: list[int]

    @staticmethod
    def of(done: Committed) -> "HostCommit":
        """From a commit's host copies (Committed.map), or from the device's (reading them is a wait)."""
        correct_t = done.correct if done.correct is not None else done.lens
        rows, lens, outs, correct = (v.tolist() for v in (done.tokens, done.lens, done.out_lens, correct_t))
        tokens = [row[:n] for row, n in zip(rows, lens)]
        return HostCommit(done.indices, tokens, outs, done.first, done.plan, correct)


class CommitPath:
    """Fans a step's commit out to the future map, the drafters, the request logits and the policy.

    The device parties (the FutureMap, the drafters that read hidden rows, the token table, the
    penalty counts) are told at once, on the forward stream. The host parties read plain tokens, so
    telling them means reading the step's results back: `commit` does that at once only when one of
    them must know the tokens before the next step is launched (`host_needs_now`); otherwise it
    leaves them to `commit_host`, which the runner calls with the step's late host copies once the
    step has been resolved."""

    def __init__(self, future: FutureMap, speculation: Speculation, request_logits: RequestLogits, device: str):
        self.future = future
        self.speculation = speculation
        self.request_logits = request_logits
        self.device = device

    def rows(self, hidden: Optional[torch.Tensor], positions: torch.Tensor, slots: torch.Tensor) -> Optional[CommittedRows]:
        """A pass's computed rows for the drafters that read them (None when none does)."""
        if not self.speculation.reads_rows or hidden is None:
            return None
        return CommittedRows(hidden, positions, slots)

    def commit(self, step: StepInput, done: Committed, rows: Optional[CommittedRows] = None) -> bool:
        """Tell the device parties now, and the host parties now if one must know before the next
        launch (in the order of the module docstring). Returns whether the host parties still wait
        for `commit_host`."""
        if rows is not None and self.speculation.reads_rows:
            self.speculation.commit_rows(rows)
        if done.indices:
            req_rows = staged([step.rows[i] for i in done.indices], torch.int64, self.device)
            self.future.write(req_rows, done.anchors(), done.seq_lens, done.out_lens)
            self._write_token_table(step, done, req_rows)
            if self.request_logits.counts_tokens:  # penalty counts, on the device
                self.request_logits.commit_counts([step.rows[i] for i in done.indices], done.tokens, done.lens)
        if not self.host_needs_now(step):
            return bool(done.indices) or done.plan is not None
        self.commit_host(step, HostCommit.of(done))
        return False

    def _write_token_table(self, step: StepInput, done: Committed, req_rows: torch.Tensor) -> None:
        """The request tokens on the device (speculative/committed.py): a prefill's whole sequence
        from the host, then every committed token at its position."""
        table = self.speculation.token_table
        if table is None:
            return
        for i in done.indices if done.first else ():
            fill = step.fills[i]
            assert fill is not None, "the batch fills in the tokens of every sampling request"
            table.write_sequence(step.rows[i], fill)
        table.write(req_rows, done.tokens, done.lens, done.seq_lens)

    def host_needs_now(self, step: StepInput) -> bool:
        """Whether a host party must see this step's tokens before the next step is launched: a
        drafter drafting from host state, a request's grammar advancing on the host, or the
        speculation policy (its next plan must see this step in either loop: sampled tokens
        depend on the drafts, and the loops must agree on them)."""
        if self.speculation.tokens_early or (self.speculation.policy is not None and not self.speculation.lagged):
            return True
        return any(p.constrained for p in step.params)

    def commit_host(self, step: StepInput, done: HostCommit) -> None:
        """The host parties: the request logits' grammars now; the policy and the token-reading
        drafters now, or two launches later when the speculation is `lagged`."""
        for i, toks in zip(done.indices, done.tokens):
            self.request_logits.commit(step.rows[i], toks)
        if self.speculation.lagged:
            self.speculation.news.put(step.launch, functools.partial(self._speculation_parties, step, done))
        else:
            self._speculation_parties(step, done)

    def _speculation_parties(self, step: StepInput, done: HostCommit) -> None:
        policy = self.speculation.policy
        if policy is not None and done.plan is not None:
            policy.observe_accept([step.rows[i] for i in done.indices], done.plan, done.correct)
        req_rows = [step.rows[i] for i in done.indices]
        for i, row, toks, out_len in zip(done.indices, req_rows, done.tokens, done.out_lens):
            if self.speculation.reads_tokens:
                seen = toks
                if done.first:  # the drafters start from the whole sequence
                    fill = step.fills[i]
                    assert fill is not None, "the batch fills in the tokens of every sampling request"
                    seen = fill + toks
                self.speculation.commit_tokens(row, seen, done.first, len(toks), step.launch)
            if done.first:
                self.speculation.start(row)
            if policy is not None:
                policy.observe_tokens(row, toks, step.params[i], out_len)


def verified_rows(
    hidden: Optional[torch.Tensor],
    commit_lens: torch.Tensor,
    prefix: torch.Tensor,
    window_slots: torch.Tensor,
    verify_lens: Optional[list[int]],
) -> CommittedRows:
    """A verify step's rows for the drafters, every window row in a fixed shape [bs * W]: the
    committed ones (positions S..S+commit_len-1 of each window) at their token slots, the others
    at the scratch slot 0 (as a captured step's padding rows), so no count is read back to pick
    them out (hidden: the verified rows, packed window by window).

    Reads the owned `commit_lens` and the step's own `prefix`, never an accept buffer: a view of
    one would hold the next step's values by the time a later step reads it."""
    assert hidden is not None, "a drafter that reads rows makes the target capture them"
    bs, width = window_slots.shape
    col = torch.arange(width, device=window_slots.device).unsqueeze(0)
    committed = col < commit_lens.unsqueeze(1)  # [bs, W]
    lens = verify_lens or [width] * bs
    packed_row = staged([0, *itertools.accumulate(lens)][:-1], torch.int64, window_slots.device).unsqueeze(1) + col
    packed_row = packed_row.clamp(max=hidden.shape[0] - 1)  # past a short window: not committed, any row
    slots = torch.where(committed, window_slots, torch.zeros_like(window_slots))
    return CommittedRows(hidden[packed_row.reshape(-1)], (prefix.unsqueeze(1) + col).reshape(-1), slots.reshape(-1))


def tighter(lens: Optional[list[int]], limits: Optional[list[int]]) -> Optional[list[int]]:
    """Per window the smaller of two verify lengths (None: every row of every window)."""
    if limits is None:
        return lens
    return limits if lens is None else [min(a, b) for a, b in zip(lens, limits)]
