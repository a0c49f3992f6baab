"""NGRAM: model-free drafts by suffix match over the request's own tokens (prompt lookup).

The drafts come from the request's tokens on the device (TokenTable, written as steps commit), so
drafting never waits for the host to learn the last step's tokens. The same tokens on the host
(each request's RequestTokens, told late: after the step is resolved) give the speculation
policy's match hints, through an n-gram index kept with the request and brought up to date when
a hint is asked."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from specserve.errors import ConfigError
from specserve.names import Algorithm
from specserve.speculative.committed import RequestTokens, TokenTable
from specserve.speculative.worker import DraftContext, DraftInput, Drafts, WorkerDefaults

MAX_MATCH_BUCKET = 4  # the policy's rates are kept per match length 0..4 (4: four or more)


class TokenHistory:
    """An index of the n-grams of one request's committed tokens (`tokens`, a view the request's
    commits extend), so a lookup costs a few dict reads instead of a scan: `index[n]` maps every
    n-gram that has a token after it to its latest start. The proposal is the tokens that followed
    the latest earlier occurrence of the current suffix, trying max_ngram tokens down to
    min_ngram; with no match it repeats the last token."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, tokens: Optional[list[int]] = None):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = [] if tokens is None else tokens
        self.indexed = 0  # tokens[:indexed] are in the index
        self.index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        self.catch_up()

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        self.catch_up()

    def catch_up(self) -> "TokenHistory":
        """Index the tokens appended since the last call."""
        toks = self.tokens
        for end in range(self.indexed, len(toks)):  # the n-grams ending before `end` now have a continuation
            for n, index in self.index.items():
                if end >= n:
                    index[tuple(toks[end - n : end])] = end - n
        self.indexed = len(toks)
        return self

    def match(self, gamma: int) -> tuple[int, list[int]]:
        """(matched suffix length, 0 when none; the gamma proposed tokens)."""
        toks = self.tokens
        for n in range(min(self.max_ngram, len(toks) - 1), self.min_ngram - 1, -1):
            start = self.index[n].get(tuple(toks[len(toks) - n :]))
            if start is not None:
                follow = toks[start + n : start + n + gamma]
                return n, follow + [follow[-1]] * (gamma - len(follow))
        return 0, [toks[-1]] * gamma


class NgramWorker(WorkerDefaults):
    """The NGRAM drafter behind the worker seam: it drafts from each request slot's tokens on the
    device (`token_table`), and gives the policy's hints from each request's host tokens. Without a
    table (tests, tools) it drafts from the host tokens, which must then be told before the next
    step is launched (`tokens_early`)."""

    name = Algorithm.NGRAM
    reads_tokens = True

    def __init__(self, gamma: int, max_ngram: int = 4, min_ngram: int = 1, token_table: Optional[TokenTable] = None):
        if gamma < 1:
            raise ConfigError(f"speculative_num_steps: must be >= 1, got {gamma}")
        self.gamma, self.max_ngram, self.min_ngram = gamma, max_ngram, min_ngram
        self.token_table = token_table
        self.tokens_early = token_table is None

    def history(self, request: RequestTokens) -> TokenHistory:
        """The request's n-gram index, up to date with its tokens."""
        # indexes the request's own token list: its commits extend it
        made = request.state(self.name, lambda: TokenHistory(self.max_ngram, self.min_ngram, request.tokens))
        return made.catch_up()

    def match_lens(self, requests: Sequence[RequestTokens]) -> list[int]:
        """The suffix match length of each request."""
        return [self.history(r).match(1)[0] for r in requests]

    def hints(self, requests: Sequence[RequestTokens], greedy: Optional[list[bool]] = None) -> list[tuple[int, int]]:
        """Per request (match-length bucket, gamma): the adaptive policy keeps NGRAM's rates per match length."""
        return [(min(m, MAX_MATCH_BUCKET), self.gamma) for m in self.match_lens(requests)]

    def draft(self, inp: DraftInput) -> Drafts:
        if self.token_table is not None:  # on the device: the host's bound, not the prefixes read back
            table, width = self.token_table, inp.context_bound() + 1
            return Drafts(table.propose(inp.rows, inp.prefix_lens, width, inp.gamma, self.min_ngram, self.max_ngram))
        proposals = [self.history(r).match(inp.gamma)[1] for r in inp.requests]
        return Drafts(torch.tensor(proposals, dtype=torch.int64, device=inp.anchors.device))


def make_worker(ctx: DraftContext) -> NgramWorker:
    return NgramWorker(ctx.gamma, token_table=ctx.token_table)
