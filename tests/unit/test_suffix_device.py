"""SUFFIX's device walk against the host index, token for token, and the device segments' order.

The device drafts (speculative/suffix_device.py) must be the host proposal's exactly: the own
index walked over a token table row, the global one over the device segments (appends and
evictions mirrored), their choice by exact score; a sampled request never drafts from the global
tokens. The segments apply a change only to a draft two launches later, and a change that comes
later than that is refused (a broken ordering would otherwise make ranks draft differently).
"""

from __future__ import annotations

import random

import pytest
import torch

from specserve.errors import InternalError
from specserve.sampling_params import SamplingParams
from specserve.speculative.suffix_device import DeviceSegments
from specserve.speculative.suffix_index import SEPARATOR
from specserve.speculative.speculation import Speculation
from specserve.speculative.suffix_worker import SuffixConfig, SuffixWorker
from specserve.speculative.committed import TokenTable
from specserve.speculative.worker import DraftInput

GREEDY, SAMPLED = SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=3)


def texts(rng: random.Random, phrases: list[list[int]], count: int, length: int, vocab: int = 40) -> list[list[int]]:
    """Repetitive token sequences (a small vocabulary, phrases reused) so that suffixes match."""
    out = []
    for _ in range(count):
        seq: list[int] = []
        while len(seq) < length:
            seq += rng.choice(phrases) if rng.random() < 0.8 else [rng.randrange(vocab)]
        out.append(seq[:length])
    return out


def fed(spec: Speculation, table: TokenTable, row: int, tokens: list[int], prompt: int, launch: int) -> None:
    """Slot `row` holds a request with these tokens (the first `prompt` its prompt), on both sides
    (the Speculation keeps each slot's RequestTokens, which the worker reads)."""
    spec.commit_tokens(row, tokens[: prompt + 1], restart=True, new=1, launch=launch)
    if len(tokens) > prompt + 1:
        spec.commit_tokens(row, tokens[prompt + 1 :], restart=False, launch=launch)
    table.write_sequence(row, tokens)


def draft_input(spec: Speculation, rows: list[int], lens: list[int], table: TokenTable, gamma: int, params,
                launch=None) -> DraftInput:
    anchors = torch.tensor([int(table.tokens[r, n - 1]) for r, n in zip(rows, lens)])
    prefix = torch.tensor([n - 1 for n in lens])
    return DraftInput(torch.tensor(rows), anchors, prefix, torch.zeros(len(rows), dtype=torch.int64), params,
                      [0] * len(rows), gamma, None, max(lens) + 1, launch, [spec.requests[r] for r in rows])


def host_drafts(worker: SuffixWorker, inp: DraftInput) -> torch.Tensor:
    worker.drafts_on_device = False
    try:
        return worker.draft(inp).tokens
    finally:
        worker.drafts_on_device = True


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("config", [SuffixConfig(), SuffixConfig(max_depth=4, spec_factor=0.5, min_prob=0.3),
                                    SuffixConfig(max_depth=2, min_prob=0.0, cache_tokens=300),
                                    SuffixConfig(max_depth=3, spec_factor=2.0, min_prob=0.25)])
def test_device_drafts_equal_the_host_proposals(seed, config):
    rng = random.Random(seed)
    gamma, slots = 6, 8
    table = TokenTable(slots, 512)
    worker = SuffixWorker(gamma, config, table, drafts_on_device=True)
    spec = Speculation([worker])
    phrases = [[rng.randrange(40) for _ in range(rng.randint(2, 6))] for _ in range(12)]
    finished = texts(rng, phrases, 10, 120)  # earlier requests in slot 0: their outputs enter the global index
    for i, seq in enumerate(finished):
        fed(spec, table, 0, seq, 30, launch=i)
    live = [texts(rng, phrases, 1, rng.choice([3, 8, 30, 200]))[0] for _ in range(slots - 1)]
    lens = []
    for row, seq in enumerate(live, start=1):
        fed(spec, table, row, seq, rng.randint(0, len(seq) - 1), launch=len(finished))
        lens.append(len(seq))
    rows = list(range(1, slots))
    params = [GREEDY if i % 3 else SAMPLED for i in range(len(rows))]
    inp = draft_input(spec, rows, lens, table, gamma, params)
    device = worker.draft(inp).tokens
    assert torch.equal(device, host_drafts(worker, inp))
    # The global index took part: without it some greedy request drafts otherwise.
    own_only = worker.draft(draft_input(spec, rows, lens, table, gamma, [SAMPLED] * len(rows))).tokens
    assert not torch.equal(own_only, device)
    held = worker.segments.held(None)
    assert held.shape[0] == len(worker.global_index.tokens) and held.tolist() == worker.global_index.tokens
    assert len(worker.global_index) > 0


