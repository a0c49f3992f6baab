"""Incremental detokenization that never emits a broken UTF-8 character."""

from __future__ import annotations

from specserve.tokenizer.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    It decodes a short window of recent tokens twice (up to the last emitted token and
    up to the newest) and emits the difference, holding back text that ends in U+FFFD,
    the mark of a multi-byte character whose remaining bytes have not arrived yet.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, window: int = 5):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-window:]) if prompt_ids else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        self.ids.extend(token_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a stream: emit whatever is held back, replacement characters included."""
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        delta = full[len(prefix) :] if full.startswith(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
