"""The self-distillation corpus: the target's own responses, its hidden states and its top-k.

1. Responses: the target answers real prompts greedily, batched through specserve's engine (the
   same weights and kernels that will serve the drafter).
2. Capture: one batched prefill over prompt + response per sequence records the target's hidden
   states at the drafter's `target_layer_ids` for every position (the drafter's context) and the
   target's top-k next-token distribution at every response position (the teacher for the TV loss;
   the full 49k-wide distribution would not fit in memory for a useful corpus).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from specserve.kv.pool import KVPool
from specserve.models.attention import AttentionMetadata
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
    sequences: list[Sequence]
    target_layer_ids: list[int]
    topk: int

    @property
    def response_tokens(self) -> int:
        return sum(s.response_len for s in self.sequences)

    def save(self, path: str) -> None:
        torch.save({"sequences": [vars(s) for s in self.sequences], "target_layer_ids": self.target_layer_ids,
                    "topk": self.topk}, path)

    @classmethod
    def load(cls, path: str) -> "Corpus":
        raw = torch.load(path, weights_only=True)
        return cls([Sequence(**s) for s in raw["sequences"]], list(raw["target_layer_ids"]), int(raw["topk"]))

    def split(self, held_out: int) -> tuple["Corpus", "Corpus"]:
        """The last `held_out` sequences for evaluation, the rest for training."""
        held_out = min(held_out, len(self.sequences) // 2)
        cut = len(self.sequences) - held_out
        return (Corpus(self.sequences[:cut], self.target_layer_ids, self.topk),
                Corpus(self.sequences[cut:], self.target_layer_ids, self.topk))


def generate_responses(engine, prompts: list[str], max_new_tokens: int, max_prompt_tokens: int = 768,
                       group: int = 400, progress: Optional[Callable[[int, int], None]] = None
                       ) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy response ids) per prompt that fits; responses keep their stop token."""
    tokenized = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    tokenized = [t for t in tokenized if len(t) <= max_prompt_tokens]
    params = {"temperature": 0, "max_new_tokens": max_new_tokens}
    out = []
    for start in range(0, len(tokenized), group):
        chunk = tokenized[start:start + group]
        for ids, res in zip(chunk, engine.generate(input_ids=chunk, sampling_params=params)):
            if len(res["output_ids"]) >= 2:
                out.append((ids, res["output_ids"]))
        if progress:
            progress(len(out), sum(len(r) for _, r in out))
    return out


@torch.inference_mode()
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
    meta = AttentionMetadata.build(table, list(range(len(seqs))), lens, lens, "cpu", model.dtype)
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


def build_corpus(engine, prompts: list[str], max_new_tokens: int, layer_ids: list[int], topk: int = 16,
                 log: Callable[[str], None] = print) -> Corpus:
    start = time.perf_counter()

    def progress(n: int, tokens: int) -> None:
        elapsed = time.perf_counter() - start
        log(f"responses: {n} sequences, {tokens} tokens, {tokens / elapsed:.0f} tokens/s")

    pairs = generate_responses(engine, prompts, max_new_tokens, progress=progress)
    mid = time.perf_counter()
    sequences = capture(engine.runner.model, pairs, layer_ids, topk)
    log(f"capture: {sum(len(s.ids) for s in sequences)} tokens in {time.perf_counter() - mid:.0f} s")
    return Corpus(sequences, list(layer_ids), topk)
