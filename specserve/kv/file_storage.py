"""FileKVStorage: the file tier under the radix prefix cache (`--hicache-storage-backend file`).

Every full page of PAGE_TOKENS tokens is one file, named by a hash chain over the token ids from
position 0 (so a name identifies the whole prefix up to its page end) and the tensor-parallel
rank. A file holds the SHA-256 of its payload followed by the payload and is written atomically
(temporary file, then rename). A missing, unreadable or corrupt file reads as a miss, never as
wrong KV.
"""

from __future__ import annotations

import hashlib
import io
import os
from typing import Optional

import torch

PAGE_TOKENS = 64


class FileKVStorage:
    """Pages of KV in files: <dir>/<chain hash>.rank<r>.kv, payload + SHA-256, written atomically."""

    def __init__(self, directory: str, rank: int):
        self.directory = directory
        self.rank = rank
        os.makedirs(directory, exist_ok=True)

    @staticmethod
    def page_keys(tokens: list[int]) -> list[str]:
        """One key per full page: a hash chain, so a key names the whole prefix up to its page end."""
        keys, h = [], hashlib.sha256(b"specserve-kv-v1")
        for start in range(0, len(tokens) - PAGE_TOKENS + 1, PAGE_TOKENS):
            h = h.copy()
            h.update(repr(tokens[start:start + PAGE_TOKENS]).encode())
            keys.append(h.hexdigest()[:40])
        return keys

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, f"{key}.rank{self.rank}.kv")

    def has(self, key: str) -> bool:
        return os.path.isfile(self._path(key))

    def save(self, key: str, rows: dict[str, list[torch.Tensor]]) -> None:
        buf = io.BytesIO()
        torch.save(rows, buf)
        payload = buf.getvalue()
        tmp = self._path(key) + f".tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(hashlib.sha256(payload).digest() + payload)
        os.replace(tmp, self._path(key))

    def load(self, key: str) -> Optional[dict[str, list[torch.Tensor]]]:
        """The page, or None when missing, unreadable or failing its checksum."""
        try:
            with open(self._path(key), "rb") as f:
                raw = f.read()
            digest, payload = raw[:32], raw[32:]
            if len(digest) != 32 or hashlib.sha256(payload).digest() != digest:
                return None
            rows = torch.load(io.BytesIO(payload), weights_only=True)
            return rows if isinstance(rows, dict) and rows.get("k") and rows.get("v") else None
        except (OSError, RuntimeError, EOFError, ValueError):
            return None
