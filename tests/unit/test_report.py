"""The README's rendered figures agree with the committed result files they come from, and a
change to one digit of a result file shows as a disagreement (`python -m benchmarks report --check`)."""

from __future__ import annotations

import json
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
    assert report.differences(report.README, str(results)) != ""
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "report", "--check", "--results", str(results)], cwd=report.REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "disagree" in proc.stderr


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
