"""The serving walk over per-anchor accept counts: anchors where serving places them."""

import torch

from specserve.train.serving_walk import AcceptTally, serving_walk


def test_walk_places_each_anchor_after_the_accepted_run():
    # Response positions 10..19 (prompt_len 10, length 20); accepts[S - 10] per anchor S.
    accepts = torch.tensor([2, 0, 0, 3, 1, 0, 0, 0, 1, 0])
    # S=10 accepts 2 -> S=13 accepts 3 -> S=17 accepts 0 -> S=18 accepts 1 -> S=20: done.
    assert serving_walk(accepts, 10, 20) == [2, 3, 0, 1]


def test_tally_pools_walk_and_every_anchor():
    tally = AcceptTally(block_size=4)
    accepts = torch.tensor([2, 0, 0, 3, 1, 0, 0, 0, 1, 0])
    tally.add(accepts, serving_walk(accepts, 10, 20))
    s = tally.summary()
    assert s["serving_walk"]["steps"] == 4 and s["serving_walk"]["accept_length"] == 1 + 6 / 4
    assert s["serving_walk"]["per_slot_survival"] == [0.75, 0.5, 0.25, 0.0]
    assert s["every_anchor"]["anchors"] == 10 and s["every_anchor"]["accept_length"] == 1 + 7 / 10
    assert s["every_anchor"]["first_draft_accepted"] == 0.4
