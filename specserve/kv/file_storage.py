"""FileKVStorage: the file tier under the radix prefix cache (`--hicache-storage-backend file`).

Every full page of PAGE_TOKENS tokens is one file, named by a hash chain over the token ids from
position 0 (so a name identifies the whole prefix up to its page end), a digest of the
configuration that computed it (`StorageFingerprint`) and the tensor-parallel rank, so that
configurations sharing a directory never overwrite each other's pages.

A file is MAGIC, a JSON header (the fingerprint, the page key, the payload's length and SHA-256)
and the payload (`torch.save` of the page's K and V rows, read back with weights_only=True).
Loading checks every one of them and the rows' shapes and dtypes against the KV pools
(`PageLayout`): a page that is missing, unreadable, truncated, corrupt or made under another
configuration is a miss (and is removed, so that the next insert writes it again), never wrong KV
and never an exception.

Files are created 0600 in a 0700 directory, written atomically (temporary file, then rename), and
this rank's pages are kept under a byte cap by evicting the least recently used ones (a load or a
re-insert refreshes a page; the order survives restarts through the files' mtimes).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import stat
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import torch

from specserve.errors import ConfigError
from specserve.kv.pool import KVPool

logger = logging.getLogger(__name__)

PAGE_TOKENS = 64
# Bump when the page format or the way KV is computed (kernels, RoPE, quantized matmuls) changes:
# pages written before then are misses.
KV_FORMAT_VERSION = 2
MAGIC = b"SPECSERVE-KV\x00\x02"
DEFAULT_MAX_BYTES = 4 << 30
_HEADER_LEN_BYTES = 4
_IDENTITY_BYTES = 1 << 20  # hashed from each end of every model file
_STALE_TMP_S = 600  # a temporary file this old is left from a crashed write
_NAME = re.compile(r"[0-9a-f]{40}\.[0-9a-f]{16}\.rank(\d+)\.kv")
_TMP = re.compile(r"\.[0-9a-f]{40}\.[0-9a-f]{16}\.rank(\d+)\.kv\.tmp\d+")
_V1_PAGE = re.compile(r"[0-9a-f]{40}\.rank(\d+)\.kv")  # the unfingerprinted format: never loadable
_MODEL_FILE_SUFFIXES = (".gguf", ".safetensors", ".json", ".bin")


class StorageDirError(ConfigError):
    """--hicache-storage-dir cannot be used (not creatable, not a directory, not private, not writable)."""


@dataclass(frozen=True)
class StorageFingerprint:
    """The configuration that computed a page; a page made under any other one is never loaded."""

    model: str  # identity of the target's weights (`path_identity`)
    drafter: str  # identity of the DSPARK drafter whose KV the page also holds, or "none"
    kv_dtype: str
    tp_size: int
    tp_rank: int
    kernel: str  # KV_FORMAT_VERSION, device type and quantization mode

    def as_dict(self) -> dict:
        return asdict(self)

    def matches(self, recorded: object) -> bool:
        """True when a page header's recorded fingerprint is this one."""
        return recorded == self.as_dict()

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:16]


def path_identity(path: Optional[str]) -> str:
    """A model file's (or a model directory's weight and config files') names, sizes and a SHA-256
    of their first and last MiB: cheap at start-up, and another checkpoint of the same name and
    size still differs (GGUF metadata and safetensors headers sit at the start)."""
    if path is None:
        return "none"
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.endswith(_MODEL_FILE_SUFFIXES))
        files = [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))]
    else:
        files = [path]
    h = hashlib.sha256()
    for name in files:
        size = os.path.getsize(name)
        h.update(f"{os.path.basename(name)}:{size}:".encode())
        with open(name, "rb") as f:
            h.update(f.read(_IDENTITY_BYTES))
            f.seek(max(0, size - _IDENTITY_BYTES))
            h.update(f.read(_IDENTITY_BYTES))
    return f"{os.path.basename(os.path.normpath(path))}:{h.hexdigest()[:16]}"


