"""A launched step: what the forward stream produced, the copy stream's host copies, and the
outcomes the host reads from them once the copy's event has fired."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from specserve.executor.commit_path import Committed
from specserve.executor.step_io import PromptLogprobs, StepInput, StepOutcome, VerifyStats
from specserve.logits.logprobs import DeviceLogprobs
from specserve.runtime.stream import Event
from specserve.speculative.accept import AcceptOuts
from specserve.speculative.step_plan import StepPlan


@dataclass
class StepHandle:
    """One launched step: its results on the device, their host copies, and the copy's event."""

    step: StepInput
    plan: Optional[StepPlan] = None  # a verify step's decisions, set on the forward stream
    device_out: list[torch.Tensor] = field(default_factory=list)  # set on the forward stream
    host_out: list[torch.Tensor] = field(default_factory=list)  # set on the copy stream
    done: Optional[Event] = None
    logprobs: list[DeviceLogprobs] = field(default_factory=list)  # read with the late copy (forward stream)
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)  # request index -> its chunk's
    pending: Optional[Committed] = None  # a commit the host parties read late, from commit_values()
    commit_at: int = 0
    logprobs_at: Optional[int] = None  # where the logprobs' tensors start in device_out / host_out
    _committed: Optional[Committed] = None

    def commit(self, done: Committed, host_parties_wait: bool) -> None:
        """The step's commit (forward stream); kept for the late host parties if they still wait."""
        self._committed = done if host_parties_wait else None

    def keep_commit(self) -> None:
        """After device_out is set: the pending commit's tensors, then the logprobs', join the
        step's one late copy."""
        if self._committed is not None:
            self.pending, self._committed = self._committed, None
            self.commit_at = len(self.device_out)
            self.device_out = self.device_out + self.pending.tensors()
        if self.logprobs:
            self.logprobs_at = len(self.device_out)
            self.device_out = self.device_out + [t for part in self.logprobs for t in part.tensors]

    def _results(self) -> list[torch.Tensor]:
        """The host copies of the step's own results (without the commit's and the logprobs')."""
        end = self.commit_at if self.pending is not None else self.logprobs_at
        return self.host_out[:end]

    def commit_values(self) -> list[torch.Tensor]:
        """The host copies of the pending commit's tensors."""
        return self.host_out[self.commit_at : self.logprobs_at]

    def outcomes(self) -> list[StepOutcome]:
        """Each request's outcome, from the host copies only (the copy's event has fired)."""
        tokens, stats = self._tokens()
        lps, prompt = self._logprobs(), self.prompt_logprobs
        return [StepOutcome(t, lps.get(i), prompt.get(i), v) for i, (t, v) in enumerate(zip(tokens, stats))]

    def _logprobs(self) -> dict[int, list]:
        """Request index -> its TokenLogprobs, from the host copies (a window's up to its commit)."""
        out: dict[int, list] = {}
        at = self.logprobs_at or 0
        commit_lens = None
        if self.logprobs and self.plan is not None and self.plan.speculates:
            commit_lens = AcceptOuts(*self._results()).commit_lens.tolist()
        for part in self.logprobs:
            for i, found in part.read(self.host_out[at : at + len(part.tensors)], commit_lens).items():
                out.setdefault(i, []).extend(found)
            at += len(part.tensors)
        return out

    def _tokens(self) -> tuple[list[list[int]], list[Optional[VerifyStats]]]:
        """Per request its emitted tokens and, for a speculating engine's decode step (planned:
        its windows), the window's statistics."""
        plan = self.plan
        if plan is None:  # a prefill chunk (a token only where one is sampled) or a plain decode step
            return [[t] if s else [] for t, s in zip(self._results()[0].tolist(), self.step.sample)], [None] * self.step.size
        if plan.speculates:
            out = AcceptOuts(*self._results())
            commit, rows, trimmed = out.commit_lens.tolist(), out.out_tokens.tolist(), out.cap_trim_lens.tolist()
            tokens = [row[:n] for row, n in zip(rows, commit)]
        else:  # no drafts: each request's one decoded token
            tokens, trimmed = [[t] for t in self._results()[0].tolist()], [0] * self.step.size
        windows = zip(plan.drafters, plan.drafts, plan.predicted, trimmed)
        return tokens, [VerifyStats(drafter, k, predicted, cap) for drafter, k, predicted, cap in windows]
