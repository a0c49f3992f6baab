"""Structured outputs: a request's grammar (JSON schema, regex, GBNF or Lark) as an llguidance matcher.

llguidance was chosen over XGrammar by `python -m benchmarks grammar` (compile and mask time on the
same schemas and tokenizer, and which JSON-Schema features each enforces rather than accepts and
ignores); it also has no dependencies, where XGrammar needs torch, transformers, triton and a TVM
runtime beside our pinned CPU torch.

The compiler turns a spec into llguidance's grammar text once (cached by spec) and keeps one
template matcher per grammar; each request gets a deep copy. A request's `GrammarState` advances
only by committed tokens; masks for the rows of a verify window are computed by consuming the
window's drafts and rolling them back, so rejected drafts never reach the state.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from specserve.errors import InvalidRequestError
from specserve.sampling_params import GRAMMAR_FIELDS, MAX_GRAMMAR_CHARS

MAX_CACHED_GRAMMARS = 256
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class GrammarSpec:
    """One request's constraint: `kind` is a SamplingParams field name, `source` its text."""

    kind: str
    source: str

    @classmethod
    def of(cls, params: Any) -> Optional["GrammarSpec"]:
        given = [(k, getattr(params, k)) for k in GRAMMAR_FIELDS if getattr(params, k, None) is not None]
        return cls(*given[0]) if given else None  # SamplingParams.validate allows at most one


class GrammarCompiler:
    """Grammars for one tokenizer: spec -> llguidance grammar text -> template matcher (both cached)."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: Sequence[int]):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: Any = None  # llguidance's, made at the first grammar (about 0.2 s)
        self._templates: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()  # the engine thread checks, the forward stream makes states

    def check(self, spec: GrammarSpec) -> None:
        """Raise InvalidRequestError naming the field if the spec does not compile; caches it otherwise."""
        self._template(spec)

    def state(self, spec: GrammarSpec) -> "GrammarState":
        return GrammarState(self._template(spec).deep_copy(), self.vocab_size, self.eos_token_ids)

    def _template(self, spec: GrammarSpec):
        import llguidance

        with self._lock:
            template = self._templates.get(spec)
            if template is None:
                if self._tokenizer is None:
                    text = plain_added_tokens_as_vocabulary(self._tokenizer_json())
                    self._tokenizer = llguidance.LLTokenizer(text, eos_token=self.eos_token_ids)
                template = llguidance.LLMatcher(self._tokenizer, grammar_text(llguidance, spec), log_level=0)
                if template.is_error():
                    raise InvalidRequestError(
                        f"sampling_params.{spec.kind}: {_one_line(template.get_error())}",
                        param=f"sampling_params.{spec.kind}",
                    )
                self._templates[spec] = template
                if len(self._templates) > MAX_CACHED_GRAMMARS:
                    self._templates.popitem(last=False)
            self._templates.move_to_end(spec)
            return template


def plain_added_tokens_as_vocabulary(tokenizer_json: str) -> str:
    """The tokenizer for llguidance with every added token that is not special (Qwen's
    `<tool_call>`, `</tool_call>`) moved into the BPE vocabulary. llguidance takes added tokens
    for special ones: its mask then offers `<tool_call>` as the token but consuming that token
    fails the grammar's "<tool_call>" text; as a vocabulary entry only it is that text."""
    data = json.loads(tokenizer_json)
    vocab = data.get("model", {}).get("vocab")
    if not isinstance(vocab, dict):
        return tokenizer_json
    kept = []
    for token in data.get("added_tokens", []):
        text = token["content"]
        if (
            not token.get("special")
            and text.isprintable()
            and " " not in text
            and vocab.get(text, token["id"]) == token["id"]
        ):
            vocab[text] = token["id"]
        else:
            kept.append(token)
    data["added_tokens"] = kept
    return json.dumps(data)


def grammar_text(llg: Any, spec: GrammarSpec) -> str:
    """llguidance's grammar for a spec; InvalidRequestError for a malformed one."""
    field = f"sampling_params.{spec.kind}"
    if len(spec.source) > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(f"{field}: {len(spec.source)} characters, at most {MAX_GRAMMAR_CHARS}", param=field)
    try:
        if spec.kind == "json_schema":
            schema = json.loads(spec.source)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object")
            # json.dumps's separators, which the model writes unprompted (its drafts then fit too)
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if spec.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(spec.source)
        if spec.kind == "lark":
            return llg.LLMatcher.grammar_from_lark(spec.source)
        from llguidance.gbnf_to_lark import gbnf_to_lark

        return llg.LLMatcher.grammar_from_lark(gbnf_to_lark(spec.source))
    except Exception as exc:  # the grammar converters raise their own types for malformed input
        raise InvalidRequestError(f"{field}: {_one_line(str(exc))}", param=field) from None


class GrammarState:
    """One request's matcher: masks for its rows, advanced only by committed tokens."""

    def __init__(self, matcher: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)

    def commit(self, tokens: Sequence[int]) -> None:
        # After the request ends (EOS, a stop, its length) a step already in flight may commit more:
        # the matcher then errors, and nothing reads it again.
        self.matcher.consume_tokens(list(tokens))

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many leading drafts the grammar allows from here (the window ends after them)."""
        return self.matcher.validate_tokens(list(drafts)) if not self.matcher.is_error() else 0

    def mask_after(self, window: Sequence[int]) -> torch.Tensor:
        """Allowed next tokens [V] (bool) once `window` (drafts the grammar allows) followed the
        committed tokens. A window is consumed by a copy of the matcher: llguidance 1.9's rollback
        after a mask computed two tokens deep can leave the matcher allowing what its grammar
        does not (a JSON array took '":' after a string; tests/unit/test_grammar.py)."""
        matcher = self.matcher.deep_copy() if window else self.matcher
        if (window and matcher.try_consume_tokens(list(window)) < len(window)) or matcher.is_error():
            return self._nothing_allowed()
        return self._unpack(matcher.compute_bitmask())

    def _unpack(self, bitmask: bytes) -> torch.Tensor:
        words = torch.frombuffer(bytearray(bitmask), dtype=torch.int32)
        bits = (words.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        flat = bits.reshape(-1).bool()[: self.vocab_size]
        allowed[: len(flat)] = flat
        return allowed

    def _nothing_allowed(self) -> torch.Tensor:
        """A matcher in error (tokens committed past the grammar's end): only EOS, which ends the request."""
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        allowed[self.eos_token_ids] = True
        return allowed


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:297] + "..."
