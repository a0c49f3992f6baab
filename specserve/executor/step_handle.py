"""A launched step: what the forward stream produced, the copy stream's host copies, and the
outcomes the host reads from them once the copy's event has fired."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from specserve.executor.step_io import PromptLogprobs, StepInput, StepOutcome, VerifyStats
from specserve.runtime.stream import Event
from specserve.speculative.accept import AcceptOuts
from specserve.speculative.adaptive import StepPlan


@dataclass
class StepHandle:
    """One launched step: its results on the device, their host copies, and the copy's event."""

    step: StepInput
    plan: Optional[StepPlan] = None  # a verify step's decisions, set on the forward stream
    device_out: list[torch.Tensor] = field(default_factory=list)  # set on the forward stream
    host_out: list[torch.Tensor] = field(default_factory=list)  # set on the copy stream
    done: Optional[Event] = None
    logprobs: dict[int, list] = field(default_factory=dict)  # request index -> TokenLogprobs (forward stream)
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)  # request index -> its chunk's

    def outcomes(self) -> list[StepOutcome]:
        """Each request's outcome, from the host copies only (the copy's event has fired)."""
        tokens, stats = self._tokens()
        lps, prompt = self.logprobs, self.prompt_logprobs
        return [StepOutcome(t, lps.get(i), prompt.get(i), v) for i, (t, v) in enumerate(zip(tokens, stats))]

    def _tokens(self) -> tuple[list[list[int]], list[Optional[VerifyStats]]]:
        """Per request its emitted tokens and, for a speculating engine's decode step (planned:
        its windows), the window's statistics."""
        plan = self.plan
        if plan is None:  # a prefill chunk (a token only where one is sampled) or a plain decode step
            return [[t] if s else [] for t, s in zip(self.host_out[0].tolist(), self.step.sample)], [None] * self.step.size
        if plan.speculates:
            out = AcceptOuts(*self.host_out)
            commit, rows, trimmed = out.commit_lens.tolist(), out.out_tokens.tolist(), out.cap_trim_lens.tolist()
            tokens = [row[:n] for row, n in zip(rows, commit)]
        else:  # no drafts: each request's one decoded token
            tokens, trimmed = [[t] for t in self.host_out[0].tolist()], [0] * self.step.size
        windows = zip(plan.drafters, plan.drafts, plan.predicted, trimmed)
        return tokens, [VerifyStats(drafter, k, predicted, cap) for drafter, k, predicted, cap in windows]
