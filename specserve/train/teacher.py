"""The target's view of the corpus, recomputed from token ids and cached locally.

The repository keeps only token ids (`corpus_store.py`). Training needs, per sequence, the target's
hidden states at the drafter's `target_layer_ids` for every position (the drafter's context) and
the target's top-k next-token distribution at every answer position (the teacher). Both come from
one batched prefill (`corpus.capture`) and are cached per shard as memory-mapped arrays in a
local, uncommitted folder, so a second run on the same machine pays nothing and a run on a grown
corpus pays only for the new shards. A cache entry is keyed by the shard's sha256, the layers, k
and the model, so a changed shard or a different drafter shape never reads a stale entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence as Seq

import numpy as np
import torch

from specserve.errors import ConfigError
from specserve.train.corpus import Corpus, Sequence, capture
from specserve.train.corpus_store import CorpusStore, ShardInfo

CAPTURE_GROUP = 64  # sequences per capture call (its prefill chunks are bounded by max_tokens anyway)


@dataclass
class ShardTeacher:
    """One shard's cached arrays (memory-mapped)."""

    hidden: np.ndarray  # [tokens, L*H] uint16 (bf16 bits)
    top_ids: np.ndarray  # [rows, K] int32
    top_probs: np.ndarray  # [rows, K] float16
    tokens: np.ndarray  # [tokens] int32
    seq_offsets: np.ndarray  # [n + 1] token offsets
    row_offsets: np.ndarray  # [n + 1] teacher-row offsets
    prompt_lens: np.ndarray  # [n]

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def sequence(self, i: int) -> Sequence:
        a, b = int(self.seq_offsets[i]), int(self.seq_offsets[i + 1])
        r0, r1 = int(self.row_offsets[i]), int(self.row_offsets[i + 1])
        return Sequence(torch.from_numpy(self.tokens[a:b].astype(np.int64)), int(self.prompt_lens[i]),
                        torch.from_numpy(np.array(self.hidden[a:b])).view(torch.bfloat16),
                        torch.from_numpy(self.top_ids[r0:r1].astype(np.int64)),
                        torch.from_numpy(self.top_probs[r0:r1].astype(np.float32)))


