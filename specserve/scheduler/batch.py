"""ScheduleBatch: what one step runs, in plain Python lists (the runner makes tensors)."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.scheduler.req import Req


@dataclass
class VerifyOutcome:
    """One request's result of a verify step: the committed tokens (accepted drafts, then the
    bonus) and the matches the compact verify length cut off (cap_trim_lens)."""

    tokens: list[int]
    cap_trimmed: int = 0


@dataclass(eq=False)
class ScheduleBatch:
    """The requests of one forward step and, per request, the new tokens and their KV slots."""

    mode: str  # "extend" (prefill, possibly after a cached prefix or as one chunk) or "decode"
    reqs: list[Req]
    prefix_lens: list[int]  # tokens already in the KV cache, per request
    extend_lens: list[int]  # new tokens this step, per request
    input_ids: list[int]  # flat new tokens
    out_cache_loc: list[int]  # flat token slots for the new tokens' K/V
    sample: list[bool]  # whether a next token is sampled for the request (False for a non-final chunk)

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    def positions(self) -> list[int]:
        return [p + i for p, e in zip(self.prefix_lens, self.extend_lens) for i in range(e)]
