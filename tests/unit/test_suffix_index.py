"""The SUFFIX index against a brute-force suffix tree, and the worker's global index and budget."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.args import ServerArgs
from specserve.errors import ConfigError
from specserve.sampling_params import SamplingParams
from specserve.speculative import suffix_index as suffix_module
from specserve.speculative.suffix_index import SuffixIndex
from specserve.speculative.speculation import Speculation
from specserve.speculative.suffix_worker import SuffixConfig, SuffixWorker
from specserve.speculative.worker import DraftInput


def brute_force(segments: list[list[int]], context: list[int], depth: int, limit: int, min_prob: float):
    """The suffix tree's answer by definition: every occurrence (before the context's own end) of
    the longest suffix of `context` up to `depth`, at least 2 long, inside one segment; then the most
    frequent next token (ties to the newest occurrence's) among those still on the path, while its share of
    all occurrences is at least min_prob."""
    best, ends = 0, []
    for s, seg in enumerate(segments):
        own = s == len(segments) - 1 and seg[-len(context):] == context
        for p in range(1, len(seg) - (1 if own else 0)):
            n = 0
            while n < min(depth, len(context)) and p - n >= 0 and seg[p - n] == context[-1 - n]:
                n += 1
            if n >= 2 and n > best:
                best, ends = n, [(s, p)]
            elif n >= 2 and n == best:
                ends.append((s, p))
    drafted: list[int] = []
    live = ends
    for step in range(1, limit + 1):
        nxt = [segments[s][p + step] for s, p in live if p + step < len(segments[s])]
        if not nxt:
            break
        newest = {t: max(i for i, u in enumerate(nxt) if u == t) for t in nxt}  # live: oldest first
        tok = max(set(nxt), key=lambda t: (nxt.count(t), newest[t]))
        if nxt.count(tok) / len(ends) < min_prob:
            break
        drafted.append(tok)
        live = [(s, p) for s, p in live if p + step < len(segments[s]) and segments[s][p + step] == tok]
    return best if ends else 0, drafted


def random_segments(rng: random.Random, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randrange(5, 60))] for _ in range(rng.randrange(1, 5))]


@pytest.mark.parametrize("seed", range(40))
def test_drafts_are_the_brute_force_suffix_trees(seed):
    """Random segments over a small vocabulary (many repeats), the last one open and the context its
    tail: the index's match and draft are the definition's."""
    rng = random.Random(seed)
    segments = random_segments(rng, vocab=4 if seed % 2 else 7)
    depth, limit, min_prob = rng.choice([3, 6, 24]), rng.randrange(1, 9), rng.choice([0.0, 0.1, 0.4])
    index = SuffixIndex(max_depth=depth, max_candidates=1000)
    for seg in segments[:-1]:
        index.append_segment(seg)
    index.extend(segments[-1])
    context = segments[-1][-depth - 1:]
    got = index.draft(context, limit, min_prob)
    want_match, want = brute_force(segments, context, depth, limit, min_prob)
    assert (got.match_len, list(got.tokens)) == (want_match, want)
    assert all(a >= b for a, b in zip(got.probs, got.probs[1:])) and all(p >= min_prob for p in got.probs)


def test_a_planted_latest_occurrence_rule_fails_the_brute_force(monkeypatch):
    """The walk's frequency rule is what the brute-force test holds: drafting from the latest
    occurrence alone (prompt lookup's rule) disagrees on some random case."""

    def latest_only(self, ends, limit, min_prob, match_len):
        return original(self, ends[:1], limit, 0.0, match_len)  # ends are newest first

    original = SuffixIndex._walk
    monkeypatch.setattr(SuffixIndex, "_walk", latest_only)
    mismatches = 0
    for seed in range(40):
        rng = random.Random(seed)
        segments = random_segments(rng, vocab=4)
        index = SuffixIndex(max_depth=6, max_candidates=1000)
        for seg in segments[:-1]:
            index.append_segment(seg)
        index.extend(segments[-1])
        context = segments[-1][-7:]
        mismatches += list(index.draft(context, 6).tokens) != brute_force(segments, context, 6, 6, 0.0)[1]
    assert mismatches > 0


def test_the_longest_suffix_decides_and_counts_give_the_probabilities():
    index = SuffixIndex()
    for seg in ([1, 2, 3, 9], [5, 2, 3, 7], [5, 2, 3, 7], [8, 2, 3, 4]):
        index.append_segment(seg)
    short = index.draft([0, 2, 3], 3)  # "2 3" occurs 4 times: 7 twice, 9 and 4 once
    assert (short.match_len, short.tokens, short.probs) == (2, (7,), (0.5,))
    long = index.draft([5, 2, 3], 3)  # "5 2 3" twice, both followed by 7
    assert (long.match_len, long.tokens, long.probs) == (3, (7,), (1.0,))
    assert index.draft([0, 2, 3], 3, min_prob=0.6).tokens == ()  # below the floor
    assert index.draft([6, 6], 3).tokens == ()  # never seen


def test_no_match_or_draft_crosses_a_segment_boundary():
    index = SuffixIndex()
    index.append_segment([1, 2])
    index.append_segment([3, 4, 5])
    assert index.draft([0, 2], 4).tokens == ()  # "2" ended its segment: nothing follows
    assert index.draft([0, 1, 2], 4).tokens == ()
    assert index.draft([0, 3, 4], 4).tokens == (5,)


def test_the_spec_factor_bounds_the_draft_by_the_match():
    index = SuffixIndex()
    index.append_segment(list(range(40)))
    assert len(index.draft([7, 8], 15, spec_factor=1.0).tokens) == 2
    assert len(index.draft([5, 6, 7, 8], 15, spec_factor=1.0).tokens) == 4
    assert index.draft([5, 6, 7, 8], 15, spec_factor=2.0).tokens == tuple(range(9, 17))


def test_eviction_drops_the_oldest_segments_entries():
    index = SuffixIndex()
    index.append_segment([1, 2, 3])
    index.append_segment([4, 5, 6])
    assert index.evict_oldest() == 3
    assert len(index) == 3 and index.draft([0, 1, 2], 3).tokens == ()
    assert (1, 2) not in index.index and index.draft([0, 4, 5], 3).tokens == (6,)


def worker_input(spec: Speculation, rows: list[int], gamma: int, temperature: float = 0.0) -> DraftInput:
    n = len(rows)
    return DraftInput(torch.tensor(rows), torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64),
                      torch.zeros(n, dtype=torch.int64), [SamplingParams(temperature=temperature)] * n, [0] * n, gamma,
                      requests=[spec.requests[r] for r in rows])


def test_a_finished_output_drafts_for_the_next_request_and_the_budget_holds():
    """A slot's output enters the global index when its next request starts; the index keeps at most
    its budget of tokens, the oldest outputs evicted."""
    worker = SuffixWorker(4, SuffixConfig(cache_tokens=12))
    spec = Speculation([worker])  # keeps each slot's RequestTokens, which the worker reads
    answer = [50, 51, 52, 53, 54, 55, 56, 57]
    spec.commit_tokens(0, [1, 2, 3, answer[0]], restart=True, new=1)
    spec.commit_tokens(0, answer[1:], restart=False)
    spec.commit_tokens(0, [9, 8, 7, answer[0]], restart=True, new=1)  # the same task again
    spec.commit_tokens(0, answer[1:3], restart=False)
    assert worker.global_index.tokens[:-1] == answer  # the first request's output only
    drafts = worker.draft(worker_input(spec, [0], 4)).tokens.tolist()[0]
    assert drafts[:3] == answer[3:6]  # a 3-token match, spec factor 1: 3 drafts (then filler)
    assert worker.hints([spec.requests[0]]) == [(1, 3)]  # matches of 2-3 tokens: bucket 1
    # a sampled request drafts from its own tokens only (its seeded tokens then never depend on
    # earlier requests): here nothing
    assert worker.hints([spec.requests[0]], greedy=[False]) == [(0, 0)]
    assert worker.draft(worker_input(spec, [0], 4, temperature=0.7)).tokens.tolist()[0][:3] != answer[3:6]
    for n in range(3):  # more outputs than the budget
        spec.commit_tokens(0, [n, 100 + n, 200 + n], restart=True, new=1)
        spec.commit_tokens(0, [300 + n, 400 + n, 500 + n], restart=False)
    spec.commit_tokens(0, [0, 1], restart=True, new=1)
    assert len(worker.global_index) <= 12 and 50 not in worker.global_index.tokens


def test_the_flags_are_checked():
    bad = {"max_tree_depth": 1, "max_spec_factor": 0.0, "min_token_prob": 1.5, "cache_tokens": -1}
    for name, value in bad.items():
        with pytest.raises(ConfigError, match=f"speculative_suffix_{name}"):
            ServerArgs(**{f"speculative_suffix_{name}": value})


def test_memory_per_token_is_bounded():
    """The index's Python objects per held token (tracemalloc): a list slot and an index entry, so
    well under a kilobyte; the figure per million tokens is the bench's (bench suffix-memory)."""
    per_token = suffix_module.measure_bytes_per_token(20_000, seed=0)
    assert 8 < per_token < 400
