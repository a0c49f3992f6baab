"""The soak's verdict comes from every rank's measured figures: each planted bad figure fails it."""

from __future__ import annotations

import copy

import pytest

from specserve.bench.soak import measured_figures


def _ranks() -> list[dict]:
    checker = {"checks": 40, "events_recorded": 120, "events_checked": 120, "divergences": 0, "error": None,
               "alive": True, "mean_check_ms": 2.5}
    return [{"rank": r, "collective_timeouts": 0, "consensus": dict(checker)} for r in (0, 1)]


def test_clean_figures_pass_and_are_reported():
    figures, problems = measured_figures(_ranks(), checker_on=True)
    assert problems == []
    assert figures["rank_divergences"] == 0 and figures["hangs"] == 0 and figures["checker_alive"] is True
    assert figures["events_checked"] == figures["events_recorded"] == 120 and figures["consensus_checks"] == 40


@pytest.mark.parametrize("rank, key, value, message", [
    (1, "alive", False, "checker of rank 1 was not alive"),
    (1, "events_checked", 119, "checked 119 of 120 events"),
    (0, "checks", 0, "in 0 rounds"),
    (0, "events_recorded", 0, "checked 120 of 0 events"),
    (1, "divergences", 1, "1 rank divergence(s)"),
])
def test_each_bad_checker_figure_fails_the_soak(rank, key, value, message):
    ranks = _ranks()
    ranks[rank]["consensus"][key] = value
    _, problems = measured_figures(ranks, checker_on=True)
    assert any(message in p for p in problems), problems


def test_timeouts_a_missing_checker_and_missing_figures_fail():
    ranks = _ranks()
    ranks[1]["collective_timeouts"] = 2
    assert "2 collective timeout(s)" in measured_figures(ranks, checker_on=True)[1]
    ranks = copy.deepcopy(_ranks())
    ranks[1]["consensus"] = None
    assert any("rank 1 ran without" in p for p in measured_figures(ranks, checker_on=True)[1])
    figures, problems = measured_figures(None, checker_on=True)
    assert figures["rank_divergences"] is None and problems


def test_figures_not_measured_are_null_not_zero():
    ranks = [{"rank": 0, "collective_timeouts": 0, "consensus": None}]
    figures, problems = measured_figures(ranks, checker_on=False)
    assert figures == {"rank_divergences": None, "hangs": None} and problems == []
