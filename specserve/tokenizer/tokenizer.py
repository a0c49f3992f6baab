"""Tokenizer: from GGUF metadata (tokenizer/gguf_vocab.py) or a tokenizer.json, plus the chat template."""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Literal, Optional, Sequence, overload

from tokenizers import Tokenizer as HFTokenizer

from specserve.errors import ConfigError, InvalidRequestError
from specserve.tokenizer.chat_template import ChatTemplate
from specserve.tokenizer.gguf_vocab import SPACE, TOKEN_CONTROL, backend_from_gguf

# Control tokens that end a chat turn (ChatML, Llama 3, Gemma): a stop token wherever the file has one,
# as llama.cpp treats them, even when the file's eos_token_id names another.
TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>")


class Tokenizer:
    """Encode, decode and render chat prompts; one object for GGUF and Hugging Face models."""

    def __init__(
        self,
        backend: HFTokenizer,
        eos_token_ids: Sequence[int],
        bos_token_id: Optional[int],
        chat_template: Optional[str],
        add_bos: bool = False,
        sentencepiece: bool = False,
    ):
        self.backend = backend
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos
        self.sentencepiece = sentencepiece  # pieces spell spaces "▁" and bytes "<0xAB>" (else byte-level BPE)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = ChatTemplate(chat_template, *self.chat_template_tokens()) if chat_template else None
        self._special_ids = {t_id for t_id, tok in backend.get_added_tokens_decoder().items() if tok.special}
        self._added_ids = set(backend.get_added_tokens_decoder())

    def chat_template_tokens(self) -> tuple[str, str]:
        """(bos_token, eos_token) as a chat template sees them."""
        bos = self.backend.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None
        return bos or "", self.backend.id_to_token(self.eos_token_ids[0]) or ""

    @property
    def eos_token_id(self) -> int:
        return self.eos_token_ids[0]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self.backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: a byte-level BPE symbol mapped back to its bytes, or a
        SentencePiece byte token's byte (a token may hold part of a UTF-8 character); an added
        token's own text."""
        piece = self.backend.id_to_token(token_id) or ""
        if token_id in self._added_ids:
            return piece.encode()
        if self.sentencepiece:
            is_byte = len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
            return bytes([int(piece[3:5], 16)]) if is_byte else piece.replace(SPACE, " ").encode()
        table = _byte_decoder()
        if not all(c in table for c in piece):
            return piece.encode()
        return bytes(table[c] for c in piece)

    @overload
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tokenize: Literal[True] = True
    ) -> list[int]: ...

    @overload
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *, tokenize: Literal[False]
    ) -> str: ...

    @overload
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tokenize: bool = True
    ) -> list[int] | str: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tokenize: bool = True
    ) -> list[int] | str:
        """Render messages with the model's template; token ids by default, as transformers does."""
        text = self.render_chat(messages, add_generation_prompt)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, variables: Optional[dict[str, Any]] = None
    ) -> str:
        """The template's text for messages, with extra template `variables` (e.g. enable_thinking)."""
        if self.chat_template is None:
            raise InvalidRequestError("messages: this model has no chat template", param="messages")
        return self.chat_template.render(messages, add_generation_prompt, variables)


def load_tokenizer(path: str, gguf_reader: Any = None, chat_template: Optional[str] = None) -> Tokenizer:
    """Tokenizer from a GGUF file (optionally its already read GGUFFile) or a tokenizer.json
    directory; `chat_template` names a Jinja file that replaces the model's template."""
    if os.path.isdir(path):
        tokenizer = _from_hf_dir(path)
    elif path.endswith(".gguf"):
        tokenizer = _from_gguf(path, gguf_reader)
    else:
        raise ConfigError(f"tokenizer_path: {path!r} is neither a .gguf file nor a directory with tokenizer.json")
    if chat_template is not None:
        with open(chat_template) as f:
            tokenizer.chat_template = ChatTemplate(f.read(), *tokenizer.chat_template_tokens())
    return tokenizer


def _from_gguf(path: str, reader: Any = None) -> Tokenizer:
    from specserve.models.gguf_file import GGUFFile
    from specserve.models.loader import gguf_field

    reader = reader or GGUFFile(path)

    def field(key: str, default: Any = None) -> Any:
        return gguf_field(reader, key, default)

    backend, kind = backend_from_gguf(field, field("general.architecture", ""))
    tokens = field("tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    eot = gguf_field(reader, "tokenizer.ggml.eot_token_id")
    turn_ends = [vocab[t] for t in TURN_END_TOKENS if t in vocab and types[vocab[t]] == TOKEN_CONTROL]
    eos_ids = [int(x) for x in (eos, eot) if x is not None] + turn_ends
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    return Tokenizer(
        backend,
        eos_ids,
        None if bos is None else int(bos),
        gguf_field(reader, "tokenizer.chat_template"),
        add_bos=bool(field("tokenizer.ggml.add_bos_token", kind == "llama")),
        sentencepiece=kind == "llama",
    )


def _from_hf_dir(path: str) -> Tokenizer:
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
        raise ConfigError(f"tokenizer_path: {path!r} has no tokenizer.json")
    backend = HFTokenizer.from_file(file)
    tok_cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
    gen_cfg = _read_json(os.path.join(path, "generation_config.json"))
    model_cfg = _read_json(os.path.join(path, "config.json"))

    def token_id(value) -> Optional[int]:
        if isinstance(value, dict):
            value = value.get("content")
        return backend.token_to_id(value) if isinstance(value, str) else None

    eos_ids: list[int] = []
    for source in (gen_cfg.get("eos_token_id"), model_cfg.get("eos_token_id")):
        if isinstance(source, int):
            eos_ids.append(source)
        elif isinstance(source, list):
            eos_ids.extend(int(x) for x in source)
    tok_eos = token_id(tok_cfg.get("eos_token"))
    if tok_eos is not None:
        eos_ids.append(tok_eos)
    if not eos_ids:
        raise ConfigError(f"tokenizer_path: {path!r} names no eos token")
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    return Tokenizer(
        backend, eos_ids, token_id(tok_cfg.get("bos_token")), template, add_bos=bool(tok_cfg.get("add_bos_token", False))
    )


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: each of the 256 bytes has one printable character."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars
