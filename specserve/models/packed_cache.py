"""Packed weights kept on disk between starts, so a restart maps them instead of repacking the file.

Packing a GGUF into the CPU kernels' layout (kernels/linear.py, csrc/pack.cpp) costs seconds per
GB at every start, where llama.cpp maps its file and computes on the blocks as they are. After the
first start the target's packed linears are written to one file per model file, TP rank and
packing code (`--weight-cache`, default `~/.cache/specserve/packed`: engine/start_cache.py); a later start with the same
key maps that file (`torch.load(mmap=True)`: the pages come from the page cache, nothing is parsed)
and skips the GGUF's codes entirely. The key holds what decides the packed bytes: the model file
(real path, size, modification time), the packing sources (the kernel build's fingerprint and the
Python of models/ and kernels/), the TP shape and the dtype. A file that does not match, or does not read, is
repacked and written again. Before a write the least recently used entries of other models are
evicted to keep the folder under its cap (`--weight-cache-max-gib`: models/packed_cache_cap.py); a
model whose packed weights alone pass the cap, or a disk without room, keeps no cache (one line
says so). Results are bitwise those of packing (tests/integration/test_packed_cache.py)."""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
import shutil
import threading
import weakref
from functools import lru_cache
from typing import Any, Optional

import torch

from specserve.kernels.linear import PackedLinear
from specserve.models.packed_cache_cap import (
    CacheOutcome,
    cache_entries,
    describe_bytes,
    entries_to_evict,
    evict,
    mark_used,
    notice_level,
)

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when what a cache file holds changes shape
HEADROOM_BYTES = 1 << 30  # a cache is written only if the disk keeps this much free after it
# The Python half of packing: every module of these packages may change the packed bytes.
_PACKING_PACKAGES = ("models", "kernels")
# The caches whose entry this process has mapped (while their model lives): never evicted by it.
_MAPPED: weakref.WeakSet[PackedWeightCache] = weakref.WeakSet()


@lru_cache(maxsize=1)
def packing_fingerprint() -> str:
    """A digest of every source that decides packed bytes: the C++ (the kernel build's
    fingerprint covers csrc, the compiler and torch) and the Python of models/ and kernels/."""
    from specserve.kernels.build import build_dir

    digest = hashlib.sha256(os.path.basename(build_dir()).encode())
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for folder in _PACKING_PACKAGES:
        for name in sorted(glob.glob(os.path.join(package, folder, "*.py"))):
            with open(name, "rb") as f:
                digest.update(os.path.basename(name).encode() + b"\0" + f.read())
    return digest.hexdigest()[:16]


def file_identity(path: str) -> tuple[str, int, int]:
    """What says a file is the same file: its real path, size and modification time (ns)."""
    real = os.path.realpath(path)
    st = os.stat(real)
    return real, st.st_size, st.st_mtime_ns


def kernel_machine() -> str:
    """The CPU and the kernel path the packed weights run on (what a timing made on them depends on)."""
    from specserve.kernels.dispatch import machine_description, path_name

    return f"{machine_description()}; {path_name()} kernels"


