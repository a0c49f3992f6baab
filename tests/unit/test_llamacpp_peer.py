"""The llama-cpp-python peer (bench/llamacpp.py) decodes the token its model computed. `Llama.scores`
is filled only when the model is opened with logits_all (the peer opens it without, as a server
would): an argmax over it decodes token 0 at every step, a timing and not a generation. Checked on
a stand-in for `Llama` that behaves as llama-cpp-python 0.3.36 does (seen on SmolLM2: the fixed loop
gives llama's own greedy tokens, the old one [0, 0, 0, 0])."""

from __future__ import annotations

import ctypes

import numpy as np

from specserve.bench import llamacpp

VOCAB = 16


class Context:
    """The last batch's logits, as llama_get_logits_ith(ctx, -1) hands them out: a float pointer."""

    def __init__(self) -> None:
        self.logits = (ctypes.c_float * VOCAB)()

    def get_logits_ith(self, i: int):
        assert i == -1
        return ctypes.cast(self.logits, ctypes.POINTER(ctypes.c_float))


class StandInLlama:
    """Each evaluated token t makes t + 3 (mod VOCAB) the most likely next one; `scores` stays zero,
    as without logits_all."""

    _logits_all = False

    def __init__(self) -> None:
        self._ctx, self.n_tokens = Context(), 0
        self.scores = np.zeros((64, VOCAB), dtype=np.float32)

    def n_vocab(self) -> int:
        return VOCAB

    def reset(self) -> None:
        self.n_tokens = 0

    def eval(self, tokens: list[int]) -> None:
        self.n_tokens += len(tokens)
        for j in range(VOCAB):
            self._ctx.logits[j] = 1.0 if j == (tokens[-1] + 3) % VOCAB else 0.0


def test_the_peer_decodes_the_token_its_model_computed():
    _, tokens = llamacpp.greedy_decode_tok_s(StandInLlama(), [1, 2], 5)
    assert tokens == [5, 8, 11, 14, 1]


def test_reading_scores_without_logits_all_decodes_a_constant(monkeypatch):
    """Mutation: the old loop's read (Llama.scores) planted back: every token is 0, which the
    check above would reject."""
    monkeypatch.setattr(llamacpp, "last_logits", lambda llm: llm.scores[llm.n_tokens - 1])
    _, tokens = llamacpp.greedy_decode_tok_s(StandInLlama(), [1, 2], 5)
    assert tokens == [0, 0, 0, 0, 0]
