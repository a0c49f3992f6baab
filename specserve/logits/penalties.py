"""Per-request changes to the target's logits: logit_bias, then repetition, frequency and presence penalties.

They apply to every row the target computes for a request (a decode row, a prefill's last row,
each row of a verify window) with the output tokens that precede that row: for verify row j of a
window `[anchor, d_1..d_g]` that is the committed output, then d_1..d_j. So the logits of a
position are the same whichever step produced its token, and speculation stays exact: greedy
output is token-identical to NONE, sampling draws from the same distribution.

Conventions (vLLM's and OpenAI's): presence and frequency count the output's tokens only;
repetition (Hugging Face's rule) counts the prompt's and the output's; the bias comes first.
Rows of a request with neutral settings come out bit-identical.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specserve.sampling_params import SamplingParams


def shape_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
) -> torch.Tensor:
    """logits [n, V] -> float32 [n, V] with row r's bias and penalties applied, given the prompt
    and the output tokens before that row (`prompts[r]`, `outputs[r]`)."""
    out = logits.float().clone()
    n, vocab = out.shape
    _add_bias(out, params)
    counts = _token_counts(outputs, n, vocab, out.device)
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=out.device).unsqueeze(1)
    if bool((rep != 1.0).any()):
        seen = counts > 0
        rows, toks = _flat(prompts, out.device)
        seen[rows, toks] = True
        out = torch.where(seen, torch.where(out > 0, out / rep, out * rep), out)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=out.device).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=out.device).unsqueeze(1)
    return out - (freq * counts + pres * (counts > 0).float())


def _add_bias(out: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    for r, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=out.device)
            out[r, ids] += torch.tensor(list(p.logit_bias.values()), dtype=torch.float32, device=out.device)


def _token_counts(outputs: Sequence[Sequence[int]], n: int, vocab: int, device) -> torch.Tensor:
    counts = torch.zeros(n, vocab, dtype=torch.float32, device=device)
    rows, toks = _flat(outputs, device)
    counts.index_put_((rows, toks), torch.ones(len(toks), device=device), accumulate=True)
    return counts


def _flat(lists: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.tensor([r for r, tokens in enumerate(lists) for _ in tokens], dtype=torch.int64, device=device)
    toks = torch.tensor([t for tokens in lists for t in tokens], dtype=torch.int64, device=device)
    return rows, toks
