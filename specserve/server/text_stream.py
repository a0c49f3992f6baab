"""Streamed text of one choice: UTF-8-safe deltas that never show a stop string.

Text that could be the start of a stop string is held back until the next tokens decide it, and
nothing from the first full stop string on is ever sent: the engine ends the request there and its
final text is cut at the stop, so what was streamed is always a prefix of the final text.
"""

from __future__ import annotations

from specserve.tokenizer.detokenizer import IncrementalDetokenizer
from specserve.tokenizer.tokenizer import Tokenizer


class TextStream:
    """Turns token deliveries into text deltas for one choice."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str]):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = stops
        self.sent = ""
        self.num_tokens = 0

    def add(self, token_ids: list[int]) -> str:
        self.num_tokens += len(token_ids)
        self.detok.add(token_ids)
        return self._emit(self._safe_end(self.detok.text))

    def finish(self, final_text: str) -> str:
        """The rest of the engine's final text (already cut at a matched stop string)."""
        if not final_text.startswith(self.sent):  # cannot happen when deltas were prefixes; never resend
            return ""
        return self._emit(len(final_text), final_text)

    def _safe_end(self, text: str) -> int:
        end = len(text)
        for stop in self.stops:
            hit = text.find(stop, len(self.sent) - len(stop) + 1 if len(self.sent) >= len(stop) else 0)
            if hit >= 0:
                end = min(end, hit)
            for k in range(min(len(stop) - 1, len(text)), 0, -1):  # a suffix that may grow into the stop
                if text.endswith(stop[:k]):
                    end = min(end, len(text) - k)
                    break
        return max(end, len(self.sent))

    def _emit(self, end: int, text: str | None = None) -> str:
        text = self.detok.text if text is None else text
        delta = text[len(self.sent) : end]
        self.sent += delta
        return delta
