"""The drafter's training corpus, kept in the repository and extended run after run.

Only token ids are kept (prompt ids and answer ids): the target's hidden states and teacher
distributions are recomputed from them when training (`train/teacher.py`), so a corpus that took
CPU-hours to generate costs a few megabytes. Layout of the data folder:

    manifest.json          one entry per shard: source, counts, sha256, how and how fast it was made
    shards/NNNNN-SOURCE.npz  uint16 ids (all sequences back to back), int32 prompt/answer lengths,
                           uint64 prompt keys (for de-duplication); zlib-compressed

Shards are append-only: a shard is written once under a fresh number and never rewritten, so a
checkpoint trained on shards 0..n stays reproducible when n + 1 arrives. The manifest enforces a
size budget (50 MB by default) so that the repository stays small.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator, Optional, Sequence

import numpy as np

from specserve.errors import ConfigError, InternalError

MANIFEST = "manifest.json"
LOCK_FILE = ".append.lock"  # held while a shard is appended
SHARD_DIR = "shards"
DEFAULT_BUDGET_BYTES = 50 * 1024 * 1024


def prompt_key(text: str) -> int:
    """64-bit key of a prompt's text (whitespace-trimmed): the unit of de-duplication."""
    return int.from_bytes(hashlib.sha1(text.strip().encode()).digest()[:8], "little")


@dataclass
class Pair:
    """One training sequence: the chat-templated prompt's ids and the answer's ids."""

    prompt_ids: list[int]
    answer_ids: list[int]
    key: int


@dataclass
class ShardInfo:
    """A manifest entry."""

    file: str
    source: str
    sequences: int
    prompt_tokens: int
    answer_tokens: int
    bytes: int
    sha256: str
    seconds: float  # wall time it took to make (generation or tokenisation), on `machine`
    machine: str
    created: str
    generator: dict = field(default_factory=dict)


class CorpusStore:
    """Append-only shards of token ids with a manifest (see the module docstring)."""

    def __init__(self, root: str, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        self.root = root
        self.budget_bytes = budget_bytes
        self.shards: list[ShardInfo] = []
        path = os.path.join(root, MANIFEST)
        if os.path.isfile(path):
            with open(path) as f:
                raw = json.load(f)
            self.budget_bytes = int(raw.get("budget_bytes", budget_bytes))
            self.shards = [ShardInfo(**s) for s in raw["shards"]]

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def counts(self, source: Optional[str] = None) -> dict[str, int]:
        chosen = [s for s in self.shards if source is None or s.source == source]
        return {"shards": len(chosen), "sequences": sum(s.sequences for s in chosen),
                "prompt_tokens": sum(s.prompt_tokens for s in chosen),
                "answer_tokens": sum(s.answer_tokens for s in chosen)}

    def sources(self) -> list[str]:
        return sorted({s.source for s in self.shards})

    def used_keys(self, source: str) -> set[int]:
        """Prompt keys already in `source`'s shards (a prompt is answered once per source)."""
        keys: set[int] = set()
        for info in self.shards:
            if info.source == source:
                keys.update(self.shard_keys(info))
        return keys

    def append(self, source: str, pairs: Sequence[Pair], generator: dict, seconds: float, machine: str) -> ShardInfo:
        """Write one new shard and record it; refuses to exceed the size budget. Safe against another
        process appending at the same time (a lock file; the manifest is re-read under it)."""
        if not pairs:
            raise InternalError("append: no sequences")
        if any(t < 0 or t > 0xFFFF for p in pairs for t in (*p.prompt_ids, *p.answer_ids)):
            raise ConfigError("append: token ids must fit uint16 (vocabulary up to 65,536)")
        os.makedirs(os.path.join(self.root, SHARD_DIR), exist_ok=True)
        with open(os.path.join(self.root, LOCK_FILE), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.shards = CorpusStore(self.root, self.budget_bytes).shards
            return self._append_locked(source, pairs, generator, seconds, machine)

    def _append_locked(self, source: str, pairs: Sequence[Pair], generator: dict, seconds: float,
                       machine: str) -> ShardInfo:
        name = f"{SHARD_DIR}/{len(self.shards):05d}-{source}.npz"
        path = os.path.join(self.root, name)
        if os.path.exists(path):
            raise ConfigError(f"append: {path} exists but is not in the manifest (shards are append-only)")
        tokens = np.fromiter((t for p in pairs for t in (*p.prompt_ids, *p.answer_ids)), dtype=np.uint16)
        np.savez_compressed(path + ".tmp.npz", tokens=tokens,
                            prompt_lens=np.array([len(p.prompt_ids) for p in pairs], dtype=np.int32),
                            answer_lens=np.array([len(p.answer_ids) for p in pairs], dtype=np.int32),
                            keys=np.array([p.key for p in pairs], dtype=np.uint64))
        size = os.path.getsize(path + ".tmp.npz")
        if self.total_bytes + size > self.budget_bytes:
            os.remove(path + ".tmp.npz")
            raise ConfigError(f"append: the corpus would grow to {self.total_bytes + size} bytes, over its budget of "
                             f"{self.budget_bytes} (raise budget_bytes in {MANIFEST} deliberately, or stop)")
        os.replace(path + ".tmp.npz", path)
        info = ShardInfo(file=name, source=source, sequences=len(pairs),
                         prompt_tokens=sum(len(p.prompt_ids) for p in pairs),
                         answer_tokens=sum(len(p.answer_ids) for p in pairs), bytes=size, sha256=_sha256(path),
                         seconds=round(seconds, 1), machine=machine,
                         created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), generator=dict(generator))
        self.shards.append(info)
        self._save_manifest()
        return info

    def pairs(self, sources: Optional[Sequence[str]] = None) -> Iterator[tuple[ShardInfo, Pair]]:
        """Every sequence of the chosen sources, shard by shard in manifest order."""
        for info in self.shards:
            if sources is None or info.source in sources:
                yield from ((info, pair) for pair in self.shard_pairs(info))

    def shard_pairs(self, info: ShardInfo) -> list[Pair]:
        """One shard's sequences, in order."""
        raw = self._load(info)
        tokens, offset, out = raw["tokens"], 0, []
        for p_len, a_len, key in zip(raw["prompt_lens"], raw["answer_lens"], raw["keys"]):
            seq = tokens[offset:offset + p_len + a_len].astype(np.int64).tolist()
            offset += int(p_len + a_len)
            out.append(Pair(seq[:p_len], seq[p_len:], int(key)))
        return out

    def shard_keys(self, info: ShardInfo) -> list[int]:
        """One shard's prompt keys, in sequence order."""
        return [int(k) for k in self._load(info)["keys"]]

    def _load(self, info: ShardInfo) -> dict[str, np.ndarray]:
        path = os.path.join(self.root, info.file)
        if _sha256(path) != info.sha256:
            raise ConfigError(f"{path}: its sha256 is not the manifest's (shards are never rewritten)")
        with np.load(path) as raw:
            return {k: raw[k] for k in raw.files}

    def _save_manifest(self) -> None:
        path = os.path.join(self.root, MANIFEST)
        with open(path + ".tmp", "w") as f:
            json.dump({"budget_bytes": self.budget_bytes, "totals": self.counts(),
                       "by_source": {s: self.counts(s) for s in self.sources()},
                       "shards": [asdict(s) for s in self.shards]}, f, indent=1)
        os.replace(path + ".tmp", path)


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()
