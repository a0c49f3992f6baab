"""NGRAM: model-free drafts by suffix match over the request's own tokens (prompt lookup).

The drafts come from the request's tokens on the device (TokenTable, written as steps commit), so
drafting never waits for the host to learn the last step's tokens. The host keeps the same
histories too, fed late (after the step is resolved), for the speculation policy's match hints."""

from __future__ import annotations

from typing import Optional

import torch

from specserve.errors import ConfigError
from specserve.names import Algorithm
from specserve.speculative.token_table import TokenTable
from specserve.speculative.worker import DraftContext, DraftInput, Drafts, WorkerDefaults

MAX_MATCH_BUCKET = 4  # the policy's rates are kept per match length 0..4 (4: four or more)


class TokenHistory:
    """One request's committed tokens and an index of their n-grams, so a lookup costs a few dict
    reads instead of a scan: `index[n]` maps every n-gram that has a token after it to its latest
    start. The proposal is the tokens that followed the latest earlier occurrence of the current
    suffix, trying max_ngram tokens down to min_ngram; with no match it repeats the last token."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        self.index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}

    def extend(self, tokens: list[int]) -> None:
        toks = self.tokens
        for tok in tokens:
            toks.append(tok)
            end = len(toks) - 1  # the n-grams ending just before the new token now have a continuation
            for n, index in self.index.items():
                if end >= n:
                    index[tuple(toks[end - n : end])] = end - n

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
    device (`token_table`), and keeps host histories of them for the policy's hints. Without a
    table (tests, tools) it drafts from the host histories, which must then be fed before the next
    step is launched (`tokens_early`)."""

    name = Algorithm.NGRAM
    reads_tokens = True

    def __init__(self, gamma: int, max_ngram: int = 4, min_ngram: int = 1, token_table: Optional[TokenTable] = None):
        if gamma < 1:
            raise ConfigError(f"speculative_num_steps: must be >= 1, got {gamma}")
        self.gamma, self.max_ngram, self.min_ngram = gamma, max_ngram, min_ngram
        self.histories: dict[int, TokenHistory] = {}
        self.token_table = token_table

    @property
    def tokens_early(self) -> bool:
        return self.token_table is None

    def match_lens(self, rows: list[int]) -> list[int]:
        """The suffix match length of each request slot."""
        return [self.histories[row].match(1)[0] for row in rows]

    def hints(self, rows: list[int], greedy: Optional[list[bool]] = None) -> list[tuple[int, int]]:
        """Per slot (match-length bucket, gamma): the adaptive policy keeps NGRAM's rates per match length."""
        return [(min(m, MAX_MATCH_BUCKET), self.gamma) for m in self.match_lens(rows)]

    def draft(self, inp: DraftInput) -> Drafts:
        if self.token_table is not None:  # on the device: the host's bound, not the prefixes read back
            table, width = self.token_table, inp.context_bound() + 1
            return Drafts(table.propose(inp.rows, inp.prefix_lens, width, inp.gamma, self.min_ngram, self.max_ngram))
        proposals = [self.histories[row].match(inp.gamma)[1] for row in inp.rows.tolist()]
        return Drafts(torch.tensor(proposals, dtype=torch.int64, device=inp.anchors.device))

    def commit_tokens(self, row: int, tokens: list[int], restart: bool, new: int = 0, launch: int = 0) -> None:
        if restart:
            self.histories[row] = TokenHistory(self.max_ngram, self.min_ngram)
        self.histories[row].extend(tokens)


def make_worker(ctx: DraftContext) -> NgramWorker:
    return NgramWorker(ctx.gamma, token_table=ctx.token_table)
