"""The tokenizer a GGUF describes, built with the `tokenizers` library from the file's vocabulary.

- `gpt2` (byte-level BPE): the file's merges, split first by the regex its `tokenizer.ggml.pre`
  names (as llama.cpp and the models' tokenizer.json files do).
- `llama` (SentencePiece-style BPE: Gemma, older Llama and Mistral): byte fallback, spaces as "▁".
  Such files list no merges, so they are recovered from the vocabulary: every token that two
  tokens concatenate to gives a merge, ranked by the token's score, or for Gemma by its place in
  the file (Gemma's scores do not follow its merge order). Gemma writes no space before the first
  word; other SentencePiece models do unless the file says `add_space_prefix = false`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from specserve.errors import ConfigError

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
SPACE = "\u2581"  # SentencePiece's visible space

# The split regexes of the byte-level BPE pre-tokenizers a GGUF names: Llama 3 groups up to three
# digits, Qwen2 splits every digit; both keep a leading non-letter with the word that follows it.
_WORD_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|{digits}| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-4o's (o200k, gpt-oss's "gpt-4o" pre-tokenizer): cased words with a contraction suffix, digits
# in threes, punctuation runs keeping a trailing "/" or newlines.
_GPT4O_SPLIT = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
SPLIT_REGEXES = {
    "llama-bpe": _WORD_SPLIT.format(digits=r"\p{N}{1,3}"),
    "llama3": _WORD_SPLIT.format(digits=r"\p{N}{1,3}"),
    "qwen2": _WORD_SPLIT.format(digits=r"\p{N}"),
    # DeepSeek-R1's Qwen distills: Qwen2's tokenizer under its own name (llama.cpp maps it to QWEN2)
    "deepseek-r1-qwen": _WORD_SPLIT.format(digits=r"\p{N}"),
    "gpt-4o": _GPT4O_SPLIT,
}


def backend_from_gguf(field: Callable[..., Any], architecture: str) -> tuple[HFTokenizer, str]:
    """(backend, kind) from the file's tokenizer fields (`field(key, default)` reads one); kind is
    "gpt2" or "llama". Control and user-defined tokens are added whole."""
    kind = field("tokenizer.ggml.model")
    tokens = field("tokenizer.ggml.tokens")
    if kind == "gpt2":
        merges = [(left, right) for left, right in (m.split(" ", 1) for m in field("tokenizer.ggml.merges"))]
        backend = byte_level_backend(tokens, merges, field("tokenizer.ggml.pre", "default"))
    elif kind == "llama":
        gemma = architecture.startswith("gemma")
        scores = field("tokenizer.ggml.scores")
        backend = sentencepiece_backend(tokens, scores, gemma, bool(field("tokenizer.ggml.add_space_prefix", not gemma)))
    else:
        raise ConfigError(f"tokenizer_path: GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama)")
    types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
    known = backend.get_vocab()  # a user-defined token the vocabulary spells otherwise (Gemma's blanks) stays out
    backend.add_tokens(
        [
            AddedToken(tokens[i], special=types[i] == TOKEN_CONTROL, normalized=False)
            for i in range(len(tokens))
            if types[i] == TOKEN_CONTROL or types[i] == TOKEN_USER_DEFINED and tokens[i] in known
        ]
    )
    return backend, kind


def byte_level_backend(tokens: list[str], merges: list[tuple[str, str]], pre: str) -> HFTokenizer:
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _byte_level_pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # SmolLM splits every digit off first, then applies the GPT-2 regex.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("default", "gpt2", "gpt-2"):
        return byte_level
    if pre in SPLIT_REGEXES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(SPLIT_REGEXES[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    supported = ", ".join(["default", "gpt2", "smollm", *SPLIT_REGEXES])
    raise ConfigError(f"tokenizer_path: GGUF pre-tokenizer {pre!r} is not supported (supported: {supported})")


def sentencepiece_backend(
    tokens: list[str], scores: Optional[list[float]], rank_by_file_order: bool, space_prefix: bool
) -> HFTokenizer:
    if rank_by_file_order:  # Gemma stores a token of blanks with real spaces: spell it as SentencePiece does
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    if not rank_by_file_order and scores is None:
        raise ConfigError("tokenizer_path: a SentencePiece-style GGUF vocabulary without scores")
    rank = {}
    for i, tok in enumerate(tokens):  # a token listed twice keeps its first place and its last rank
        rank[tok] = -i if rank_by_file_order else scores[i]  # type: ignore[index]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = HFTokenizer(
        models.BPE(vocab=vocab, merges=recovered_merges(vocab, rank), fuse_unk=True, unk_token="<unk>", byte_fallback=True)
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if rank_by_file_order:
        backend.normalizer = normalizers.Replace(" ", SPACE)
    else:
        scheme = "first" if space_prefix else "never"
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme=scheme, split=False)
        steps += [decoders.Strip(content=" ", left=1)] if space_prefix else []
    backend.decoder = decoders.Sequence(steps)
    return backend


def recovered_merges(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """Every (left, right) whose concatenation is a token, best-ranked token first; among a token's
    own splits the longer left part first, then by the parts' ids (the order transformers uses)."""
    found: list[tuple[str, str, float]] = []
    for tok, score in rank.items():
        splits = [(tok[:k], tok[k:]) for k in range(1, len(tok)) if tok[:k] in vocab and tok[k:] in vocab]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        found.extend((left, right, score) for left, right in splits)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]
