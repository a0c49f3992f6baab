"""The target's view of a prompt + response: its hidden states and its top-k, by one prefill.

`capture` runs one batched prefill over prompt + response per sequence and records the target's
hidden states at the drafter's `target_layer_ids` for every position (the drafter's context) and
the target's top-k next-token distribution at every response position (the teacher for the TV
loss; the full 49k-wide distribution would not fit in memory for a useful corpus). The responses
themselves come from the corpus store (`corpus_store.py`, `sources.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kv.pool import KVPool
from specserve.models.forward_batch import ForwardBatch
from specserve.models.llama import LlamaForCausalLM


@dataclass
class Sequence:
    """One prompt + response. Teacher rows cover positions prompt_len .. len - 2 (row r predicts r + 1)."""

    ids: torch.Tensor  # [T] int64
    prompt_len: int
    hidden: torch.Tensor  # [T, len(layers) * H] bfloat16
    top_ids: torch.Tensor  # [T - 1 - prompt_len, K] int64
    top_probs: torch.Tensor  # [T - 1 - prompt_len, K] float32

    @property
    def response_len(self) -> int:
        return self.ids.shape[0] - self.prompt_len


@dataclass
class Corpus:
    """Sequences held in memory (the held-out set; training reads `teacher.TeacherCorpus`)."""

    sequences: list[Sequence]
    target_layer_ids: list[int]
    topk: int


def capture(model: LlamaForCausalLM, pairs: list[tuple[list[int], list[int]]], layer_ids: list[int], topk: int,
            max_tokens: int = 2048) -> list[Sequence]:
    """Batched prefills over prompt + response with the layers' hidden states and the teacher top-k."""
    cfg = model.config
    kv = KVPool(max(max_tokens, max(len(p) + len(r) for p, r in pairs)), cfg.num_layers, cfg.num_kv_heads,
                cfg.head_dim, model.dtype, "cpu")
    out: list[Sequence] = []
    chunk: list[tuple[list[int], list[int]]] = []
    for pair in pairs:
        if chunk and sum(len(p) + len(r) for p, r in chunk) + len(pair[0]) + len(pair[1]) > max_tokens:
            out += _capture_chunk(model, kv, chunk, tuple(layer_ids), topk)
            chunk = []
        chunk.append(pair)
    if chunk:
        out += _capture_chunk(model, kv, chunk, tuple(layer_ids), topk)
    return out


def _capture_chunk(model, kv, chunk, layer_ids: tuple[int, ...], topk: int) -> list[Sequence]:
    seqs = [p + r for p, r in chunk]
    lens = [len(s) for s in seqs]
    table = torch.zeros(len(seqs), max(lens), dtype=torch.int64)
    starts, offset = [], 0
    for i, n in enumerate(lens):
        table[i, :n] = torch.arange(offset + 1, offset + n + 1)  # slot 0 is the scratch slot
        starts.append(offset)
        offset += n
    rows = [starts[i] + r for i, (p, _) in enumerate(chunk) for r in range(len(p), lens[i] - 1)]
    meta = model.ops.attention_metadata(table, list(range(len(seqs))), lens, lens, "cpu")
    fb = ForwardBatch(input_ids=torch.tensor([t for s in seqs for t in s]),
                      positions=torch.cat([torch.arange(n) for n in lens]),
                      out_cache_loc=torch.arange(1, offset + 1), attn=meta, logit_rows=torch.tensor(rows),
                      capture_layer_ids=layer_ids)
    logits = model(fb, kv)
    top_probs, top_ids = torch.softmax(logits, -1).topk(topk, -1)
    out, row = [], 0
    for i, (prompt, _) in enumerate(chunk):
        n_rows = lens[i] - 1 - len(prompt)
        out.append(Sequence(torch.tensor(seqs[i]), len(prompt), fb.captured_hidden[starts[i]:starts[i] + lens[i]].clone(),
                            top_ids[row:row + n_rows].clone(), top_probs[row:row + n_rows].float().clone()))
        row += n_rows
    return out