@dataclass(frozen=True)
class PageLayout:
    """What one page of these KV pools holds: per K (and per V) tensor, its row shape and dtype."""

    k: tuple[tuple[tuple[int, ...], str], ...]
    v: tuple[tuple[tuple[int, ...], str], ...]

    @classmethod
    def of_pools(cls, pools: Sequence[KVPool]) -> "PageLayout":
        def rows(tensors: list[torch.Tensor]) -> tuple:
            return tuple((tuple(t.shape[1:]), str(t.dtype)) for t in tensors)

        return cls(sum((rows(p.k) for p in pools), ()), sum((rows(p.v) for p in pools), ()))

    def matches(self, rows: object) -> bool:
        """True when `rows` is {"k": [...], "v": [...]} with PAGE_TOKENS rows of the right shape and dtype."""
        if not isinstance(rows, dict) or set(rows) != {"k", "v"}:
            return False
        return self._match(rows["k"], self.k) and self._match(rows["v"], self.v)

    @staticmethod
    def _match(tensors: object, expected: tuple) -> bool:
        if not isinstance(tensors, list) or len(tensors) != len(expected):
            return False
        return all(
            isinstance(t, torch.Tensor) and tuple(t.shape) == (PAGE_TOKENS,) + shape and str(t.dtype) == dtype
            for t, (shape, dtype) in zip(tensors, expected)
        )


