"""Tokenizer, chat template and incremental detokenizer against transformers' reading of the GGUF."""

from __future__ import annotations

import pytest

from specserve.tokenizer.detokenizer import IncrementalDetokenizer
from specserve.tokenizer.tokenizer import load_tokenizer

TEXTS = [
    "Hello, world! 12345 apples cost $3.50.",
    "  leading spaces\n\nand newlines\ttabs",
    "héllo wörld 日本語 🎉 naïve café",
    "<|im_start|>user\nhi<|im_end|>",
    "def f(x):\n    return x**2 + 1024  # comment",
    "Year 2026, pi=3.14159, phone 555-0123",
]


@pytest.fixture(scope="module")
def tok(model_path):
    return load_tokenizer(model_path)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_and_round_trips(tok, hf_tokenizer, text):
    ids = tok.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_digits_are_split_one_by_one(tok):
    ids = tok.encode("12345")
    assert [tok.decode([i]) for i in ids] == list("12345")


def test_special_tokens_and_eos(tok):
    assert tok.eos_token_ids == (2,)
    assert tok.encode("<|im_start|>") == [1]
    assert tok.decode([1, 2], skip_special_tokens=True) == ""


def test_chat_template_matches_transformers(tok, hf_tokenizer):
    for messages in ([{"role": "user", "content": "What is 2+2?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]):
        ours = tok.apply_chat_template(messages)
        ref = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ref = list(ref["input_ids"] if hasattr(ref, "keys") else ref)
        assert ours == ref
    text = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    assert "You are a helpful AI assistant named SmolLM" in text  # the template's default system prompt
    assert text.endswith("<|im_start|>assistant\n")


def test_chat_template_rejects_bad_messages(tok):
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match=r"messages\[0\].role"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])


@pytest.mark.parametrize("text", ["日本語のテキスト 🎉🎉 ok", "emoji 👩‍👩‍👧 family", "ascii only, fine."])
def test_incremental_detokenizer_never_emits_broken_utf8(tok, text):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt_ids=tok.encode("Prompt: "))
    pieces = [detok.add([i]) for i in ids]
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    assert sum(1 for p in pieces if p) > 1, "text arrives incrementally"
