"""A drafter's history and card: every extension is a row, served figures are recorded on the latest one."""

from __future__ import annotations

import os
import shutil

import pytest

from specserve.assets import default_drafter_path
from specserve.train.model_card import read_train_state, record_served, save_train_state


def _report(accept: float, first: float, every: float, requests: int) -> dict:
    return {"served": {"accept_length": accept, "first_draft_accepted": first},
            "every_anchor": {"accept_length": every}, "requests": requests}


def test_extensions_and_served_figures_reach_the_card(tmp_path):
    shutil.copy(os.path.join(default_drafter_path(), "config.json"), tmp_path / "config.json")
    save_train_state(str(tmp_path), {"steps": 30, "extensions": [
        {"date": "2026-01-01", "steps": 10, "train_answer_tokens": 1000},
        {"date": "2026-01-02", "steps": 30, "train_answer_tokens": 4000, "note": "second run",
         "dev": {"new_dev_accept_length": 1.5, "shipped_dev_accept_length": 1.25, "promoted": True}}]})
    assert "None recorded yet." in (tmp_path / "README.md").read_text()

    record_served(str(tmp_path), {"mt-bench": _report(1.61234, 0.4, 1.58, 80)}, {"max_new_tokens": 256, "dtype": "bfloat16"})
    state = read_train_state(str(tmp_path))
    assert "served" not in state["extensions"][0]
    assert state["extensions"][1]["served"]["mt-bench"] == {
        "accept_length": 1.6123, "first_draft_accepted": 0.4, "every_anchor_accept_length": 1.58, "prompts": 80,
        "max_new_tokens": 256, "dtype": "bfloat16"}
    card = (tmp_path / "README.md").read_text()
    assert "| 1 | 2026-01-02 | 4000 | 30 |" in card and "1.500 / 1.250 | yes |" in card
    assert "| 1 | mt-bench | 80 | 256 | bfloat16 | 1.612 | 40.0% | 1.580 |" in card
    assert "- second run" in card


def test_a_missing_state_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="train_state.json not found"):
        read_train_state(str(tmp_path))
