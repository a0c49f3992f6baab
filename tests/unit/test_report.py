"""The README's rendered figures agree with the committed result files they come from, and a
change to one digit of a result file shows as a disagreement (`python -m benchmarks report --check`)."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from benchmarks import report


def test_readme_figures_agree_with_their_result_files():
    assert report.differences() == "", "run `python -m benchmarks report` and commit the documents"


def test_every_renderer_has_exactly_one_part_in_the_documents():
    names = []
    for path in report.DOCUMENTS:
        with open(path) as f:
            names += [m.group("name") for m in report.BLOCK.finditer(f.read())]
    assert sorted(names) == sorted(report.RENDERERS)


@pytest.mark.parametrize("file, path", [("grammar.json", ("libraries", "llguidance", "compile_ms_median")),
                                        ("router.json", ("cache_aware", "second_turn_ttft_ms_p50")),
                                        ("tp_cost.json", ("generated_tokens_per_s", "tp1", "median")),
                                        ("soak.json", ("summary", "tokens_generated")),
                                        ("offline_bf16_kernels.json", ("specserve", "prefill_tok_s")),
                                        ("hicache_mtbench.json", ("hicache", "ttft_ms_p50"))])
def test_one_changed_digit_in_a_result_file_is_a_disagreement(tmp_path, file, path):
    results = tmp_path / "bench_results"
    shutil.copytree(report.RESULTS, results)
    data = json.loads((results / file).read_text())
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] += 1.0  # one more in the units digit
    (results / file).write_text(json.dumps(data))
    assert report.differences(results=str(results)) != ""  # the figure's part may live in README.md or docs/
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "report", "--check", "--results", str(results)], cwd=report.REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "disagree" in proc.stderr


def test_the_stale_accept_record_renders_under_its_name_before_issue_71(tmp_path):
    """A results folder from before the rename holds seed_failure.json: it renders alike, citing that name."""
    from benchmarks.render import engine, headline

    old = tmp_path / "bench_results"
    shutil.copytree(report.RESULTS, old)
    (old / "stale_accept.json").rename(old / "seed_failure.json")
    now = engine.render_stale_accept(report.RESULTS)
    assert "`bench_results/stale_accept.json`" in now
    assert engine.render_stale_accept(str(old)) == now.replace("stale_accept.json", "seed_failure.json")
    assert "`bench_results/seed_failure.json`" in headline.render_headline(str(old))


def test_a_part_without_a_renderer_is_an_error():
    with pytest.raises(ValueError, match="no renderer for part 'nothing'"):
        report.render_readme("<!-- render: nothing -->\n<!-- /render -->\n")


def test_provenance_names_the_machine_commit_and_marks_a_drafter_that_is_not_shipped():
    shipped = report.drafter_checksum(f"{report.REPO}/{report.SHIPPED_DRAFTER}")
    data = {"commit": "abc123", "date": "2026-12-02 16:00 UTC", "machine": {"description": "AMD EPYC, 2 cores"},
            "drafter": {"path": "elsewhere", "sha256": "0" * 64}}
    line = report.provenance(data, "x.json")
    assert line.startswith("From `bench_results/x.json` (AMD EPYC, 2 cores; commit abc123, date 2026-12-02 16:00 UTC")
    assert "**drafter elsewhere is not the shipped one**" in line
    data["drafter"]["sha256"] = shipped
    assert line != report.provenance(data, "x.json") and "; the shipped drafter)." in report.provenance(data, "x.json")
    assert "commit and date not recorded" in report.provenance({"machine": "AMD EPYC"}, "old.json")


def test_a_record_from_a_dirty_tree_is_refused(tmp_path):
    """A figure measured on uncommitted code cannot be rebuilt: the report fails rather than cite it
    (planted: the README's at-size record marked dirty)."""
    results = tmp_path / "bench_results"
    shutil.copytree(report.RESULTS, results)
    data = json.loads((results / "models_at_size.json").read_text())
    assert not data["commit"].endswith("-dirty")
    data["commit"] += "-dirty"
    (results / "models_at_size.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="models_at_size.json: measured at .*-dirty, a tree with uncommitted changes"):
        report.differences(results=str(results))


def test_a_ratio_is_a_gain_only_when_every_run_beats_every_baseline_run():
    from benchmarks.render.common import versus

    assert versus(1.06, [115.9, 119.9, 111.8], [108.6, 113.0, 109.2]) == "1.06x, within noise"  # ranges overlap
    assert versus(1.20, [119.6, 131.7, 123.5], [102.0, 105.2, 103.1]) == "**1.20x**"
    assert versus(0.50, [50.0, 52.0], [100.0, 104.0]) == "0.50x"


def test_tp_cost_calls_overlapping_arms_within_noise():
    from benchmarks.tp_cost import compare, spread

    assert compare(spread([12.6, 11.0]), spread([11.6, 12.0]))["within_noise"] is True
    slower = compare(spread([11.0, 11.5]), spread([30.0, 32.3]))
    assert slower["within_noise"] is False and slower["ratio"] < 0.4


def test_commit_is_dirty_for_code_changes_but_not_for_result_files(tmp_path, monkeypatch):
    from specserve.bench import provenance as prov

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "bench_results").mkdir()
    (tmp_path / "bench_results" / "r.json").write_text("{}")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    monkeypatch.setattr(prov, "REPO", str(tmp_path))
    head = prov.commit()
    assert len(head) == 40
    (tmp_path / "bench_results" / "r.json").write_text('{"a": 1}')  # a bench wrote its result
    assert prov.commit() == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert prov.commit() == head + "-dirty"


def test_readme_is_a_front_page_under_200_lines():
    with open(report.README) as f:
        lines = f.read().splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines; move detail to docs/"
    first = "\n".join(lines[:60])
    assert "specserve serve --model-path ./" in first, "a --model-path command with a path in the first screenful"
    assert "curl " in first, "a curl example in the first screenful"
    assert "bash scripts/setup.sh --test && .venv/bin/python -m pytest -q tests" in first, "the test command"
    assert "<!-- render: headline -->" in first


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: str) -> set[str]:
    with open(path) as f:
        text = re.sub(r"^```.*?^```", "", f.read(), flags=re.S | re.M)
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} +(.+?) *$", text, re.M)}


