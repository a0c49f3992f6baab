"""The specserve command line: a one-line error and exit code 2 on bad input."""

from __future__ import annotations

import subprocess
import sys


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


def test_generate_prints_a_chat_completion():
    res = _run("generate", "--chat", "--prompt", "What is the capital of France?", "--max-new-tokens", "12",
               "--dtype", "float32", "--max-total-tokens", "2048")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout
