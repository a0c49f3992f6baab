"""A launched step: what the forward stream produced, the copy stream's host copies, and the
outcomes the host reads from them once the copy's event has fired."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from specserve.executor.step_io import PromptLogprobs, SampledToken, StepInput, StepOutcome, VerifyOutcome
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
    lag_number: int = -1  # its number for the copy-lag fault (SPECSERVE_FAULT_COPY_LAG_MS), else -1
    logprobs: dict[int, list] = field(default_factory=dict)  # request index -> TokenLogprobs (forward stream)
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)  # request index -> its chunk's

    def outcomes(self) -> list[StepOutcome]:
        """Each request's outcome, from the host copies only (the copy's event has fired)."""
        if self.plan is not None:  # a speculating engine's decode step: its windows as planned
            return self._window_outcomes(self.plan)
        tokens, lps, prompt = self.host_out[0].tolist(), self.logprobs, self.prompt_logprobs
        return [
            SampledToken(t if s else None, lps.get(i), prompt.get(i)) if i in lps or i in prompt else t if s else None
            for i, (t, s) in enumerate(zip(tokens, self.step.sample))
        ]

    def _window_outcomes(self, plan: StepPlan) -> list[StepOutcome]:
        if plan.speculates:
            out = AcceptOuts(*self.host_out)
            commit, rows, trimmed = out.commit_lens.tolist(), out.out_tokens.tolist(), out.cap_trim_lens.tolist()
            tokens = [row[:n] for row, n in zip(rows, commit)]
        else:  # no drafts: each request's one decoded token
            tokens, trimmed = [[t] for t in self.host_out[0].tolist()], [0] * self.step.size
        windows = zip(tokens, trimmed, plan.drafters, plan.drafts, plan.predicted)
        return [
            VerifyOutcome(toks, cap, drafter, k, predicted, self.logprobs.get(i))
            for i, (toks, cap, drafter, k, predicted) in enumerate(windows)
        ]
