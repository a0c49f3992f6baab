"""Acceptance measured where serving earns it: anchors placed as serving places them.

Training scores a drafter at anchors drawn at random from a response. Serving places an anchor
only after each accepted run: the first at the prompt's end, then at S + a + 1 when a drafts of
the block at S were accepted. A block's drafts depend only on its anchor token and the target's
hidden states before it, which are those of the response itself (greedy verify commits exactly
the target's greedy tokens), so one batched pass over every anchor gives `accepts[S]` for all S,
and serving's steps are a walk over that array. In fp32 with static verify the walk reproduces the
engine's per-step accepted-draft counts (`spec_accepted_drafts_per_step`) exactly; the test checks
it. Comparing the walk with the mean over all anchors separates where anchors fall from what the
drafter knows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.kv.pool import KVPool
from specserve.models.dspark import DsparkDrafter
from specserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@torch.inference_mode()
def dense_accepts(drafter: DsparkDrafter, hidden: torch.Tensor, ids: torch.Tensor, prompt_len: int,
                  chunk: int = 64) -> torch.Tensor:
    """accepts[S - prompt_len] for every anchor S in [prompt_len, T - 2]: how many of the block's
    greedy drafts at S lead the response (labels past its end never match)."""
    T, g = ids.shape[0], drafter.block_size
    kv = KVPool(T + 1, len(drafter.layers), drafter.config.num_kv_heads, drafter.config.head_dim, drafter.dtype,
                str(hidden.device), block_rows=chunk * g)
    drafter.inject(hidden, torch.arange(T), torch.arange(1, T + 1), kv)  # slot 0 is the scratch slot
    slots = torch.arange(1, T + 1)
    out = []
    for start in range(prompt_len, T - 1, chunk):
        S = torch.arange(start, min(start + chunk, T - 1))
        n = len(S)
        drafts = drafter.propose(ids[S], S, slots.expand(n, T), kv, [GREEDY] * n, [0] * n, [0] * n).tokens
        label_pos = S.unsqueeze(1) + 1 + torch.arange(g)
        match = (drafts == ids[label_pos.clamp(max=T - 1)]) & (label_pos < T)
        out.append(match.int().cumprod(1).sum(1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


def serving_walk(accepts: torch.Tensor, prompt_len: int, length: int) -> list[int]:
    """Serving's accepted drafts per verify step: anchor at the prompt's end, then after each run."""
    steps, S = [], prompt_len
    while S < length - 1:
        a = int(accepts[S - prompt_len])
        steps.append(a)
        S += a + 1
    return steps


@dataclass
class AcceptTally:
    """Pooled acceptance over many responses, at serving's anchors and at every anchor."""

    block_size: int
    walk_steps: int = 0
    walk_accepted: int = 0
    walk_survival: list[int] = field(default_factory=list)
    all_anchors: int = 0
    all_accepted: int = 0
    all_survival: list[int] = field(default_factory=list)

    def add(self, accepts: torch.Tensor, steps: list[int]) -> None:
        if not self.walk_survival:
            self.walk_survival, self.all_survival = [0] * self.block_size, [0] * self.block_size
        self.walk_steps += len(steps)
        self.walk_accepted += sum(steps)
        self.all_anchors += len(accepts)
        self.all_accepted += int(accepts.sum())
        for k in range(self.block_size):
            self.walk_survival[k] += sum(1 for a in steps if a > k)
            self.all_survival[k] += int((accepts > k).sum())

    def summary(self) -> dict:
        w, a = max(self.walk_steps, 1), max(self.all_anchors, 1)
        return {"serving_walk": {"accept_length": 1 + self.walk_accepted / w, "steps": self.walk_steps,
                                 "first_draft_accepted": self.walk_survival[0] / w if self.walk_survival else 0.0,
                                 "per_slot_survival": [round(x / w, 4) for x in self.walk_survival]},
                "every_anchor": {"accept_length": 1 + self.all_accepted / a, "anchors": self.all_anchors,
                                 "first_draft_accepted": self.all_survival[0] / a if self.all_survival else 0.0,
                                 "per_slot_survival": [round(x / a, 4) for x in self.all_survival]}}
