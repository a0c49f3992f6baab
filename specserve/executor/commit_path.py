"""The one path by which a step's committed tokens reach every party that reads them.

Every step kind (a prefill chunk, a decode step, a verify step) ends by handing its outcome to
`CommitPath.commit`, which tells, in this order:
0. the speculation policy (a verify step): each window's accepted drafts against its plan;
1. the drafters that read the target's hidden rows (DSpark): the rows this pass committed;
2. the FutureMap: each request's next anchor (its last committed token) and lengths, which the
   next step reads on the forward stream;
3. the drafters that read tokens (n-gram): the committed tokens (a prefill: the prompt and its
   first token, from scratch);
4. the request logits: penalty histories and grammar states advance by the committed tokens;
5. the speculation policy: a prefill starts the request's record; the tokens feed its estimates.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch

from specserve.executor.future_map import FutureMap
from specserve.executor.request_logits import RequestLogits
from specserve.executor.step_io import StepInput
from specserve.speculative.accept import AcceptOuts
from specserve.speculative.adaptive import StepPlan
from specserve.speculative.speculation import Speculation
from specserve.speculative.worker import CommittedRows


@dataclass
class Committed:
    """What one step committed for some of its requests (indices into the step)."""

    indices: list[int]
    tokens: list[list[int]]  # per request: its committed tokens (the last is the next anchor)
    seq_lens: torch.Tensor  # per request, on the device: its sequence length after the commit
    out_lens: list[int]  # per request: its output length after the commit
    first: bool = False  # a prefill's first token: the request starts here
    plan: Optional[StepPlan] = None  # a verify step's plan, and below its accepted drafts per window
    correct: list[int] = field(default_factory=list)

    @staticmethod
    def nothing() -> "Committed":
        return Committed([], [], torch.empty(0, dtype=torch.int64), [])

    @staticmethod
    def accepted(out: AcceptOuts, out_lens: torch.Tensor, plan: StepPlan) -> "Committed":
        """A verify step's commit, from its owned accept results: each window's first commit_lens tokens."""
        commit_lens = out.commit_lens.tolist()
        tokens = [toks[:n] for toks, n in zip(out.out_tokens.tolist(), commit_lens)]
        outs = [m + n for m, n in zip(out_lens.tolist(), commit_lens)]
        return Committed(
            list(range(len(tokens))), tokens, out.new_seq_lens, outs, plan=plan, correct=out.correct_len.tolist()
        )


class CommitPath:
    """Fans a step's commit out to the future map, the drafters, the request logits and the policy."""

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

    def commit(self, step: StepInput, done: Committed, rows: Optional[CommittedRows] = None) -> None:
        """Tell every party what this step committed, in the order of the module docstring."""
        policy = self.speculation.policy
        if policy is not None and done.plan is not None:
            policy.observe_accept([step.rows[i] for i in done.indices], done.plan, done.correct)
        if rows is not None and self.speculation.reads_rows:
            self.speculation.commit_rows(rows)
        if not done.indices:
            return
        req_rows = [step.rows[i] for i in done.indices]
        self.future.write(
            torch.tensor(req_rows, dtype=torch.int64, device=self.device),
            torch.tensor([toks[-1] for toks in done.tokens], dtype=torch.int64, device=self.device),
            done.seq_lens,
            torch.tensor(done.out_lens, dtype=torch.int64, device=self.device),
        )
        for i, row, toks, out_len in zip(done.indices, req_rows, done.tokens, done.out_lens):
            if self.speculation.reads_tokens:
                seen = toks
                if done.first:  # the drafters start from the whole sequence
                    fill = step.fills[i]
                    assert fill is not None, "the batch fills in the tokens of every sampling request"
                    seen = fill + toks
                self.speculation.commit_tokens(row, seen, restart=done.first, new=len(toks))
            self.request_logits.commit(row, toks)
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
    """Exactly a verify step's committed rows for the drafters: positions S..S+commit_len-1 of
    each window (hidden: the verified rows, packed window by window).

    Reads the owned `commit_lens` and the step's own `prefix`, never an accept buffer: a view of
    one would hold the next step's values by the time a later step reads it."""
    assert hidden is not None, "a drafter that reads rows makes the target capture them"
    bs, width = window_slots.shape
    col = torch.arange(width, device=window_slots.device).unsqueeze(0)
    committed = col < commit_lens.unsqueeze(1)  # [bs, W]
    lens = verify_lens or [width] * bs
    packed_row = torch.tensor([0, *itertools.accumulate(lens)][:-1], device=window_slots.device).unsqueeze(1) + col
    return CommittedRows(hidden[packed_row[committed]], (prefix.unsqueeze(1) + col)[committed], window_slots[committed])


def tighter(lens: Optional[list[int]], limits: Optional[list[int]]) -> Optional[list[int]]:
    """Per window the smaller of two verify lengths (None: every row of every window)."""
    if limits is None:
        return lens
    return limits if lens is None else [min(a, b) for a, b in zip(lens, limits)]
