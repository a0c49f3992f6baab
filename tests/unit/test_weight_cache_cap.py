"""The packed-weight cache's cap (models/packed_cache_cap.py, `--weight-cache-max-gib`) on small fake
entries: a new entry evicts the least recently used ones (a start that maps an entry makes it the most
recent), one the cap cannot hold is not written, the entry this process maps is never evicted, and
the write's one line is seen under the offline Engine's default logging. The mutations reorder
recency or drop the in-use guard, and the same checks catch each."""

from __future__ import annotations

import gc
import logging
import os
import time
import weakref

import pytest
import torch

import specserve.models.packed_cache as packed_cache
import specserve.models.packed_cache_cap as packed_cache_cap
from specserve.args import ServerArgs
from specserve.engine.start_cache import weight_cache_max_bytes
from specserve.kernels.linear import Q8, PackedLinear
from specserve.models.packed_cache import PackedWeightCache
from specserve.models.packed_cache_cap import CacheOutcome, describe_bytes

ENTRY = 256 << 10  # one fake model's packed bytes
HOLDS_ONE = ENTRY * 3 // 2  # a cap that holds one entry (and its file's few KiB of framing), not two
HOLDS_TWO = ENTRY * 5 // 2
CACHE_LOGGERS = (packed_cache.__name__, packed_cache_cap.__name__)


def kernels(nbytes: int = ENTRY) -> dict[str, PackedLinear]:
    """One packed linear of `nbytes` code bytes (never run: only saved and mapped)."""
    empty = torch.empty(0, dtype=torch.float16)
    codes = torch.arange(nbytes, dtype=torch.int64).to(torch.uint8)
    return {"layers.0.mlp.down_proj": PackedLinear(format=Q8, codes=codes, scale=empty, zero=empty, n=1, k=1)}


class Folder:
    """A cache folder and the fake model files whose entries it keeps."""

    def __init__(self, tmp_path, max_bytes: int):
        self.path, self.models, self.max_bytes = str(tmp_path / "packed"), tmp_path, max_bytes

    def cache(self, model: str) -> PackedWeightCache:
        path = self.models / f"{model}.gguf"
        if not path.exists():
            path.write_bytes(model.encode())
        return PackedWeightCache(self.path, str(path), 0, 1, torch.bfloat16, self.max_bytes)

    def write(self, model: str, nbytes: int = ENTRY) -> PackedWeightCache:
        cache = self.cache(model)
        cache.save(kernels(nbytes))
        return cache

    def models_kept(self) -> set[str]:
        return {name.split(".gguf-")[0] for name in os.listdir(self.path)}


def last_used(cache: PackedWeightCache, seconds_ago: float) -> None:
    """Plant an entry's history: written or mapped `seconds_ago`."""
    when = time.time_ns() - int(seconds_ago * 1e9)
    os.utime(cache.path, ns=(when, when))


def cache_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name in CACHE_LOGGERS]


@pytest.fixture(autouse=True)
def disk_room(monkeypatch):
    """The free-space guard is not under test: the test disk's free space must not decide."""
    monkeypatch.setattr(packed_cache, "HEADROOM_BYTES", 0)


