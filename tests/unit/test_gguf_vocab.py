"""A SentencePiece-style GGUF vocabulary (`tokenizer.ggml.model = llama`: Llama 2, Mistral) written
in the test, read by the engine and by transformers from the same file: the same ids and text; the
merges recovered from the scores in the order transformers uses. (The Gemma flavour is checked on
the real Gemma 3 file in tests/integration/test_gemma3_gguf.py.)"""

from __future__ import annotations

import gguf
import pytest

from specserve.tokenizer.gguf_vocab import recovered_merges
from specserve.tokenizer.tokenizer import load_tokenizer

PIECES = ["▁", "t", "h", "e", "a", "n", "d", "o", "f", "i", "s", "w", "r", "l", "c", "▁t", "he", "▁the", "▁a", "an",
          "▁an", "▁and", "▁o", "▁of", "is", "▁is", "er", "▁w", "or", "ld", "▁wor", "▁world", "ll", "▁he", "▁hell", "▁hello"]
TEXTS = ["the and of is", " the world", "hello world", "tea", "ñandú 日本", "  two  spaces", "a\nb\tc", "", "the</s>end",
         "worldworld"]


@pytest.fixture(scope="module")
def spm_file(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("spm") / "vocab.gguf")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    types = [2, 3, 3] + [6] * 256 + [1] * len(PIECES)  # unknown, control, byte, normal
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(PIECES))])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_space_prefix(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_sentencepiece_vocabulary_matches_transformers(spm_file):
    import os

    import transformers

    ours = load_tokenizer(spm_file)
    hf = transformers.AutoTokenizer.from_pretrained(os.path.dirname(spm_file), gguf_file=os.path.basename(spm_file))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
    assert ours.encode("hello world")[:1] == [1], "BOS first, as llama.cpp adds it to a SentencePiece vocabulary"
    assert ours.eos_token_ids == (2,)
    pieces = ours.encode("ñ", add_special_tokens=False)  # the prefix space, then two UTF-8 byte tokens
    assert len(pieces) == 3 and b"".join(ours.token_bytes(t) for t in pieces) == " ñ".encode()


def test_recovered_merges_rank_by_score_then_longer_left_part():
    vocab = {t: i for i, t in enumerate(["a", "b", "c", "ab", "bc", "abc"])}
    rank = {"a": 0.0, "b": 0.0, "c": 0.0, "ab": -1.0, "bc": -2.0, "abc": -3.0}
    assert recovered_merges(vocab, rank) == [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]


def test_deepseek_r1_qwen_files_split_like_qwen2_every_digit_alone():
    """DeepSeek-R1-Distill-Qwen GGUFs name their pre-tokenizer 'deepseek-r1-qwen' (llama.cpp: QWEN2)."""
    from specserve.tokenizer.gguf_vocab import _byte_level_pre_tokenizer

    def pieces(pre: str) -> list[str]:
        return [p for p, _ in _byte_level_pre_tokenizer(pre).pre_tokenize_str("x=12345 ok")]

    assert pieces("deepseek-r1-qwen") == pieces("qwen2")
    assert "1" in pieces("qwen2") and pieces("llama3") != pieces("qwen2")  # llama3 groups three digits
