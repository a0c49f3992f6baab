"""How the suite is split between pytest-xdist workers (tests/xdist_groups.py)."""

from __future__ import annotations

import os

import xdist_groups

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_module_is_one_group_and_the_large_memory_modules_share_one():
    assert xdist_groups.worker_group("tests/unit/test_args.py::test_x[a-b]") == "tests/unit/test_args.py"
    assert xdist_groups.worker_group("tests/unit/test_args.py::test_y") == "tests/unit/test_args.py"
    groups = {xdist_groups.worker_group(f"{module}::test_x") for module in xdist_groups.LARGE_MEMORY_MODULES}
    assert groups == {"large-memory"}


def test_every_large_memory_module_exists():
    """A renamed module would silently leave the group and meet another large one in memory."""
    for module in xdist_groups.LARGE_MEMORY_MODULES:
        assert os.path.isfile(os.path.join(REPO, module)), module


def test_workers_fit_the_cores_and_the_memory():
    workers = xdist_groups.auto_workers()
    assert 1 <= workers <= (os.cpu_count() or 1)
    assert workers == 1 or workers * xdist_groups.GIB_PER_WORKER <= xdist_groups.memory_gib()
