"""Logprobs reported to clients: of each output token and of the most likely tokens at its position.

Computed from the target's logits after the request's bias and penalties (and grammar mask) and
before temperature, top-k, top-p and min-p: the convention of vLLM and SGLang. A token's logprob
is the same whether a plain decode, a verify row or a bonus produced it (same row, same logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One output position: its token's logprob and the `top` (token, logprob) pairs, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class DeviceLogprobs:
    """Logprobs computed on the device, read with the step's one late copy (`read`): per row the
    request it belongs to, its window column (None: one row per request) and its top count."""

    requests: list[int]
    columns: Optional[list[int]]
    top_n: list[int]
    tensors: list[torch.Tensor]  # token [n], its logprob [n], top ids [n, K], top logprobs [n, K]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "DeviceLogprobs":
        """The same logprobs with every tensor through `fn` (the step's late copy to the host)."""
        return DeviceLogprobs(self.requests, self.columns, self.top_n, [fn(t) for t in self.tensors])

    def read(self, commit_lens: Optional[Sequence[int]] = None) -> dict[int, list[TokenLogprob]]:
        """From host copies (see `map`): per request its rows' TokenLogprobs in order, a window's
        only up to its commit length (the columns whose tokens were committed)."""
        tokens, chosen, ids, values = (t.tolist() for t in self.tensors)
        out: dict[int, list[TokenLogprob]] = {}
        for r, (i, n) in enumerate(zip(self.requests, self.top_n)):
            if self.columns is not None and commit_lens is not None and self.columns[r] >= commit_lens[i]:
                continue
            top = tuple(zip(ids[r][:n], values[r][:n]))
            out.setdefault(i, []).append(TokenLogprob(int(tokens[r]), float(chosen[r]), top))
        return out


def device_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    top_n: Sequence[int],
    requests: Sequence[int],
    columns: Optional[Sequence[int]] = None,
) -> DeviceLogprobs:
    """logits [n, V] (already shaped) and the token chosen at each row (a device tensor): the
    logprobs and top entries, nothing read back."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens.view(-1, 1)).squeeze(1)
    best = logp.topk(max(top_n, default=0), dim=-1)
    cols = None if columns is None else list(columns)
    return DeviceLogprobs(list(requests), cols, list(top_n), [tokens.view(-1), chosen, best.indices, best.values])


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top_n: Sequence[int]) -> list[TokenLogprob]:
    """logits [n, V] (already shaped), the token chosen at each row and how many top entries each
    wants, read at once (a prompt's logprobs)."""
    if not len(tokens):
        return []
    ids = torch.tensor(list(tokens), dtype=torch.int64, device=logits.device)
    found = device_logprobs(logits, ids, top_n, range(len(tokens)))
    read = found.read()
    return [read[r][0] for r in range(len(tokens))]