class TeacherCache:
    """Per-shard cache of the target's hidden states and top-k (see the module docstring)."""

    def __init__(self, cache_dir: str, layer_ids: Seq[int], topk: int, model_name: str):
        self.cache_dir = cache_dir
        self.layer_ids, self.topk, self.model_name = list(layer_ids), topk, model_name

    def entry_dir(self, info: ShardInfo) -> str:
        tag = hashlib.sha1(json.dumps([info.sha256, self.layer_ids, self.topk, self.model_name]).encode()).hexdigest()
        return os.path.join(self.cache_dir, f"{os.path.basename(info.file)[:-4]}-{tag[:12]}")

    def missing(self, shards: Seq[ShardInfo]) -> list[ShardInfo]:
        return [s for s in shards if not os.path.isfile(os.path.join(self.entry_dir(s), "done"))]

    def build(self, store: CorpusStore, model, shards: Seq[ShardInfo],
              log: Callable[[str], None] = print) -> dict[str, float]:
        """Compute every missing one of `shards`; returns tokens and seconds spent."""
        tokens, started = 0, time.perf_counter()
        for info in self.missing(shards):
            t0 = time.perf_counter()
            pairs = [(p.prompt_ids, p.answer_ids) for p in store.shard_pairs(info)]
            n = sum(len(a) + len(b) for a, b in pairs)
            path = self.entry_dir(info)
            self._write(path, pairs, model)
            with open(os.path.join(path, "done"), "w") as f:  # written last: a half-built entry is rebuilt
                json.dump({"tokens": n, "seconds": time.perf_counter() - t0}, f)
            tokens += n
            log(f"teacher {info.file}: {n} tokens in {time.perf_counter() - t0:.0f} s "
                f"({n / (time.perf_counter() - t0):.0f} tokens/s)")
        return {"tokens": tokens, "seconds": time.perf_counter() - started}

    def cost(self, info: ShardInfo) -> Optional[dict]:
        """{"tokens", "seconds"} the teacher prefill of a cached shard took (None for older entries)."""
        path = os.path.join(self.entry_dir(info), "done")
        text = open(path).read() if os.path.isfile(path) else ""
        return json.loads(text) if text.strip() else None

    def _write(self, path: str, pairs: list[tuple[list[int], list[int]]], model) -> None:
        os.makedirs(path, exist_ok=True)
        lens = [len(p) + len(a) for p, a in pairs]
        rows = [len(a) - 1 for _, a in pairs]
        seq_offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        row_offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        width = len(self.layer_ids) * model.config.hidden_size
        hidden = np.lib.format.open_memmap(os.path.join(path, "hidden.npy"), "w+", np.uint16, (int(seq_offsets[-1]), width))
        top_ids = np.lib.format.open_memmap(os.path.join(path, "top_ids.npy"), "w+", np.int32, (int(row_offsets[-1]), self.topk))
        top_probs = np.lib.format.open_memmap(os.path.join(path, "top_probs.npy"), "w+", np.float16,
                                              (int(row_offsets[-1]), self.topk))
        for at in range(0, len(pairs), CAPTURE_GROUP):
            for j, seq in enumerate(capture(model, pairs[at:at + CAPTURE_GROUP], self.layer_ids, self.topk)):
                i = at + j
                a, r = int(seq_offsets[i]), int(row_offsets[i])
                hidden[a:a + len(seq.ids)] = seq.hidden.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
                top_ids[r:r + seq.top_ids.shape[0]] = seq.top_ids.numpy()
                top_probs[r:r + seq.top_ids.shape[0]] = seq.top_probs.numpy()
        hidden.flush(), top_ids.flush(), top_probs.flush()
        np.save(os.path.join(path, "tokens.npy"), np.array([t for p, a in pairs for t in (*p, *a)], dtype=np.int32))
        np.save(os.path.join(path, "seq_offsets.npy"), seq_offsets)
        np.save(os.path.join(path, "row_offsets.npy"), row_offsets)
        np.save(os.path.join(path, "prompt_lens.npy"), np.array([len(p) for p, _ in pairs], dtype=np.int32))

    def load(self, info: ShardInfo) -> ShardTeacher:
        path = self.entry_dir(info)
        if not os.path.isfile(os.path.join(path, "done")):
            raise ConfigError(f"{info.file}: no teacher cache at {path} (build it first)")

        def arr(name: str, mmap: bool = True) -> np.ndarray:
            return np.load(os.path.join(path, name + ".npy"), mmap_mode="r" if mmap else None)

        return ShardTeacher(arr("hidden"), arr("top_ids"), arr("top_probs"), arr("tokens", False),
                            arr("seq_offsets", False), arr("row_offsets", False), arr("prompt_lens", False))


class TeacherCorpus:
    """Sequences of many cached shards, addressable by a flat index (drop-in for `Corpus` in training)."""

    def __init__(self, shards: list[ShardTeacher], layer_ids: Seq[int], topk: int, index: Optional[list] = None):
        self.shards = shards
        self.target_layer_ids, self.topk = list(layer_ids), topk
        self.index = index if index is not None else [(s, i) for s, sh in enumerate(shards) for i in range(len(sh))]

    def __len__(self) -> int:
        return len(self.index)

    def sequence(self, k: int) -> Sequence:
        s, i = self.index[k]
        return self.shards[s].sequence(i)

    @property
    def answer_tokens(self) -> int:
        return sum(int(self.shards[s].seq_offsets[i + 1] - self.shards[s].seq_offsets[i]) - int(self.shards[s].prompt_lens[i])
                   for s, i in self.index)

    def answers_and_top1(self):
        """(answer ids, teacher top-1 ids) per sequence, without touching the hidden states."""
        for s, i in self.index:
            sh = self.shards[s]
            a, b = int(sh.seq_offsets[i]) + int(sh.prompt_lens[i]), int(sh.seq_offsets[i + 1])
            r0, r1 = int(sh.row_offsets[i]), int(sh.row_offsets[i + 1])
            yield torch.from_numpy(sh.tokens[a:b].astype(np.int64)), torch.from_numpy(sh.top_ids[r0:r1, 0].astype(np.int64))

    def subset(self, positions: Seq[int]) -> "TeacherCorpus":
        return TeacherCorpus(self.shards, self.target_layer_ids, self.topk, [self.index[k] for k in positions])

    def materialise(self) -> Corpus:
        return Corpus([self.sequence(k) for k in range(len(self))], self.target_layer_ids, self.topk)
