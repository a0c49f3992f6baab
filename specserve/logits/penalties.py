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

from specserve.runtime.stream import staged
from specserve.sampling_params import SamplingParams


def shape_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
) -> torch.Tensor:
    """logits [n, V] -> float32 [n, V] with row r's bias and penalties applied, given the prompt
    and the output tokens before that row (`prompts[r]`, `outputs[r]`)."""
    n, vocab = logits.shape
    return shape_by_counts(
        logits, params, token_counts(outputs, n, vocab, logits.device), seen_tokens(prompts, n, vocab, logits.device)
    )


def shape_by_counts(
    logits: torch.Tensor, params: Sequence[SamplingParams], counts: torch.Tensor, prompt_seen: torch.Tensor
) -> torch.Tensor:
    """shape_logits from device state: counts [n, V] of the output tokens before each row (float32),
    prompt_seen [n, V] the prompt's tokens. Nothing is read back."""
    out = logits.float().clone()
    _add_bias(out, params)
    if any(p.repetition_penalty != 1.0 for p in params):
        rep = staged([p.repetition_penalty for p in params], torch.float32, out.device).unsqueeze(1)
        seen = (counts > 0) | prompt_seen
        out = torch.where(seen, torch.where(out > 0, out / rep, out * rep), out)
    freq = staged([p.frequency_penalty for p in params], torch.float32, out.device).unsqueeze(1)
    pres = staged([p.presence_penalty for p in params], torch.float32, out.device).unsqueeze(1)
    return out - (freq * counts + pres * (counts > 0).float())


def _add_bias(out: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    for r, p in enumerate(params):
        if p.logit_bias:
            ids = staged(list(p.logit_bias), torch.int64, out.device)
            out[r, ids] += staged(list(p.logit_bias.values()), torch.float32, out.device)


def token_counts(outputs: Sequence[Sequence[int]], n: int, vocab: int, device) -> torch.Tensor:
    """[n, V] float32: how often each token occurs in outputs[r]."""
    counts = torch.zeros(n, vocab, dtype=torch.float32, device=device)
    rows, toks = _flat(outputs, device)
    counts.index_put_((rows, toks), torch.ones(toks.shape[0], device=device), accumulate=True)
    return counts


def seen_tokens(lists: Sequence[Sequence[int]], n: int, vocab: int, device) -> torch.Tensor:
    """[n, V] bool: the tokens in lists[r]."""
    seen = torch.zeros(n, vocab, dtype=torch.bool, device=device)
    rows, toks = _flat(lists, device)
    seen[rows, toks] = True
    return seen


def _flat(lists: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = staged([r for r, tokens in enumerate(lists) for _ in tokens], torch.int64, device)
    toks = staged([t for tokens in lists for t in tokens], torch.int64, device)
    return rows, toks
