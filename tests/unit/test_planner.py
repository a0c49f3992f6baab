"""Compact-verify budget planner and SPS tables."""

import json
import logging
import random

import pytest
import torch

from specserve.speculative.planner import SpsTable, VerifyPlanner, plan_verify_lens

FLAT = SpsTable((1, 1000), (50.0, 50.0))


def test_sps_interpolates_and_extrapolates_as_time_per_row():
    t = SpsTable((1, 10, 20), (100.0, 80.0, 40.0))
    assert t(1) == 100.0 and t(0) == 100.0
    assert t(15) == pytest.approx(60.0)
    assert t(40) == pytest.approx(20.0)  # beyond the table: 40 rows take twice as long as 20


@pytest.mark.parametrize("raw", [{"tokens": [], "steps_per_second": []}, {"tokens": [2, 1], "steps_per_second": [1, 1]},
                                 {"tokens": [1], "steps_per_second": [0]}, {"tokens": [1, 2]}])
def test_bad_tables_are_rejected(tmp_path, raw):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="sps table|SPS table"):
        SpsTable.load(str(path))


def test_table_round_trips(tmp_path):
    t = SpsTable((1, 8, 64), (90.0, 70.0, 12.5), {"window": 6})
    t.save(str(tmp_path / "t.json"))
    assert SpsTable.load(str(tmp_path / "t.json")) == t


def test_flat_speed_verifies_everything():
    conf = torch.rand(4, 5)
    assert plan_verify_lens(conf, FLAT) == [6] * 4


def test_time_linear_in_rows_verifies_only_anchors():
    rows = tuple(range(1, 40))
    linear = SpsTable(rows, tuple(1000.0 / t for t in rows))  # an extra row never pays for itself
    assert plan_verify_lens(torch.full((3, 4), 0.9), linear) == [1, 1, 1]


def test_budget_goes_to_the_most_likely_survivors():
    # Flat to 5 rows, then a cliff: the best budget is 3 draft rows for 2 requests.
    table = SpsTable((1, 5, 6), (100.0, 100.0, 1.0))
    conf = torch.tensor([[0.9, 0.9, 0.1], [0.5, 0.1, 0.1]])
    # survivals: r0 0.9, 0.81, 0.081; r1 0.5, 0.05, 0.005 -> top 3: r0 k0, r0 k1, r1 k0
    assert plan_verify_lens(conf, table) == [3, 2]


def test_picks_are_prefixes_and_ties_break_by_request():
    table = SpsTable((1, 5, 6), (100.0, 100.0, 1.0))
    assert plan_verify_lens(torch.full((3, 3), 0.5), table) == [2, 2, 1]  # equal survivals: earlier requests first
    rng = random.Random(0)
    for _ in range(50):
        conf = torch.tensor([[rng.random() for _ in range(5)] for _ in range(4)])
        cliff = rng.randint(4, 24)
        lens = plan_verify_lens(conf, SpsTable((1, cliff, cliff + 1), (10.0, 10.0, 0.1)))
        assert all(1 <= n <= 6 for n in lens) and sum(lens) <= cliff


def test_planner_without_table_verifies_everything_and_warns_once(caplog):
    planner = VerifyPlanner(None)
    with caplog.at_level(logging.WARNING):
        assert planner.verify_lens(torch.rand(2, 3)) is None
        assert planner.verify_lens(torch.rand(2, 3)) is None
    assert sum("SPS table" in r.message for r in caplog.records) == 1
