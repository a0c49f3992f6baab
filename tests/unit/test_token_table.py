"""NGRAM on the device (speculative/committed.py) proposes exactly what the host index does, and
its fixed-shape writes put committed tokens at their positions and the rest to scratch."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.speculative.ngram_worker import TokenHistory
from specserve.speculative.committed import TokenTable


@pytest.mark.parametrize("min_n,max_n,gamma", [(1, 4, 4), (2, 3, 2), (1, 1, 5), (3, 5, 3)])
def test_device_lookup_equals_the_host_index(min_n, max_n, gamma):
    rng = random.Random(min_n * 100 + max_n * 10 + gamma)
    rows, positions = 6, 80
    table = TokenTable(rows, positions)
    seqs = [[rng.randrange(5) for _ in range(rng.randrange(2, positions))] for _ in range(rows)]
    for row, seq in enumerate(seqs):
        table.write_sequence(row, seq)
    for _ in range(40):  # random anchors: every row's history cut at some length
        cuts = [rng.randrange(1, len(seq) + 1) for seq in seqs]
        want = []
        for seq, cut in zip(seqs, cuts):
            history = TokenHistory(max_n, min_n)
            history.extend(seq[:cut])
            want.append(history.match(gamma)[1])
        prefix = torch.tensor([c - 1 for c in cuts])  # the anchor (last token) at column S = cut - 1
        got = table.propose(torch.arange(rows), prefix, max(cuts) + 3, gamma, min_n, max_n)
        assert got.tolist() == want


def test_commits_land_at_their_positions_and_the_rest_at_scratch():
    table = TokenTable(3, 10)
    table.write_sequence(1, [7, 8, 9])
    table.write_sequence(2, [4, 4])
    # Row 1 commits 2 tokens of a 3-wide window, its new anchor at position 4; row 2 one token at 2.
    table.write(torch.tensor([1, 2]), torch.tensor([[5, 6, 99], [3, 98, 97]]), torch.tensor([2, 1]), torch.tensor([4, 2]))
    assert table.tokens[1, :5].tolist() == [7, 8, 9, 5, 6]
    assert table.tokens[2, :3].tolist() == [4, 4, 3]
    assert 99 not in table.tokens[:, : table.scratch].tolist()[1] and 98 not in table.tokens[2, : table.scratch].tolist()
