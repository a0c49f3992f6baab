"""One held-out set for the whole drafter line: the card's column shows only the line-wide figure,
each row's weights are found in git history by their step count, and the set is the line's keys
in the sources it trained on."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

from specserve.assets import default_drafter_path
from specserve.train.corpus_store import Pair
from benchmarks.line_score import line_pairs, line_sources, match_rows, record_line, weight_versions
from specserve.train.model_card import read_train_state, save_train_state


def _line(accept: float, blocks: int = 768) -> dict:
    return {"accept_length": accept, "blocks": blocks, "sequences": 48, "keys": 48, "sources": ["sharegpt-greedy"],
            "anchors_per_seq": 16, "seed": 1, "precision": "bfloat16", "weights": "abc1234"}


def _own(accept: float, blocks: int) -> dict:
    return {"after": {"accept_length": accept, "blocks": blocks}}


def test_the_card_shows_the_line_wide_figure_and_a_dash_where_there_is_none(tmp_path):
    shutil.copy(os.path.join(default_drafter_path(), "config.json"), tmp_path / "config.json")
    save_train_state(str(tmp_path), {"steps": 30, "extensions": [
        {"date": "2026-01-01", "steps": 10, "held_out_teacher_forced": _own(1.893, 768), "held_out_line": _line(1.9)},
        {"date": "2026-01-02", "steps": 20, "held_out_teacher_forced": _own(1.777, 768)},
        {"date": "2026-01-03", "steps": 30, "held_out_teacher_forced": _own(1.927, 192), "held_out_line": _line(1.85)}]})
    card = (tmp_path / "README.md").read_text()
    assert "| held-out TF (line, 768 blocks) |" in card
    rows = [line for line in card.splitlines() if line.startswith("| 0 |") or line.startswith("| 1 |")
            or line.startswith("| 2 |")]
    assert "| 1.900 |" in rows[0] and "| 1.850 |" in rows[2]
    assert "| - |" in rows[1] and "1.777" not in card  # a run's own score on its own set never stands in
    assert "1.927" not in card and "1.893" not in card
    assert "48 sequences of sharegpt-greedy for 48 keys, 16 random anchors each (seed 1), bfloat16" in card


def test_a_figure_on_another_block_count_says_so(tmp_path):
    shutil.copy(os.path.join(default_drafter_path(), "config.json"), tmp_path / "config.json")
    save_train_state(str(tmp_path), {"steps": 20, "extensions": [
        {"steps": 10, "held_out_line": _line(1.9)}, {"steps": 20, "held_out_line": _line(1.8, 192)}]})
    card = (tmp_path / "README.md").read_text()
    assert "| held-out TF (line) |" in card and "| 1.900 (768 blocks) |" in card and "| 1.800 (192 blocks) |" in card


def test_record_line_writes_every_copy_and_drops_a_stale_figure(tmp_path):
    dirs = []
    for name in ("a", "b"):
        d = tmp_path / name
        d.mkdir()
        shutil.copy(os.path.join(default_drafter_path(), "config.json"), d / "config.json")
        save_train_state(str(d), {"steps": 20, "extensions": [{"steps": 10}, {"steps": 20, "held_out_line": _line(2.0)}]})
        dirs.append(str(d))
    record_line(dirs, [_line(1.7), None])
    for d in dirs:
        exts = read_train_state(d)["extensions"]
        assert exts[0]["held_out_line"]["accept_length"] == 1.7 and "held_out_line" not in exts[1]


def test_rows_match_weights_by_step_count_oldest_commit_of_the_last_blob():
    versions = [{"commit": "a", "blob": "x", "steps": 5}, {"commit": "b", "blob": "x", "steps": 5},
                {"commit": "c", "blob": "y", "steps": 9}]
    worktree = {"commit": "working tree", "blob": "z", "steps": 12}
    rows = match_rows([{"steps": 5}, {"steps": 9}, {"steps": 12}, {"steps": 7}], versions, worktree)
    assert [r and r["commit"] for r in rows] == ["a", "c", "working tree", None]


def test_the_set_is_the_lines_keys_in_the_sources_it_trained_on():
    state = {"held_out_keys": [1, 3], "extensions": [{"shards": ["00000-greedy.npz"]}, {}]}
    assert line_sources(state) == {"greedy"}

    class Store:
        def pairs(self, sources):
            every = [("greedy", Pair([0], [1], 1)), ("human", Pair([0], [2], 1)), ("greedy", Pair([0], [3], 2)),
                     ("greedy", Pair([0], [4], 3))]
            return [(src, p) for src, p in every if sources is None or src in sources]

        def sources(self):
            return ["greedy", "human"]

    pairs, sources = line_pairs(Store(), state)
    assert [p.answer_ids for p in pairs] == [[1], [4]] and sources == ["greedy"]


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True, capture_output=True)


def test_weight_versions_follow_renames_and_read_each_commits_steps(tmp_path):
    _git(tmp_path, "init", "-q")
    old, new = tmp_path / "old", tmp_path / "new" / "d"
    old.mkdir()
    (old / "model.safetensors").write_bytes(b"w0")
    (old / "config.json").write_text(json.dumps({"extra": {"training": {"steps": 5}}}))
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "run 0")
    new.parent.mkdir()
    _git(tmp_path, "mv", "old", "new/d")
    _git(tmp_path, "commit", "-qm", "rename")
    (new / "model.safetensors").write_bytes(b"w1")
    (new / "config.json").write_text(json.dumps({"extra": {"training_steps": 9}}))
    _git(tmp_path, "commit", "-qam", "extension 1")
    versions = weight_versions(str(new))
    assert [(v["path"], v["steps"]) for v in versions] == [
        ("old/model.safetensors", 5), ("new/d/model.safetensors", 5), ("new/d/model.safetensors", 9)]
    assert versions[0]["blob"] == versions[1]["blob"] != versions[2]["blob"]