def _links(path: str) -> list[str]:
    with open(path) as f:
        text = re.sub(r"^ *```.*?^ *```", "", f.read(), flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    return re.findall(r"\]\(([^)\s]+)\)", text)


def _broken_links(paths: list[str]) -> list[str]:
    broken = []
    for path in paths:
        for link in _links(path):
            if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
                continue
            target, _, anchor = link.partition("#")
            file = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
            where = f"{os.path.relpath(path, report.REPO)}: ({link})"
            if not os.path.exists(file):
                broken.append(f"{where}: no such file")
            elif anchor and file.endswith(".md") and anchor not in _anchors(file):
                broken.append(f"{where}: no heading with that anchor")
    return broken


def test_every_relative_link_in_the_readme_and_docs_points_to_a_file_and_heading():
    paths = [report.README, *sorted(glob.glob(os.path.join(report.DOCS, "*.md")))]
    assert len(paths) > 5
    assert _broken_links(paths) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# A page\n\n## Some `code` here: yes\n")
    (tmp_path / "b.md").write_text("[ok](a.md#some-code-here-yes) [self](#b) [gone](c.md) [bad](a.md#nothing)\n"
                                   "[web](https://example.com) `[not](a link)`\n\n# B\n")
    broken = _broken_links([str(tmp_path / "b.md")])
    assert len(broken) == 2 and "(c.md): no such file" in broken[0] and "(a.md#nothing)" in broken[1]


def test_the_headline_figures_come_from_their_files(tmp_path):
    from benchmarks.render.headline import render_headline

    results = tmp_path / "bench_results"
    shutil.copytree(report.RESULTS, results)
    before = render_headline(str(results))
    assert "speculation off on both sides" in before and "neither side speculating" in before
    data = json.loads((results / "serving_mtbench.json").read_text())
    for row in data["summary"]:
        if row["target"] == "specserve-none" and "throughput_ratio" in row:
            row["throughput_ratio"]["median"] += 1.0
    (results / "serving_mtbench.json").write_text(json.dumps(data))
    assert render_headline(str(results)) != before