class PackedWeightCache:
    """One model file's packed linears on disk, for one TP rank and dtype: `load()` them (mapped) or
    `save()` them after packing, the folder's entries together kept under `max_bytes`."""

    def __init__(self, directory: str, model_path: str, tp_rank: int, tp_size: int, dtype: torch.dtype, max_bytes: int):
        real, size, mtime_ns = file_identity(model_path)
        self.identity = {"format": CACHE_FORMAT, "path": real, "size": size, "mtime_ns": mtime_ns,
                         "packing": packing_fingerprint(), "tp": [tp_rank, tp_size], "dtype": str(dtype)}  # fmt: skip
        key = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()[:16]
        # one file per (model path, rank): a stale one is replaced, not kept beside the new one
        self._prefix = os.path.join(
            directory, f"{os.path.basename(real)}-{hashlib.sha256(real.encode()).hexdigest()[:8]}-tp{tp_rank}of{tp_size}"
        )
        self.directory = directory
        self.path = f"{self._prefix}-{key}.pt"
        self.max_bytes = max_bytes
        self.outcome: Optional[CacheOutcome] = None  # mapped, writing or not kept (the start-up block)
        self._writer: Optional[threading.Thread] = None  # a background save (save_in_background)
        self._pending: Optional[dict[str, PackedLinear]] = None  # kept by save_later

    def load(self) -> Optional[dict[str, PackedLinear]]:
        """The cached kernels by module name, mapped from the file; None if there is no usable one."""
        if not os.path.exists(self.path):
            return None
        try:
            blob = torch.load(self.path, mmap=True, weights_only=True)
            if blob.get("identity") != self.identity:
                raise ValueError("its key does not match its contents")
            kernels = {name: PackedLinear(**fields) for name, fields in blob["kernels"].items()}
        except Exception as exc:  # a torn or foreign file: repack, and the save replaces it
            logger.warning("packed-weight cache %s unreadable (%s): packing from the model file", self.path, exc)
            return None
        logger.info("packed weights mapped from %s", self.path)
        mark_used(self.path)  # the cap evicts the least recently used entries first
        _MAPPED.add(self)
        self.outcome = CacheOutcome("mapped", packed_bytes(kernels))
        return kernels

    def save_later(self, kernels: dict[str, PackedLinear]) -> None:
        """Keep the kernels for a save_in_background() once start-up has timed what it times (a
        save's disk writes beside a timing would skew it; waiting for the save would delay the
        first start by its length)."""
        self._pending = kernels

    def save_in_background(self, kernels: Optional[dict[str, PackedLinear]] = None) -> None:
        """save() (of `kernels`, else of those save_later() kept; a no-op without any): whether it
        is kept, and the evictions that make room, now; the write on a thread of its own, while the
        engine serves (the kernels only read the tensors it writes out); finish() waits for it, as
        does the interpreter's exit."""
        kernels, self._pending = kernels if kernels is not None else self._pending, None
        if kernels is None or self._writer is not None or not self._make_room(kernels):
            return
        self._writer = threading.Thread(target=self._write_logged, args=(kernels,), name="packed-weight-cache")
        self._writer.start()

    def finish(self) -> None:
        """Wait for a background save (a no-op without one)."""
        if self._writer is not None:
            self._writer.join()

    def _write_logged(self, kernels: dict[str, PackedLinear]) -> None:
        try:
            self._write(kernels)
        except Exception as exc:  # a full or read-only disk (torch reports some as RuntimeError): the
            # engine runs on and the next start packs again
            logger.warning("packed-weight cache %s not written: %s", self.path, exc)
            self.outcome = CacheOutcome("not kept", packed_bytes(kernels), f"not written: {exc}")

    def save(self, kernels: dict[str, PackedLinear]) -> None:
        """Write the kernels (atomically, replacing this model's older entries) if they fit: under
        the cap once older entries are evicted, and on the disk."""
        if self._make_room(kernels):
            self._write(kernels)

    def _make_room(self, kernels: dict[str, PackedLinear]) -> bool:
        """Evict what the cap needs for these kernels and say "writing"; or evict nothing, say why
        the entry is not kept (one line) and return False. Decided before the write starts, so the
        start-up block reads the outcome."""
        size = packed_bytes(kernels)
        os.makedirs(self.directory, exist_ok=True)
        # This model's own entries (older keys) are replaced by the write, not kept beside it.
        others = [e for e in cache_entries(self.directory) if not e.path.startswith(f"{self._prefix}-")]
        evicted = entries_to_evict(others, size, self.max_bytes, keep={c.path for c in list(_MAPPED)})
        freed = sum(e.nbytes for e in evicted or [])
        reason = self._refusal(size, evicted is not None, shutil.disk_usage(self.directory).free + freed)
        if reason is not None:
            logger.log(notice_level(logger), "packed-weight cache: %s; not kept", reason)
            self.outcome = CacheOutcome("not kept", size, reason)
            return False
        evict(evicted or [], self.max_bytes)
        self.outcome = CacheOutcome("writing", size)
        return True

    def _refusal(self, size: int, fits_beside_mapped: bool, free_after_eviction: int) -> Optional[str]:
        """Why an entry of `size` bytes is not written, or None."""
        wanted, cap = describe_bytes(size), describe_bytes(self.max_bytes)
        if size > self.max_bytes:
            return f"{wanted} of packed weights is over the {cap} cap (--weight-cache-max-gib)"
        if not fits_beside_mapped:
            return f"the entries this process maps leave no room for {wanted} under the {cap} cap"
        if free_after_eviction < size + HEADROOM_BYTES:
            return f"{self.directory} has no room for {wanted} (and {describe_bytes(HEADROOM_BYTES)} to spare)"
        return None

    def _write(self, kernels: dict[str, PackedLinear]) -> None:
        blob: dict[str, Any] = {"identity": self.identity, "kernels": {n: _fields(k) for n, k in kernels.items()}}
        temporary = f"{self.path}.{os.getpid()}.tmp"
        try:
            torch.save(blob, temporary)
            os.replace(temporary, self.path)
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)
        stale = [p for p in glob.glob(f"{glob.escape(self._prefix)}-*.pt") if p != self.path]
        torn = [p for p in glob.glob(f"{glob.escape(self._prefix)}-*.pt.*.tmp") if not _alive(_writer_pid(p))]
        for path in stale + torn:  # older keys, and files a killed writer left
            try:
                os.remove(path)
            except FileNotFoundError:
                pass  # another process removed it first
        size = describe_bytes(packed_bytes(kernels))
        logger.log(notice_level(logger), "packed weights kept in %s (%s) for the next start", self.path, size)


def packed_bytes(kernels: dict[str, PackedLinear]) -> int:
    return sum(k.nbytes() for k in kernels.values())


def _fields(kernel: PackedLinear) -> dict[str, Any]:
    """A kernel's fields as saved: tensors and plain values (dataclasses.asdict would deep-copy the tensors)."""
    return {f.name: getattr(kernel, f.name) for f in dataclasses.fields(kernel)}


def _writer_pid(temporary: str) -> int:
    """The pid in a temporary file's name (`....pt.PID.tmp`), 0 if there is none."""
    part = temporary.rsplit(".", 2)[-2]
    return int(part) if part.isdigit() else 0


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
