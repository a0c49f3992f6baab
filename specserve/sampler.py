"""Batched sampling: greedy, temperature, top-k, top-p and min-p with counter-based seeds.

Each sampled token uses a uniform number derived from (request seed, output position) by a
hash, not from a stateful generator: the draw is the same whether the request runs alone or in
a batch, after a retraction, or on another tensor-parallel rank.
"""

from __future__ import annotations

from typing import Sequence, overload

import torch

from specserve.runtime.stream import staged
from specserve.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def counter_uniform(seed: int, counter: int) -> float:
    """A uniform in [0, 1) from splitmix64 over (seed, counter): reproducible and stateless."""
    z = (seed * 0x9E3779B97F4A7C15 + counter + 1) & _MASK64
    for shift, mul in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        z = ((z ^ (z >> shift)) * mul) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def _signed(c: int) -> int:
    """A 64-bit pattern as the int64 that holds it (torch's int64 arithmetic wraps modulo 2^64)."""
    c &= _MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (z >> shift) & ((1 << (64 - shift)) - 1)


def seeds_tensor(seeds: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """Request seeds (in [0, 2^64)) as int64 bit patterns on `device`."""
    return staged([_signed(s) for s in seeds], torch.int64, device)


def counter_uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """`counter_uniform` elementwise on the device: int64 seeds (bit patterns, `seeds_tensor`) and
    counters -> float64 uniforms, bit-identical to the host function."""
    z = seeds * _signed(0x9E3779B97F4A7C15) + counters + 1
    for shift, mul in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        z = (z ^ _shr(z, shift)) * _signed(mul)
    z = z ^ _shr(z, 31)
    return _shr(z, 11).double() / float(1 << 53)


def sample_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], seeds: torch.Tensor, counters: torch.Tensor
) -> torch.Tensor:
    """logits [n, V] -> one token id per row, on the logits' device, without reading anything back:
    greedy rows take the argmax, the others draw from `filtered_probs` at the uniform of their
    (seed, counter) (int64 tensors [n], see `seeds_tensor`)."""
    greedy = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if not rows:
        return greedy
    index = staged(rows, torch.int64, logits.device)
    probs = filtered_probs(logits[index], [params[i] for i in rows])
    picked = inverse_cdf(probs, counter_uniforms(seeds[index], counters[index]))
    return greedy.index_copy(0, index, picked)


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int], counters: Sequence[int]
) -> list[int]:
    """`sample_tokens` from host lists, read back (for host-side callers and tests)."""
    dev = logits.device
    counts = staged(list(counters), torch.int64, dev)
    return sample_tokens(logits, params, seeds_tensor(seeds, dev), counts).tolist()


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each request samples from: temperature, then top-k, top-p, min-p (on the
    logits' device)."""
    dev = logits.device
    temps = staged([p.temperature for p in params], torch.float32, dev).unsqueeze(1)
    probs = torch.softmax(logits / temps, dim=-1)
    vocab = probs.shape[1]
    top_k = staged([p.top_k if p.top_k > 0 else vocab for p in params], torch.int64, dev)
    top_p = staged([p.top_p for p in params], torch.float32, dev)
    min_p = staged([p.min_p for p in params], torch.float32, dev)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=dev).unsqueeze(0)
    drop = ranks >= top_k.unsqueeze(1)
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above this token
    drop |= before >= top_p.unsqueeze(1)
    drop |= sorted_p < (min_p * sorted_p[:, 0]).unsqueeze(1)
    drop[:, 0] = False  # the most likely token always survives
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, order, sorted_p)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One index per row of (unnormalised) probs, by inverse CDF at the row's uniform u."""
    cdf = probs.double().cumsum(-1)
    cdf = cdf / cdf[:, -1:]
    idx = torch.searchsorted(cdf, u.reshape(-1, 1).contiguous()).squeeze(1)
    idx = idx.clamp(max=probs.shape[1] - 1)
    # Never land on a zero-probability token when u falls on a flat stretch of the CDF.
    zero = probs.gather(1, idx.unsqueeze(1)).squeeze(1) == 0
    return torch.where(zero, probs.argmax(-1), idx)  # unconditional: asking whether any is would wait


@overload
def draw_counter(step_counter: int, slot: int) -> int: ...


@overload
def draw_counter(step_counter: torch.Tensor, slot: "int | torch.Tensor") -> torch.Tensor: ...


def draw_counter(step_counter, slot):
    """The counter of one uniform draw: a request's per-step counter with the slot in its low 6 bits
    (accept's rejection sampling, the drafter's sampled drafts and the runner share this layout)."""
    return (step_counter << 6) + slot


# The slot of the one draw that decides output token n in every kind of step (a prefill's first
# token, a decode row, a seeded request's verify row): rejection sampling's columns use slots
# 0..gamma and the drafters' own draws DRAFT_SLOT and up, so this one is the last.
TOKEN_SLOT = 63


@overload
def token_counter(out_len: int) -> int: ...


@overload
def token_counter(out_len: torch.Tensor) -> torch.Tensor: ...


def token_counter(out_len):
    """The counter of the draw that samples output token `out_len` (see TOKEN_SLOT)."""
    return draw_counter(out_len, TOKEN_SLOT)


DRAFT_SLOT = 32  # a drafter's own draws: slots 32 + k, past rejection sampling's columns


def draft_counter(out_len, k: int, coupled):
    """The counter of the draw that samples draft k of a window starting at output token `out_len`.
    For a request under the coupled accept (`coupled`: a bool, or a bool tensor beside a tensor
    `out_len`) it is the draw that decides that position's token (token_counter), so a drafter
    close to the target proposes the token the target's own draw picks; otherwise the drafter's
    own slot, independent of the accept's uniforms as rejection sampling needs."""
    if isinstance(out_len, torch.Tensor):
        return torch.where(coupled, token_counter(out_len + k), draw_counter(out_len, DRAFT_SLOT + k))
    return token_counter(out_len + k) if coupled else draw_counter(out_len, DRAFT_SLOT + k)