def prepare_directory(directory: str) -> None:
    """Create `directory` 0700, or tighten an existing one of ours to 0700; raise StorageDirError
    (one line, naming the flag) when it cannot be made a private, writable directory."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise StorageDirError(f"hicache_storage_dir: {directory!r} is not a directory")
    existed = os.path.isdir(directory)
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        st = os.stat(directory)
    except OSError as exc:
        raise StorageDirError(f"hicache_storage_dir: cannot create {directory!r}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise StorageDirError(f"hicache_storage_dir: {directory!r} is not a directory")
    mode = stat.S_IMODE(st.st_mode)
    if not existed or mode & 0o077:
        if st.st_uid != os.geteuid():
            raise StorageDirError(
                f"hicache_storage_dir: {directory!r} (mode {mode:o}) is open to other users and "
                "owned by another user; use a private directory"
            )
        # Only take away other users' access: a directory the owner made read-only stays so.
        os.chmod(directory, 0o700 if not existed else mode & 0o700)
    if not os.access(directory, os.W_OK | os.X_OK):
        raise StorageDirError(f"hicache_storage_dir: {directory!r} is not writable")


class FileKVStorage:
    """Pages of KV in <dir>/<chain hash>.<fingerprint digest>.rank<r>.kv; see the module docstring."""

    def __init__(
        self, directory: str, fingerprint: StorageFingerprint, layout: PageLayout, max_bytes: int = DEFAULT_MAX_BYTES
    ):
        """`max_bytes` caps this rank's pages (the builder gives each rank its share of the flag)."""
        if max_bytes < 1:
            raise ConfigError(f"hicache_storage_max_bytes must be >= 1, got {max_bytes}")
        prepare_directory(directory)
        self.directory = directory
        self.fingerprint = fingerprint
        self.layout = layout
        self.max_bytes = max_bytes
        self._digest = fingerprint.digest()
        self._pages: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, least recently used first
        self.total_bytes = 0
        self._scan()

    @staticmethod
    def page_keys(tokens: list[int]) -> list[str]:
        """One key per full page: a hash chain, so a key names the whole prefix up to its page end."""
        keys, h = [], hashlib.sha256(b"specserve-kv-v1")
        for start in range(0, len(tokens) - PAGE_TOKENS + 1, PAGE_TOKENS):
            h = h.copy()
            h.update(repr(tokens[start : start + PAGE_TOKENS]).encode())
            keys.append(h.hexdigest()[:40])
        return keys

    @property
    def rank(self) -> int:
        return self.fingerprint.tp_rank

    def _name(self, key: str) -> str:
        return f"{key}.{self._digest}.rank{self.rank}.kv"

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _owns(self, rank: int) -> bool:
        """This rank's pages of any configuration; rank 0 also keeps those of ranks that a larger
        TP size left behind, so that nothing in the directory escapes the cap."""
        return rank == self.rank or (self.rank == 0 and rank >= self.fingerprint.tp_size)

    # ------------------------------------------------------------ the LRU index

    def _scan(self) -> None:
        """Index this rank's pages once, oldest first (by mtime), and enforce the cap."""
        found = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                page, tmp, old = (p.fullmatch(entry.name) for p in (_NAME, _TMP, _V1_PAGE))
                match = page or tmp or old
                if match is None or not self._owns(int(match.group(1))):
                    continue  # never touch files that are not our pages
                st = entry.stat(follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    continue
                if page:
                    found.append((st.st_mtime_ns, entry.name, st.st_size))
                elif old or time.time() - st.st_mtime > _STALE_TMP_S:  # old format, or a crashed write
                    self._unlink(entry.name)
        for _, name, size in sorted(found):
            self._pages[name] = size
            self.total_bytes += size
        self._make_room(0)

    def _make_room(self, incoming: int) -> None:
        while self._pages and self.total_bytes + incoming > self.max_bytes:
            name, size = self._pages.popitem(last=False)
            self.total_bytes -= size
            self._unlink(name)

    def _forget(self, name: str) -> None:
        self.total_bytes -= self._pages.pop(name, 0)

    def _touch(self, name: str) -> None:
        """Mark a page used now: in memory, and in its mtime for the next start's order."""
        self._pages.move_to_end(name)
        try:
            os.utime(self._path(name))
        except OSError:
            pass

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("hicache file tier: cannot remove %s: %s", name, exc)

    # ------------------------------------------------------------ pages

    def has(self, key: str) -> bool:
        name = self._name(key)
        if name not in self._pages:
            return False
        self._touch(name)  # re-inserted: the page is in use again
        return True

    def save(self, key: str, rows: dict[str, list[torch.Tensor]]) -> bool:
        """Write one page (evicting least recently used pages past the cap); False when it was not
        written (larger than the cap, or the write failed: a cache write never fails a request)."""
        name = self._name(key)
        data = self._encode(key, rows)
        if len(data) > self.max_bytes:
            return False
        self._forget(name)
        self._make_room(len(data))
        tmp = self._path(f".{name}.tmp{os.getpid()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
            os.fchmod(fd, 0o600)  # exactly 0600, whatever the umask
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(name))
        except OSError as exc:
            logger.warning("hicache file tier: cannot write %s: %s", name, exc)
            self._unlink(os.path.basename(tmp))
            return False
        self._pages[name] = len(data)
        self.total_bytes += len(data)
        return True

    def _encode(self, key: str, rows: dict[str, list[torch.Tensor]]) -> bytes:
        buf = io.BytesIO()
        torch.save(rows, buf)
        payload = buf.getvalue()
        header = json.dumps(
            {
                "fingerprint": self.fingerprint.as_dict(),
                "key": key,
                "payload_bytes": len(payload),
                "sha256": hashlib.sha256(payload).hexdigest(),
            }
        ).encode()
        return MAGIC + len(header).to_bytes(_HEADER_LEN_BYTES, "little") + header + payload

    def load(self, key: str) -> Optional[dict[str, list[torch.Tensor]]]:
        """The page's rows, or None (a miss) when it is missing or fails any check."""
        name = self._name(key)
        try:
            rows = self._decode(key, self._path(name))
        except Exception:  # whatever an unreadable page raises (unpickling, JSON, I/O), it is a miss
            rows = None
        if rows is None:
            self._forget(name)
            self._unlink(name)  # so that the next insert writes a good page
            return None
        if name not in self._pages:  # written by another process since our scan: account for it now
            try:
                size = os.path.getsize(self._path(name))
            except OSError:  # removed meanwhile: the rows read are still good
                return rows
            self._pages[name] = size
            self.total_bytes += size
        self._touch(name)
        return rows

    def _decode(self, key: str, path: str) -> Optional[dict[str, list[torch.Tensor]]]:
        with open(path, "rb") as f:
            raw = f.read(self.max_bytes + 1)
        if len(raw) > self.max_bytes or not raw.startswith(MAGIC):
            return None
        start = len(MAGIC) + _HEADER_LEN_BYTES
        end = start + int.from_bytes(raw[len(MAGIC) : start], "little")
        header, payload = json.loads(raw[start:end]), raw[end:]
        if (
            not isinstance(header, dict)
            or not self.fingerprint.matches(header.get("fingerprint"))
            or header.get("key") != key
            or header.get("payload_bytes") != len(payload)
            or header.get("sha256") != hashlib.sha256(payload).hexdigest()
        ):
            return None
        rows = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
        return rows if self.layout.matches(rows) else None
