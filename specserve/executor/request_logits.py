"""The runner's per-request logit work: penalties and bias on every target row, and logprobs.

Penalties need the tokens before each row, and the runner is the only place that knows them in
time: in the overlap loop the scheduler learns step N's tokens after step N+1 was launched. So
the runner keeps, per request slot, the prompt and the committed output of each request whose
logits it shapes: set when a prefill samples (the whole sequence, also after a retraction), then
extended by every token a decode or verify step commits, whichever drafter proposed it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from specserve.logits.logprobs import TokenLogprob, token_logprobs
from specserve.logits.penalties import shape_logits
from specserve.sampling_params import SamplingParams


class RequestLogits:
    """Token histories of the requests whose logits are shaped, and the shaping and logprobs of a step's rows."""

    def __init__(self) -> None:
        self._prompts: dict[int, list[int]] = {}
        self._outputs: dict[int, list[int]] = {}

    def start(self, row: int, params: SamplingParams, fill: Sequence[int], out_len: int) -> None:
        """Slot `row` holds a request whose tokens so far are `fill`, the last `out_len` of them output."""
        if params.shapes_logits:
            cut = len(fill) - out_len
            self._prompts[row], self._outputs[row] = list(fill[:cut]), list(fill[cut:])
        else:
            self._prompts.pop(row, None)
            self._outputs.pop(row, None)

    def commit(self, row: int, tokens: Sequence[int]) -> None:
        if row in self._outputs:
            self._outputs[row].extend(tokens)

    def shape(self, logits: torch.Tensor, rows: Sequence[int], params: Sequence[SamplingParams],
              windows: Optional[Sequence[Sequence[int]]] = None) -> torch.Tensor:
        """logits [n, V], one row per (slot, params) -> the same logits, shaped where a request asks for it.
        `windows[r]`: tokens between the request's committed output and row r (a verify row's drafts)."""
        shaped = [r for r, p in enumerate(params) if p.shapes_logits]
        if not shaped:
            return logits
        out = logits.clone()  # never write into a captured step's logits buffer
        outputs = [self._outputs[rows[r]] + list(windows[r] if windows else ()) for r in shaped]
        out[shaped] = shape_logits(logits[shaped], [params[r] for r in shaped],
                                   [self._prompts[rows[r]] for r in shaped], outputs).to(logits.dtype)
        return out

    @staticmethod
    def logprobs(logits: torch.Tensor, params: Sequence[SamplingParams],
                 tokens: Sequence[int]) -> list[Optional[TokenLogprob]]:
        """Per row, its token's logprob (None where the request did not ask)."""
        wanted = [r for r, p in enumerate(params) if p.logprobs]
        out: list[Optional[TokenLogprob]] = [None] * len(params)
        if wanted:
            found = token_logprobs(logits[wanted], [tokens[r] for r in wanted], [params[r].top_logprobs for r in wanted])
            for r, lp in zip(wanted, found):
                out[r] = lp
        return out

    def record_logprobs(self, into: dict[int, list], indices: Sequence[int], logits: torch.Tensor,
                        params: Sequence[SamplingParams], tokens: Sequence[int]) -> None:
        """A decode or prefill step's logprobs (one token per row), by request index, where asked."""
        for i, lp in zip(indices, self.logprobs(logits, params, tokens)):
            if lp is not None:
                into[i] = [lp]

    def window_logprobs(self, into: dict[int, list], params: Sequence[SamplingParams], logits: torch.Tensor,
                        layout: list[tuple[int, int]], commit_lens: list[int], out_tokens: list[list[int]]) -> None:
        """A verify step's logprobs of each committed token, by request index: window column k's
        token (an accepted draft, or the bonus) is the one row k predicted."""
        picked = [r for r, (i, j) in enumerate(layout) if params[i].logprobs and j < commit_lens[i]]
        if not picked:
            return
        found = self.logprobs(logits[picked], [params[layout[r][0]] for r in picked],
                              [out_tokens[layout[r][0]][layout[r][1]] for r in picked])
        for r, lp in zip(picked, found):
            into.setdefault(layout[r][0], []).append(lp)


def verify_row_layout(bs: int, width: int, keep: Optional[torch.Tensor]) -> list[tuple[int, int]]:
    """(request, window column) of each row of a verify step's logits: every row, or the kept ones packed."""
    if keep is None:
        return [(i, j) for i in range(bs) for j in range(width)]
    return [tuple(ij) for ij in keep.nonzero().tolist()]
