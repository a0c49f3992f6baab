"""Tensor parallelism inside a step: the decisions every rank must take identically.

Floating-point noise or timing could make ranks sample different tokens, draft differently or
accept differently; so rank 0's values are broadcast (the accept results through the verify
epilogue's `agree`, inside its one accept call), on the forward stream, out of one
persistent contiguous buffer (cloned out before the next broadcast reuses it). Before a step's
forward the ranks also agree on the batch's shape: divergent ranks would otherwise reach the
model's collectives with different shapes, which gloo answers by aborting the process.
"""

from __future__ import annotations

from typing import Optional

import torch

from specserve.distributed.consensus import RankConsensusChecker
from specserve.distributed.group import TPGroup
from specserve.speculative.policy import StepPlan


class RankDivergence(RuntimeError):
    """Tensor-parallel ranks scheduled different batches."""


class TPDecisions:
    """Rank 0's decisions on every rank (one instance per engine rank)."""

    def __init__(self, group: TPGroup, rank: int, max_bs: int, consensus: Optional[RankConsensusChecker] = None):
        self.group, self.rank, self.max_bs = group, rank, max_bs
        self.consensus = consensus
        self._buf: Optional[torch.Tensor] = None

    def agree(self, tensors: list[torch.Tensor], site: str) -> list[torch.Tensor]:
        """Rank 0's values of these int64 CPU tensors, as owned copies."""
        n = sum(t.numel() for t in tensors)
        if self._buf is None or self._buf.numel() < n:
            self._buf = torch.zeros(max(n, self.max_bs * 32), dtype=torch.int64)
        buf = self._buf[:n]
        torch.cat([t.reshape(-1) for t in tensors], out=buf)
        self.group.broadcast_(buf, site, on_model_group=True)
        out, offset = [], 0
        for t in tensors:
            out.append(buf[offset : offset + t.numel()].view(t.shape).clone())
            offset += t.numel()
        return out

    def agree_plan(self, plan: StepPlan, drafter_names: list[str]) -> StepPlan:
        """Rank 0's drafter and draft count per request (drafters sent as indices into the names)."""
        codes = torch.tensor([-1 if d is None else drafter_names.index(d) for d in plan.drafters], dtype=torch.int64)
        codes, drafts = self.agree([codes, torch.tensor(plan.drafts, dtype=torch.int64)], "runner.plan")
        plan.drafters = [None if c < 0 else drafter_names[c] for c in codes.tolist()]
        plan.drafts = drafts.tolist()
        return plan

    def agree_windows(self, ids: torch.Tensor, verify_lens: Optional[list[int]]) -> Optional[list[int]]:
        """Rank 0's drafted windows (written into `ids`) and rows to verify (None: every row)."""
        bs, width = ids.shape
        lens = torch.tensor(verify_lens if verify_lens is not None else [width] * bs, dtype=torch.int64)
        ids_agreed, lens = self.agree([ids.cpu(), lens], "runner.drafts")
        ids.copy_(ids_agreed)
        return lens.tolist() if verify_lens is not None else None

    def agree_on_batch_shape(self, rows: int, tokens: int) -> None:
        """One small all-reduce (MIN of the values and of their negations) before a forward."""
        shape = torch.tensor([rows, tokens, -rows, -tokens])
        self.group.all_reduce_(shape, "engine.batch_shape", op="min")
        if int(shape[0]) != -int(shape[2]) or int(shape[1]) != -int(shape[3]):
            if self.consensus is not None:
                self.consensus.flush()  # reports the divergent events and exits
            raise RankDivergence(
                f"rank divergence at site 'engine.batch_shape' on rank {self.rank}: this rank "
                f"scheduled {rows} requests / {tokens} tokens, the ranks range over requests "
                f"{int(shape[0])}..{-int(shape[2])} and tokens {int(shape[1])}..{-int(shape[3])}"
            )
