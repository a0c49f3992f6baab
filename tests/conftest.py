"""Shared fixtures: real engines on the embedded model and the transformers reference.

Every test outside tests/unit loads the real model or spawns processes and is marked `slow`
here (`-m "not slow"` runs the unit tests alone); tests/unit/conftest.py keeps unit tests off the
real model."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os

import pytest
import torch
import xdist_groups

from specserve.models.loader import default_model_path

PARSED: dict = {}  # (path, mtime) -> the LoadedModel parsed from it (parse_each_gguf_once)
UNIT_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "unit") + os.sep


def pytest_configure(config) -> None:
    """Under pytest-xdist (`-n auto`) each worker gets its share of the cores: torch's default of one
    thread per core in every worker would put two threads on each core, and OpenMP threads that
    spin waiting for a busy core slow both workers. Servers and ranks the tests spawn inherit it."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if not str(item.path).startswith(UNIT_TESTS):
            item.add_marker(pytest.mark.slow)


def pytest_xdist_auto_num_workers(config) -> int:
    return xdist_groups.auto_workers()


def pytest_xdist_make_scheduler(config, log):
    return xdist_groups.module_scheduling(config, log)


def _glibc():
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return libc if libc is not None and hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


GLIBC = _glibc()
M_ARENA_MAX = -8
if GLIBC is not None:
    # This process builds dozens of engines, each with threads of its own (the overlap loop, the copy
    # stream). glibc gives threads arenas of their own and keeps what is freed in them: with up to
    # 8 per core, the resident size of a whole run grew past 11 GB. Two arenas bound that.
    GLIBC.mallopt(M_ARENA_MAX, 2)


@pytest.fixture(autouse=True)
def return_freed_memory(request):
    """After each test that builds engines (outside tests/unit), what it freed goes back to the OS:
    glibc keeps freed heap memory for reuse, and engines of different shapes rarely reuse it."""
    yield
    if GLIBC is not None and not str(request.node.path).startswith(UNIT_TESTS):
        gc.collect()
        GLIBC.malloc_trim(0)


@pytest.fixture(scope="module", autouse=True)
def return_freed_memory_after_each_module(request):
    """The same once a module's own fixtures (shared engines) are torn down: autouse, so it is set
    up before them and torn down after them."""
    yield
    keep = {key: parsed for key, parsed in PARSED.items() if key[0] == os.path.abspath(default_model_path())}
    PARSED.clear()
    PARSED.update(keep)  # a module's other models (a larger real file) go with it
    if GLIBC is not None:
        gc.collect()
        GLIBC.malloc_trim(0)


@pytest.fixture(scope="session", autouse=True)
def no_weight_cache_unless_asked():
    """Every engine packs its file (--weight-cache auto means off here; servers the tests spawn
    inherit it): a test of packing or loading must see packing, not weights mapped from an earlier
    test's engine, and nothing goes into the user's cache. The cache's own tests name a folder."""
    from specserve import envs

    saved = os.environ.get(envs.WEIGHT_CACHE_DIR)
    os.environ[envs.WEIGHT_CACHE_DIR] = "off"
    yield
    if saved is None:
        os.environ.pop(envs.WEIGHT_CACHE_DIR, None)
    else:
        os.environ[envs.WEIGHT_CACHE_DIR] = saved


@pytest.fixture(scope="session", autouse=True)
def parse_each_gguf_once():
    """Engines built in this process share one parse of each GGUF file (reading and dequantizing
    it is most of an engine build); every engine still loads, shards and packs its own weights.
    The default model's parse stays for the session, another file's for its test module."""
    import specserve.models.loader as loader

    original = loader._load_gguf

    def load_once(path: str):
        key = (os.path.abspath(path), os.path.getmtime(path))
        if key not in PARSED:
            PARSED[key] = original(path)
        return PARSED[key]

    loader._load_gguf = load_once
    yield
    loader._load_gguf = original


@pytest.fixture(scope="session")
def model_path() -> str:
    from specserve.models.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def fp32_engine():
    from specserve import Engine

    engine = Engine(dtype="float32", max_total_tokens=16384, random_seed=1, speculative_algorithm="NONE")
    yield engine
    engine.scheduler.check_integrity()
    engine.shutdown()


@pytest.fixture(scope="module")
def fp32_spec_engines():
    """NGRAM and the shipped DSPARK drafter in fp32 with the fixed policy (every step drafts); per
    module, so that their memory is freed when the module's tests are done."""
    from specserve import Engine

    engines = {alg: Engine(dtype="float32", max_total_tokens=8192, speculative_algorithm=alg,
                           speculative_policy="fixed", random_seed=1) for alg in ("NGRAM", "DSPARK")}
    yield engines
    for engine in engines.values():
        engine.scheduler.check_integrity()
        engine.shutdown()


@pytest.fixture(scope="session")
def hf_model(model_path):
    import transformers
    folder, file = os.path.dirname(model_path), os.path.basename(model_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(model_path):
    import transformers
    folder, file = os.path.dirname(model_path), os.path.basename(model_path)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=file)


@pytest.fixture(scope="session")
def drafter_dir(tmp_path_factory) -> str:
    """A randomly initialised DSpark drafter for the embedded model (block size 4)."""
    from specserve.cli import main as cli_main

    out = tmp_path_factory.mktemp("drafter")
    assert cli_main(["init-drafter", "--out", str(out), "--block-size", "4", "--seed", "3"]) == 0
    return str(out)


@pytest.fixture
def checked(fp32_engine):
    """The shared fp32 engine, with KV integrity asserted after the test."""
    yield fp32_engine
    fp32_engine.scheduler.check_integrity()
