"""Logprobs reported to clients: of each output token and of the most likely tokens at its position.

Computed from the target's logits after the request's bias and penalties (and grammar mask) and
before temperature, top-k, top-p and min-p: the convention of vLLM and SGLang. A token's logprob
is the same whether a plain decode, a verify row or a bonus produced it (same row, same logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One output position: its token's logprob and the `top` (token, logprob) pairs, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top_n: Sequence[int]) -> list[TokenLogprob]:
    """logits [n, V] (already shaped), the token chosen at each row and how many top entries each wants."""
    if not len(tokens):
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(list(tokens), dtype=torch.int64, device=logp.device).unsqueeze(1))
    k = max(top_n)
    best = logp.topk(k, dim=-1) if k else None
    out = []
    for r, (tok, n) in enumerate(zip(tokens, top_n)):
        top = tuple(zip(best.indices[r, :n].tolist(), best.values[r, :n].tolist())) if n and best is not None else ()
        out.append(TokenLogprob(int(tok), float(chosen[r, 0]), top))
    return out
