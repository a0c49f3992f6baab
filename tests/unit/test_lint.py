"""ruff's lint (pyflakes, pycodestyle, import order, bugbear; `[tool.ruff]` in pyproject.toml) and its
format check pass on the core packages; a planted unused import and a planted badly formatted line show
that each check runs and can fail."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import specserve

SOURCE = os.path.dirname(os.path.abspath(specserve.__file__))
REPO = os.path.dirname(SOURCE)


def ruff(*args: str, cwd: str = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_core_packages_pass_ruff():
    proc = ruff("check", "specserve")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_core_packages_are_formatted():
    proc = ruff("format", "--check", "specserve")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def copy_with_planted_line(tmp_path, line: str) -> None:
    shutil.copytree(SOURCE, tmp_path / "specserve", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(REPO, "pyproject.toml"), tmp_path / "pyproject.toml")
    with open(tmp_path / "specserve" / "names.py", "a") as f:
        f.write(line)


def test_planted_badly_formatted_line_fails_the_format_check(tmp_path):
    copy_with_planted_line(tmp_path, "\n\nPLANTED = {'a':1}\n")
    proc = ruff("format", "--check", "specserve", cwd=str(tmp_path))
    assert proc.returncode == 1 and "specserve/names.py" in proc.stdout, proc.stdout + proc.stderr


def test_planted_unused_import_fails_the_lint(tmp_path):
    copy_with_planted_line(tmp_path, "\nimport json\n")
    proc = ruff("check", "specserve", "--output-format", "concise", cwd=str(tmp_path))
    assert proc.returncode == 1 and "F401" in proc.stdout
