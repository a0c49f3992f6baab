"""ruff's lint (pyflakes, pycodestyle, import order, bugbear; `[tool.ruff]` in pyproject.toml) passes
on the core packages, and a planted unused import shows that the check runs and can fail."""

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


def test_planted_unused_import_fails_the_lint(tmp_path):
    shutil.copytree(SOURCE, tmp_path / "specserve", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(REPO, "pyproject.toml"), tmp_path / "pyproject.toml")
    with open(tmp_path / "specserve" / "names.py", "a") as f:
        f.write("\nimport json\n")
    proc = ruff("check", "specserve", "--output-format", "concise", cwd=str(tmp_path))
    assert proc.returncode == 1 and "F401" in proc.stdout
