"""FileKVStorage: configuration fingerprints, layout checks, unreadable pages, permissions, the LRU cap."""

from __future__ import annotations

import json
import os
import pickle
import stat

import pytest
import torch

from specserve.kv import file_storage
from specserve.kv.file_storage import (MAGIC, PAGE_TOKENS, FileKVStorage, PageLayout, StorageDirError,
                                       StorageFingerprint, path_identity)
from specserve.kv.pool import KVPool

FP = StorageFingerprint(model="m:1", drafter="none", kv_dtype="torch.float32", tp_size=1, tp_rank=0, kernel="t")
LAYOUT = PageLayout.of_pools([KVPool(4, 2, 1, 4, torch.float32)])  # 2 layers, 1 KV head, head dim 4
KEY = "a" * 40


def rows(tag: float = 1.0, layers: int = 2, heads: int = 1, dim: int = 4, dtype=torch.float32, tokens=PAGE_TOKENS):
    t = torch.full((tokens, heads, dim), tag, dtype=dtype)
    return {"k": [t.clone() for _ in range(layers)], "v": [-t for _ in range(layers)]}


def store(directory, fp=FP, layout=LAYOUT, max_bytes=1 << 30) -> FileKVStorage:
    return FileKVStorage(str(directory), fp, layout, max_bytes)


def page_files(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(".kv"))


def test_a_page_round_trips_into_a_new_instance(tmp_path):
    store(tmp_path).save(KEY, rows(3.0))
    got = store(tmp_path).load(KEY)
    assert got is not None and torch.equal(got["k"][1], rows(3.0)["k"][1]) and torch.equal(got["v"][0], -got["k"][0])


# ---------------------------------------------------------------- fingerprint


@pytest.mark.parametrize("field, value", [("model", "other:1"), ("drafter", "d:2"), ("kv_dtype", "torch.bfloat16"),
                                          ("tp_size", 2), ("tp_rank", 1), ("kernel", "t2")])
def test_configurations_sharing_a_directory_keep_their_own_pages(tmp_path, field, value):
    other = StorageFingerprint(**{**FP.as_dict(), field: value})
    store(tmp_path).save(KEY, rows(1.0))
    assert store(tmp_path, other).load(KEY) is None  # another configuration: a miss
    store(tmp_path, other).save(KEY, rows(2.0))
    assert len(page_files(tmp_path)) == 2  # nothing overwritten
    assert store(tmp_path).load(KEY)["k"][0][0, 0, 0] == 1.0
    assert store(tmp_path, other).load(KEY)["k"][0][0, 0, 0] == 2.0


def _foreign_page_under_our_name(tmp_path) -> FileKVStorage:
    """A page written under another model, renamed to our file name: only the header tells."""
    other = StorageFingerprint(**{**FP.as_dict(), "model": "other:1"})
    theirs = store(tmp_path / "theirs", other)
    theirs.save(KEY, rows(7.0))
    ours = store(tmp_path / "ours")
    os.replace(theirs._path(theirs._name(KEY)), ours._path(ours._name(KEY)))
    return store(tmp_path / "ours")


def test_a_page_with_another_fingerprint_in_its_header_is_a_miss(tmp_path):
    ours = _foreign_page_under_our_name(tmp_path)
    assert ours.has(KEY)
    assert ours.load(KEY) is None
    assert not ours.has(KEY) and page_files(tmp_path / "ours") == []  # removed, so it is written again


def test_mutation_without_the_fingerprint_check_the_foreign_page_loads(tmp_path, monkeypatch):
    """Shows the previous test can fail: with the check removed, the wrong model's KV is used."""
    monkeypatch.setattr(StorageFingerprint, "matches", lambda self, recorded: True)
    ours = _foreign_page_under_our_name(tmp_path)
    assert ours.load(KEY)["k"][0][0, 0, 0] == 7.0


# ---------------------------------------------------------------- layout


