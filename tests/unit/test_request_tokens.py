"""Each request slot's RequestTokens (speculative/committed.py): the one host record of a request's
committed tokens that the drafters read as views, each drafter's state of the request kept with it.
The drafters bring their state up to date when asked, so a state caught up late must be the state
fed commit by commit."""

from __future__ import annotations

import random

import pytest

from specserve.speculative import suffix_worker
from specserve.speculative.ngram_worker import NgramWorker, TokenHistory
from specserve.speculative.speculation import Speculation
from specserve.speculative.suffix_index import SuffixIndex
from specserve.speculative.suffix_worker import SuffixConfig, SuffixWorker


def _commits(rng: random.Random, n: int) -> list[list[int]]:
    """A prompt, then commits of 1 to 6 tokens from a small vocabulary (so suffixes repeat)."""
    return [[rng.randrange(12) for _ in range(rng.randint(5, 30))]] + [
        [rng.randrange(12) for _ in range(rng.randint(1, 6))] for _ in range(n)
    ]


def _scan_match(tokens: list[int], gamma: int, max_n: int = 4) -> tuple[int, list[int]]:
    """NGRAM's proposal by a plain scan: the longest suffix (max_n down to 1) with an earlier
    occurrence that has a token after it, the latest such; its continuation, the last repeated."""
    for n in range(min(max_n, len(tokens) - 1), 0, -1):
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == tokens[len(tokens) - n :]]
        if starts:
            follow = tokens[starts[-1] + n : starts[-1] + n + gamma]
            return n, follow + [follow[-1]] * (gamma - len(follow))
    return 0, [tokens[-1]] * gamma


def test_the_drafters_read_one_list_and_keep_their_state_with_the_request():
    ngram, suffix = NgramWorker(4), SuffixWorker(4)
    spec = Speculation([ngram, suffix])
    spec.commit_tokens(0, [1, 2, 3, 1, 2], restart=True, new=1)
    request = spec.requests[0]
    ngram.hints([request]), suffix.hints([request])
    assert ngram.history(request).tokens is request.tokens  # a view, never a copy
    assert set(request.drafters) == {ngram.name, suffix.name}
    spec.commit_tokens(0, [3], launch=1)
    assert request.tokens == [1, 2, 3, 1, 2, 3] and suffix.slot(request).index.tokens == request.tokens
    spec.commit_tokens(0, [7, 8, 9], restart=True, new=1, launch=2)  # the slot's next request
    assert spec.requests[0] is not request and spec.requests[0].drafters == {}


def test_a_state_caught_up_late_is_the_state_fed_commit_by_commit():
    """NGRAM's index and SUFFIX's, asked only now and then, give what a scan of the tokens and a
    suffix index fed at every commit give, across restarts."""
    rng = random.Random(7)
    ngram, suffix = NgramWorker(4), SuffixWorker(5, SuffixConfig(scope="request"))
    spec = Speculation([ngram, suffix])
    for request_no in range(4):
        commits = _commits(rng, 40)
        spec.commit_tokens(0, commits[0], restart=True, new=1, launch=request_no)
        fed_suffix = SuffixIndex(suffix.config.max_depth)
        fed_suffix.extend(commits[0])
        for step, tokens in enumerate(commits[1:]):
            spec.commit_tokens(0, tokens, launch=request_no)
            fed_suffix.extend(tokens)
            if step % 7:  # most steps ask nothing
                continue
            request = spec.requests[0]
            assert ngram.history(request).match(4) == _scan_match(fed_suffix.tokens, 4)
            context = fed_suffix.tokens[-suffix.config.max_depth - 1 :]
            expected = fed_suffix.draft(context, 5, suffix.config.min_prob, suffix.config.spec_factor)
            assert suffix.proposal(request, 5) == expected


@pytest.mark.parametrize("stale", ["ngram", "suffix"])
def test_the_catch_up_check_is_not_blind(monkeypatch, stale):
    """Mutation: a drafter's index that stops catching up (indexes nothing new) is caught above."""
    if stale == "ngram":
        monkeypatch.setattr(TokenHistory, "catch_up", lambda self: self)
    else:
        monkeypatch.setattr(suffix_worker._Slot, "catch_up", lambda self, tokens: self)
    with pytest.raises(AssertionError):
        test_a_state_caught_up_late_is_the_state_fed_commit_by_commit()
