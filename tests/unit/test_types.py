"""mypy's type check (`[tool.mypy]` in pyproject.toml) passes on the core packages, and a planted
type error shows that the check runs and can fail."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import specserve

SOURCE = os.path.dirname(os.path.abspath(specserve.__file__))
REPO = os.path.dirname(SOURCE)
TIMEOUT_S = 600  # a cold cache checks the whole package (about a minute on two cores)


def mypy(*args: str, cwd: str = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def test_core_packages_pass_mypy():
    proc = mypy()  # files, exclusions and options: pyproject.toml
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_planted_type_error_fails_the_check(tmp_path):
    shutil.copytree(SOURCE, tmp_path / "specserve", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(REPO, "pyproject.toml"), tmp_path / "pyproject.toml")
    cache = os.path.join(REPO, ".mypy_cache")
    if os.path.isdir(cache):  # the check above left it: mypy rechecks only what the plant changes (by hash)
        shutil.copytree(cache, tmp_path / ".mypy_cache")
    with open(tmp_path / "specserve" / "cli.py", "a") as f:  # a module few others import
        f.write('\n\ndef _planted() -> int:\n    return "x"\n')
    proc = mypy("--cache-dir", str(tmp_path / ".mypy_cache"), cwd=str(tmp_path))
    assert proc.returncode == 1 and "[return-value]" in proc.stdout, proc.stdout + proc.stderr
    assert "specserve/cli.py" in proc.stdout