@pytest.mark.parametrize("page", [rows(layers=3), rows(heads=2), rows(dim=8), rows(dtype=torch.bfloat16),
                                  rows(tokens=PAGE_TOKENS - 1), {"k": rows()["k"]}, [torch.zeros(1)],
                                  {"k": [1, 2], "v": [3, 4]}])
def test_a_page_of_the_wrong_shape_or_dtype_is_a_miss(tmp_path, page):
    store(tmp_path).save(KEY, page)
    assert store(tmp_path).load(KEY) is None


def test_a_pool_of_another_shape_misses_pages_of_this_one(tmp_path):
    store(tmp_path).save(KEY, rows())
    wider = PageLayout.of_pools([KVPool(4, 2, 1, 8, torch.float32)])
    assert store(tmp_path, layout=wider).load(KEY) is None


def test_mutation_without_the_layout_check_a_misshapen_page_loads(tmp_path, monkeypatch):
    store(tmp_path).save(KEY, rows(dim=8))
    monkeypatch.setattr(PageLayout, "matches", lambda self, r: True)
    assert store(tmp_path).load(KEY)["k"][0].shape[-1] == 8


# ---------------------------------------------------------------- unreadable pages


def _with_header(payload: bytes, fp=FP, key=KEY, **overrides) -> bytes:
    import hashlib

    header = {"fingerprint": fp.as_dict(), "key": key, "payload_bytes": len(payload),
              "sha256": hashlib.sha256(payload).hexdigest(), **overrides}
    raw = json.dumps(header).encode()
    return MAGIC + len(raw).to_bytes(4, "little") + raw + payload


class Gadget:
    """Any class: weights_only refuses to build it."""


def _corruptions(good: bytes) -> dict[str, bytes]:
    return {"empty": b"", "magic only": MAGIC, "truncated": good[:len(good) // 2], "garbage": os.urandom(4096),
            "flipped byte": good[:-40] + bytes([good[-40] ^ 0xFF]) + good[-39:],
            "header not json": MAGIC + (5).to_bytes(4, "little") + b"{oops" + b"x" * 10,
            "header length past the end": MAGIC + (1 << 30).to_bytes(4, "little") + b"{}",
            "header not an object": _with_header(b"")[:len(MAGIC)] + (2).to_bytes(4, "little") + b"[]",
            "another key": _with_header(good[-100:], key="b" * 40),
            "pickled object": _with_header(pickle.dumps(Gadget(), protocol=2)),
            "torch-saved object": _with_header(_torch_bytes({"k": Gadget(), "v": []})),
            "plain text": _with_header(b"not a torch file")}


def _torch_bytes(obj) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_every_kind_of_unreadable_page_is_a_miss_and_is_rewritten(tmp_path):
    s = store(tmp_path)
    s.save(KEY, rows())
    path = s._path(s._name(KEY))
    good = open(path, "rb").read()
    for name, data in _corruptions(good).items():
        with open(path, "wb") as f:
            f.write(data)
        s = store(tmp_path)
        assert s.load(KEY) is None, name
        assert not os.path.exists(path) and not s.has(KEY), name  # removed: the next insert writes it again
        assert s.save(KEY, rows()) and s.load(KEY) is not None, name


def test_a_missing_page_is_a_miss(tmp_path):
    assert store(tmp_path).load(KEY) is None


# ---------------------------------------------------------------- permissions


def test_directory_is_0700_and_pages_0600_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        s = store(tmp_path / "a" / "cache")
        s.save(KEY, rows())
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "a" / "cache").st_mode) == 0o700
    assert [stat.S_IMODE(os.stat(tmp_path / "a" / "cache" / n).st_mode) for n in page_files(s.directory)] == [0o600]


def test_an_open_directory_of_ours_is_tightened(tmp_path):
    d = tmp_path / "cache"
    d.mkdir()
    os.chmod(d, 0o755)
    store(d)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_an_open_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    d.mkdir()
    os.chmod(d, 0o777)
    monkeypatch.setattr(file_storage.os, "geteuid", lambda: os.stat(d).st_uid + 1)
    with pytest.raises(StorageDirError, match="hicache_storage_dir: .*another user"):
        store(d)


