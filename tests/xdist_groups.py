"""How the suite is split between pytest-xdist workers (`-n auto`, the hooks in conftest.py).

Each test module runs whole on one worker, so the engines a module shares are built once; the
modules whose engines peak at 7-12 GB resident (measured with VmHWM per module) form one group,
run in turn on one worker, so that two of them never meet in 24 GB. (pytest 9 ignores the node ids
xdist's own `loadgroup` rewrites, hence a scheduler of our own.)"""

from __future__ import annotations

import os

LARGE_MEMORY_MODULES = frozenset(f"tests/integration/{name}.py" for name in (
    "test_host_waits", "test_qwen2_gguf", "test_gemma3_gguf", "test_standalone_spec"))
GIB_PER_WORKER = 10


def memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def auto_workers() -> int:
    """A worker per core, as far as memory allows one per GIB_PER_WORKER."""
    return max(1, min(os.cpu_count() or 1, int(memory_gib() // GIB_PER_WORKER)))


def worker_group(nodeid: str) -> str:
    """The tests that run in turn on one worker: a module, or all the large-memory modules."""
    module = nodeid.split("::", 1)[0]
    return "large-memory" if module in LARGE_MEMORY_MODULES else module


def module_scheduling(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return ModuleScheduling(config, log)
