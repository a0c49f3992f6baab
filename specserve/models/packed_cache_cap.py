"""The packed-weight cache's size cap (`--weight-cache-max-gib`, models/packed_cache.py): its entries,
their recency, and which of them a new entry evicts.

An entry is one `*.pt` file of the cache folder (one model file, TP rank and packing code); the cap
covers all of them, every model and rank together. Recency is the file's modification time: a write
sets it, and a start that maps the entry sets it again (mark_used). A time on the file itself needs
no index beside the entries, so processes sharing the folder cannot tear one, and a file another
process deletes meanwhile only drops out of the listing. Deleting an entry another process has
mapped is safe on POSIX (its pages stay until it unmaps them): that process's next start packs again."""

from __future__ import annotations

import datetime
import glob
import logging
import os
from dataclasses import dataclass
from typing import Iterable, Optional

logger = logging.getLogger(__name__)

ENTRY_SUFFIX = ".pt"  # a writer's temporary file ends `.pt.PID.tmp`: not an entry until it is renamed


@dataclass(frozen=True)
class CacheEntry:
    path: str
    nbytes: int  # the file's size on disk
    used_ns: int  # last written, or mapped at a start (the file's modification time)


@dataclass(frozen=True)
class CacheOutcome:
    """What a start did with its entry, for the start-up block: mapped it, is writing it, or keeps none."""

    state: str  # "mapped", "writing" or "not kept"
    nbytes: int  # the entry's bytes (mapped: the file's; otherwise the packed weights')
    reason: str = ""  # why it is not kept


def cache_entries(directory: str) -> list[CacheEntry]:
    """The folder's entries now (one removed while listing is left out)."""
    entries = []
    for path in glob.glob(os.path.join(glob.escape(directory), f"*{ENTRY_SUFFIX}")):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        entries.append(CacheEntry(path, st.st_size, st.st_mtime_ns))
    return entries


def mark_used(path: str) -> None:
    """Make `path` the most recently used entry (a start mapped it)."""
    try:
        os.utime(path)
    except OSError:  # a folder shared read-only: its entries keep their write times
        pass


def least_recent_first(entries: Iterable[CacheEntry]) -> list[CacheEntry]:
    """The eviction order (the path breaks ties, so every process orders alike)."""
    return sorted(entries, key=lambda e: (e.used_ns, e.path))


def entries_to_evict(
    entries: list[CacheEntry], new_bytes: int, max_bytes: int, keep: set[str]
) -> Optional[list[CacheEntry]]:
    """The entries to delete, least recently used first, so that `new_bytes` more fit with the rest
    under `max_bytes`; None where even deleting every entry outside `keep` leaves too little room."""
    total = sum(e.nbytes for e in entries)
    evicted = []
    for entry in least_recent_first(e for e in entries if e.path not in keep):
        if total + new_bytes <= max_bytes:
            break
        evicted.append(entry)
        total -= entry.nbytes
    return evicted if total + new_bytes <= max_bytes else None


def evict(entries: list[CacheEntry], max_bytes: int) -> None:
    """Delete the entries, one line each."""
    for entry in entries:
        try:
            os.remove(entry.path)
        except FileNotFoundError:
            continue  # another process evicted it first (and said so)
        used = datetime.datetime.fromtimestamp(entry.used_ns / 1e9).isoformat(sep=" ", timespec="seconds")
        logger.log(
            notice_level(logger),
            "packed-weight cache: evicted %s (%s, last used %s) to stay under the %s cap",
            entry.path,
            describe_bytes(entry.nbytes),
            used,
            describe_bytes(max_bytes),
        )


def notice_level(log: logging.Logger) -> int:
    """INFO where INFO is shown (`specserve serve`), else WARNING: the offline Engine logs at WARNING
    by default, and a model-sized file written to (or deleted from) a person's disk is theirs to
    see. `--log-level error` still hides it."""
    return logging.INFO if log.isEnabledFor(logging.INFO) else logging.WARNING


def describe_bytes(count: int) -> str:
    """1536 << 20 -> '1.50 GiB'; below a GiB in MiB ('93.8 MiB')."""
    if count >= 1 << 30:
        return f"{count / (1 << 30):.2f} GiB"
    return f"{count / (1 << 20):.1f} MiB"