def test_a_second_models_entry_evicts_the_first_under_a_cap_that_holds_one(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    folder = Folder(tmp_path, HOLDS_ONE)
    first = folder.write("first")
    assert folder.models_kept() == {"first"}
    second = folder.write("second")
    assert folder.models_kept() == {"second"}
    evictions = [r.getMessage() for r in cache_lines(caplog) if "evicted" in r.getMessage()]
    assert len(evictions) == 1 and first.path in evictions[0], evictions
    assert f"under the {describe_bytes(HOLDS_ONE)} cap" in evictions[0]
    assert second.outcome == CacheOutcome("writing", ENTRY)


def evicts_after_mapping_the_oldest(tmp_path) -> set[str]:
    """Entries "a" (written long ago) and "b" (since); a start maps "a" and ends; "c" is written
    under a cap that holds two. The models kept afterwards."""
    folder = Folder(tmp_path, HOLDS_TWO)
    last_used(folder.write("a"), seconds_ago=200)
    last_used(folder.write("b"), seconds_ago=100)
    start = folder.cache("a")
    assert start.load() is not None
    del start  # that start is over: its entry is no longer in use, only recently used
    gc.collect()
    folder.write("c")
    return folder.models_kept()


def test_eviction_takes_the_least_recently_used_entry_and_mapping_counts_as_use(tmp_path):
    assert evicts_after_mapping_the_oldest(tmp_path) == {"a", "c"}


@pytest.mark.parametrize("mutation", ["most recent first", "mapping not marked"])
def test_mutation_a_wrong_recency_evicts_the_entry_just_mapped(tmp_path, monkeypatch, mutation):
    if mutation == "most recent first":
        real = packed_cache_cap.least_recent_first
        monkeypatch.setattr(packed_cache_cap, "least_recent_first", lambda entries: real(entries)[::-1])
    else:
        monkeypatch.setattr(packed_cache, "mark_used", lambda path: None)
    assert evicts_after_mapping_the_oldest(tmp_path) == {"b", "c"}  # the check above fails on it


def test_an_entry_over_the_cap_is_not_written_and_one_line_says_so(tmp_path, caplog):
    folder = Folder(tmp_path, HOLDS_ONE)
    folder.write("small")
    caplog.set_level(logging.INFO)
    caplog.clear()
    large = folder.write("large", nbytes=2 * ENTRY)
    assert folder.models_kept() == {"small"}  # not written, and nothing evicted for it
    lines = [r.getMessage() for r in cache_lines(caplog)]
    assert lines == [
        f"packed-weight cache: {describe_bytes(2 * ENTRY)} of packed weights is over the {describe_bytes(HOLDS_ONE)} "
        "cap (--weight-cache-max-gib); not kept"
    ]
    assert large.outcome is not None and large.outcome.state == "not kept"


def maps_the_least_recent(tmp_path) -> tuple[Folder, PackedWeightCache]:
    """Entries "a" and "b" under a cap that holds two; this process maps "a", which is nonetheless
    the least recently used ("b" was used since)."""
    folder = Folder(tmp_path, HOLDS_TWO)
    folder.write("a")
    last_used(folder.write("b"), seconds_ago=100)
    serving = folder.cache("a")
    assert serving.load() is not None
    last_used(serving, seconds_ago=200)  # mapped long ago: by recency alone it would go first
    return folder, serving


def test_the_entry_this_process_maps_is_never_evicted(tmp_path):
    folder, serving = maps_the_least_recent(tmp_path)
    folder.write("c")
    assert folder.models_kept() == {"a", "c"}
    assert os.path.exists(serving.path)


def test_mutation_without_the_in_use_guard_the_mapped_entry_is_evicted(tmp_path, monkeypatch):
    folder, serving = maps_the_least_recent(tmp_path)
    monkeypatch.setattr(packed_cache, "_MAPPED", weakref.WeakSet())
    folder.write("c")
    assert folder.models_kept() == {"b", "c"}  # the check above fails on it


def test_a_mapped_entry_that_leaves_no_room_keeps_the_new_one_out(tmp_path, caplog):
    folder = Folder(tmp_path, HOLDS_ONE)
    folder.write("a")
    serving = folder.cache("a")
    assert serving.load() is not None
    caplog.set_level(logging.INFO)
    caplog.clear()
    new = folder.write("c")
    assert folder.models_kept() == {"a"} and serving.outcome == CacheOutcome("mapped", ENTRY)
    assert [r.getMessage() for r in cache_lines(caplog)] == [
        f"packed-weight cache: the entries this process maps leave no room for {describe_bytes(ENTRY)} under the "
        f"{describe_bytes(HOLDS_ONE)} cap; not kept"
    ]
    assert new.outcome is not None and new.outcome.state == "not kept"


def test_the_write_is_one_line_the_offline_engine_shows_by_default(tmp_path, caplog):
    """The offline Engine configures logging at its default --log-level (warning: engine.py's
    basicConfig): the write's line comes at WARNING there, at INFO where INFO shows (`serve`)."""
    caplog.set_level(ServerArgs().log_level.upper())
    folder = Folder(tmp_path, HOLDS_TWO)
    cache = folder.cache("offline")
    cache.save_in_background(kernels())
    cache.finish()
    [line] = cache_lines(caplog)
    assert line.levelno == logging.WARNING
    assert line.getMessage() == f"packed weights kept in {cache.path} ({describe_bytes(ENTRY)}) for the next start"
    assert folder.cache("offline").load() is not None
    assert len(cache_lines(caplog)) == 1  # a start that maps adds no line at that level
    caplog.clear()
    caplog.set_level(logging.INFO)
    folder.write("served")
    assert [r.levelno for r in cache_lines(caplog)] == [logging.INFO]


def test_the_cap_is_the_flag_else_the_environment_else_the_default(monkeypatch):
    from specserve import envs
    from specserve.args import DEFAULT_WEIGHT_CACHE_MAX_GIB

    monkeypatch.delenv(envs.WEIGHT_CACHE_MAX_GIB, raising=False)
    assert weight_cache_max_bytes(ServerArgs()) == int(DEFAULT_WEIGHT_CACHE_MAX_GIB * (1 << 30))
    monkeypatch.setenv(envs.WEIGHT_CACHE_MAX_GIB, "0.5")
    assert weight_cache_max_bytes(ServerArgs()) == 1 << 29
    assert weight_cache_max_bytes(ServerArgs(weight_cache_max_gib=2)) == 2 << 30
    monkeypatch.setenv(envs.WEIGHT_CACHE_MAX_GIB, "-1")
    with pytest.raises(ValueError, match=envs.WEIGHT_CACHE_MAX_GIB):
        weight_cache_max_bytes(ServerArgs())
    with pytest.raises(ValueError, match="^weight_cache_max_gib"):
        ServerArgs(weight_cache_max_gib=-1)