def test_a_directory_that_cannot_be_created_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageDirError, match="hicache_storage_dir: cannot create"):
        store(tmp_path / "file" / "cache")
    with pytest.raises(StorageDirError, match="not a directory"):
        store(tmp_path / "file")


# ---------------------------------------------------------------- size cap and LRU


def _page_bytes(tmp_path) -> int:
    s = store(tmp_path / "probe")
    s.save(KEY, rows())
    return s.total_bytes


def test_the_cap_evicts_least_recently_used_pages(tmp_path):
    size = _page_bytes(tmp_path)
    s = store(tmp_path / "c", max_bytes=3 * size + size // 2)
    keys = [c * 40 for c in "0123456789"]
    for k in keys[:3]:
        assert s.save(k, rows())
    assert s.load(keys[0]) is not None  # 0 is now the most recent; 1 the least
    assert s.save(keys[3], rows())
    assert not s.has(keys[1]) and s.load(keys[1]) is None
    assert all(s.has(k) for k in (keys[0], keys[2], keys[3]))
    for k in keys[4:]:
        s.save(k, rows())
        on_disk = sum(os.path.getsize(os.path.join(s.directory, n)) for n in page_files(s.directory))
        assert on_disk == s.total_bytes <= s.max_bytes
    assert len(page_files(s.directory)) == 3


def test_the_lru_order_survives_a_restart_and_a_lower_cap(tmp_path):
    size = _page_bytes(tmp_path)
    s = store(tmp_path / "c")
    for i, k in enumerate(["1" * 40, "2" * 40, "3" * 40]):
        s.save(k, rows())
        os.utime(s._path(s._name(k)), ns=(10**9 * (100 - i), 10**9 * (100 - i)))  # the first is the newest
    notes = tmp_path / "c" / "notes.txt"
    notes.write_text("not a page")
    s = store(tmp_path / "c", max_bytes=2 * size)
    assert s.has("1" * 40) and s.has("2" * 40) and not s.has("3" * 40)
    assert notes.exists()  # files that are not our pages are never touched


def test_a_page_larger_than_the_cap_is_not_written(tmp_path):
    s = store(tmp_path, max_bytes=100)
    assert not s.save(KEY, rows()) and page_files(tmp_path) == []


def test_ranks_keep_their_own_pages_under_their_own_share(tmp_path):
    size = _page_bytes(tmp_path)
    fps = [StorageFingerprint(**{**FP.as_dict(), "tp_size": 2, "tp_rank": r}) for r in (0, 1)]
    r0, r1 = (store(tmp_path / "c", fp, max_bytes=size) for fp in fps)
    r0.save(KEY, rows())
    r1.save(KEY, rows())
    r0.save("b" * 40, rows())  # evicts rank 0's first page only
    assert store(tmp_path / "c", fps[1], max_bytes=size).has(KEY)
    assert not store(tmp_path / "c", fps[0], max_bytes=size).has(KEY)


def test_pages_of_the_unfingerprinted_format_are_removed(tmp_path):
    old = tmp_path / f"{KEY}.rank0.kv"
    old.write_bytes(b"x" * 100)
    store(tmp_path)
    assert not old.exists()


# ---------------------------------------------------------------- model identity


def test_model_identity_tells_files_of_the_same_name_and_size_apart(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "m.gguf").write_bytes(b"\0" * 1000 + b"A")
    (tmp_path / "b" / "m.gguf").write_bytes(b"\0" * 1000 + b"B")
    ids = {path_identity(str(tmp_path / d / "m.gguf")) for d in "ab"}
    assert len(ids) == 2 and all(i.startswith("m.gguf:") for i in ids)
    assert path_identity(str(tmp_path / "a")) != path_identity(str(tmp_path / "b"))  # directories too
    assert path_identity(None) == "none"
