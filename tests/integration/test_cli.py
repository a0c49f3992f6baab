"""The specserve command line: a one-line error and exit code 2 on bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specserve.cli", *args], capture_output=True, text=True, timeout=300)


def test_bad_sampling_value_exits_2_with_one_line():
    res = _run("generate", "--top-p", "2")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "top_p" in lines[0] and "(0, 1]" in lines[0]


def test_missing_model_exits_2():
    res = _run("generate", "--model-path", "/no/such/model.gguf")
    assert res.returncode == 2
    assert "model_path" in res.stderr and res.stderr.count("\n") == 1


def test_unknown_flag_is_rejected():
    res = _run("generate", "--no-such-flag")
    assert res.returncode == 2
    assert "unrecognized arguments" in res.stderr


@pytest.mark.parametrize("argv, words", [
    (["serve", "--port", "70000"], "--port must be in ["),
    (["serve", "--max-request-bytes", "-1"], "--max-request-bytes must be >= 1"),
    (["generate", "--num-threads", "-1"], "num_threads must be >= 1"),
    (["serve", "--enable-hierarchical-cache", "--hicache-storage-backend", "file", "--hicache-storage-dir",
      "{file}/cache"], "hicache_storage_dir"),
])
def test_bad_flags_fail_before_the_model_loads_with_one_line(argv, words, tmp_path):
    (tmp_path / "file").write_text("a file, so no directory can be created under it")
    res = _run(*[a.format(file=tmp_path / "file") for a in argv])
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0].startswith(f"specserve {argv[0]}: error: ") and words in lines[0]


def test_generate_prints_a_chat_completion():
    res = _run("generate", "--chat", "--prompt", "What is the capital of France?", "--max-new-tokens", "12",
               "--dtype", "float32", "--max-total-tokens", "2048")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout


def test_profile_sps_writes_a_table_the_planner_reads(tmp_path):
    from specserve.speculative.planner import SpsTable

    out = tmp_path / "sps.json"
    res = _run("profile-sps", "--out", str(out), "--tokens", "1,6,12", "--repeats", "1", "--prefix-len", "16",
               "--dtype", "float32", "--max-total-tokens", "256")
    assert res.returncode == 0, res.stderr
    table = SpsTable.load(str(out))
    assert table.tokens == (1, 6, 12) and all(s > 0 for s in table.steps_per_second)
    assert table.meta["window"] == 6


def test_dspark_generate_from_the_command_line(tmp_path):
    assert _run("init-drafter", "--out", str(tmp_path), "--block-size", "3").returncode == 0
    res = _run("generate", "--chat", "--prompt", "What is the capital of France?", "--max-new-tokens", "12",
               "--dtype", "float32", "--max-total-tokens", "2048", "--speculative-algorithm", "DSPARK",
               "--speculative-draft-model-path", str(tmp_path), "--json",
               # fixed: the adaptive policy may rightly stop drafting with an untrained drafter
               "--speculative-policy", "fixed")
    assert res.returncode == 0, res.stderr
    assert '"spec_verify_ct"' in res.stdout and "Paris" in res.stdout
    bad = _run("init-drafter", "--out", str(tmp_path / "x"), "--block-size", "99")
    assert bad.returncode == 2 and "block-size" in bad.stderr