def greedy_and_sampled_after_an_earlier_output() -> tuple[SuffixWorker, DraftInput]:
    """Two requests whose own tokens match nothing but whose suffix [4, 5] occurred in an earlier
    request's output [4..8]: row 1 greedy, row 2 sampled."""
    table = TokenTable(4, 64)
    worker = SuffixWorker(4, SuffixConfig(), table, drafts_on_device=True)
    spec = Speculation([worker])
    fed(spec, table, 0, [1, 2, 3, 4, 5, 6, 7, 8], 2, launch=1)
    fed(spec, table, 0, [9, 9], 1, launch=2)  # retires the first request's output [4..8] (after its prompt)
    fed(spec, table, 1, [20, 21, 4, 5], 3, launch=2)
    fed(spec, table, 2, [20, 21, 4, 5], 3, launch=2)
    return worker, draft_input(spec, [1, 2], [4, 4], table, 4, [GREEDY, SAMPLED], launch=4)


def test_a_draft_from_the_global_index_only_for_greedy_requests():
    """Greedy, it drafts the earlier continuation; sampled, it repeats its anchor; the device walk
    and the host walk agree."""
    worker, inp = greedy_and_sampled_after_an_earlier_output()
    device = worker.draft(inp).tokens
    assert device.tolist() == [[6, 7, 7, 7], [5, 5, 5, 5]]  # spec_factor 1: as many as matched
    assert host_drafts(worker, inp).tolist() == device.tolist()


def test_the_host_device_comparison_catches_a_planted_device_fault(monkeypatch):
    """Mutation: the device walk offers the global index to sampled requests too (its greedy mask
    planted all true). The host walk does not, so the comparison above must fail."""
    import specserve.speculative.suffix_worker as suffix_worker

    real = suffix_worker.staged
    monkeypatch.setattr(suffix_worker, "staged", lambda flags, *a: real([True] * len(flags), *a))
    worker, inp = greedy_and_sampled_after_an_earlier_output()
    device = worker.draft(inp).tokens
    assert device.tolist() == [[6, 7, 7, 7], [6, 7, 7, 7]]  # the fault took effect on the device...
    assert host_drafts(worker, inp).tolist() != device.tolist()  # ...and the host walk tells it apart


def test_segments_apply_a_change_two_launches_later_in_order():
    segments = DeviceSegments("cpu", capacity=4)
    segments.change(5, "append", [1, 2, 3])
    segments.change(4, "append", [7, 8])
    assert segments.held(6).tolist() == [7, 8, SEPARATOR]  # launch 5's change is not due yet
    assert segments.held(7).tolist() == [7, 8, SEPARATOR, 1, 2, 3, SEPARATOR]  # grown past its capacity
    segments.change(7, "evict", 3)
    segments.change(7, "append", [4, 4])
    assert segments.held(9).tolist() == [1, 2, 3, SEPARATOR, 4, 4, SEPARATOR]
    segments.change(9, "clear")
    assert segments.held(11).tolist() == []


def test_a_change_later_than_its_draft_is_refused():
    """Mutation of the ordering it relies on: a host party telling launch k's change after launch
    k + 2 drafted fails loudly instead of leaving the ranks' segments to the timing."""
    segments = DeviceSegments("cpu")
    segments.held(10)
    with pytest.raises(InternalError, match="launch 8's change arrived after launch 10's draft"):
        segments.change(8, "append", [1, 2])
    segments.change(9, "append", [1, 2])  # still due at launch 11


def test_forgetting_the_past_outputs_after_steps_without_a_suffix_draft():
    """Planned steps in which SUFFIX drafts nothing still release the device segments; a clear
    told after them (a benchmark's fresh start) is stamped no earlier than what they released,
    so the segments take it instead of refusing it as late."""
    table = TokenTable(4, 64)
    worker = SuffixWorker(4, SuffixConfig(), table, drafts_on_device=True)
    spec = Speculation([worker])
    fed(spec, table, 0, [1, 2, 3, 4, 5, 6], 2, launch=1)
    for launch in range(2, 8):  # planned, no drafter: only the step-begin hook runs
        spec.plan([None], [0], 4, launch=launch)
    worker.forget_outputs()
    assert worker.segments is not None and worker.segments.held(12).shape[0] == 0
