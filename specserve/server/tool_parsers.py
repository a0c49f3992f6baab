"""Tool-call parsers (`--tool-call-parser`, SGLang's names): the calls a model writes in its own
format turned into OpenAI `tool_calls`, whole or as the reply streams (each call as soon as it is
complete; the text around calls as content as it comes), with the same result either way.

- `qwen25` (the default; Hermes, also what specserve asks of a template without a tool format):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks;
- `llama3`: a reply that is JSON, `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`), several separated by `;`;
- `gpt-oss`: harmony messages to a function, `<|channel|>commentary to=functions.NAME
  <|constrain|>json<|message|>{...}<|call|>` (what the gpt-oss reasoning parser leaves in the content).

A call that does not parse, or names a tool that was not offered, stays in the content as written.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Optional

# Nothing of server/tools.py here: it imports torch (through the server's errors), and the launcher
# reads the parser names before it starts the engine.
from specserve.server.reasoning import HARMONY_CHANNEL, HARMONY_MESSAGE, held_prefix

TOOL_CALL_PARSERS = ("qwen25", "llama3", "gpt-oss")
DEFAULT_TOOL_CALL_PARSER = "qwen25"
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
HARMONY_CALL = "<|call|>"
HARMONY_RECIPIENT = "to=functions."


def openai_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}  # fmt: skip


class ToolCallStream:
    """One reply's calls in one format (`parser`) among the offered tool `names`: feed() the
    reply's pieces, then finish(); each returns (content, completed calls)."""

    def __init__(self, parser: str, names: set[str]):
        self.parser, self.names = parser, names
        self.buf = ""
        self.mode = "start" if parser == "llama3" else "text"  # llama3 decides at the reply's first character

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.buf += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        if self.parser == "llama3":
            return self._llama3(final)
        open_, close = (HERMES_OPEN, HERMES_CLOSE) if self.parser == "qwen25" else (HARMONY_CHANNEL, HARMONY_CALL)
        content, calls = "", list[dict[str, Any]]()
        while True:
            if self.mode == "text":
                at = self.buf.find(open_)
                if at < 0:
                    keep = 0 if final else held_prefix(self.buf, open_)
                    content, self.buf = content + self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
                    return content, calls
                content, self.buf, self.mode = content + self.buf[:at], self.buf[at:], "block"
            end = self.buf.find(close)
            if end < 0:
                if final:  # an unclosed block: its text is content
                    content, self.buf = content + self.buf, ""
                return content, calls
            block, self.buf, self.mode = self.buf[: end + len(close)], self.buf[end + len(close) :], "text"
            call = self._block_call(block, open_, close)
            if call is None:
                content += block
            else:
                calls.append(call)

    def _block_call(self, block: str, open_: str, close: str) -> Optional[dict[str, Any]]:
        if self.parser == "qwen25":
            found = _json_object(block[len(open_) : -len(close)].strip())
            if found is None or not isinstance(found.get("arguments", {}), dict):
                return None
            return self._call(found.get("name"), found.get("arguments", {}))
        header, sep, body = block[len(open_) : -len(close)].partition(HARMONY_MESSAGE)
        recipient = next((w for w in header.split() if w.startswith(HARMONY_RECIPIENT)), None)
        arguments = _json_object(body.strip()) if sep else None
        if recipient is None or arguments is None:
            return None
        return self._call(recipient[len(HARMONY_RECIPIENT) :].split("<|")[0], arguments)

    def _llama3(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        if self.mode == "start":
            lead = self.buf.lstrip()
            if lead.startswith(PYTHON_TAG) or lead.startswith("{"):
                self.buf, self.mode = lead.removeprefix(PYTHON_TAG), "json"
            elif (PYTHON_TAG.startswith(lead) or not lead) and not final:
                return "", []
            else:
                self.mode = "text"
        if self.mode == "text":
            content, self.buf = self.buf, ""
            return content, []
        return self._llama3_calls(final)

    def _llama3_calls(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """Whole JSON objects off the front of the held text, `;` between them."""
        calls: list[dict[str, Any]] = []
        decoder = json.JSONDecoder()
        while True:
            text = self.buf.lstrip().removeprefix(";").lstrip()
            try:
                found, end = decoder.raw_decode(text)
            except json.JSONDecodeError:
                break
            params = found.get("parameters", found.get("arguments", {})) if isinstance(found, dict) else None
            call = self._call(found.get("name"), params) if isinstance(params, dict) else None
            if call is None:
                break
            calls.append(call)
            self.buf = text[end:]
        if final and self.buf.strip():  # what never parsed as a call is content
            content, self.buf = self.buf.strip(), ""
            return content, calls
        return "", calls

    def _call(self, name: Any, arguments: Any) -> Optional[dict[str, Any]]:
        if not isinstance(name, str) or name not in self.names or not isinstance(arguments, dict):
            return None
        return openai_call(name, arguments)


def _json_object(text: str) -> Optional[dict[str, Any]]:
    try:
        found = json.loads(text)
    except json.JSONDecodeError:
        return None
    return found if isinstance(found, dict) else None


def parse_tool_calls(parser: str, names: set[str], text: str) -> tuple[Optional[str], list[dict[str, Any]]]:
    """(content, calls) of a whole reply: without calls the content as written; with calls the
    text around them, stripped (None when empty)."""
    stream = ToolCallStream(parser, names)
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    content, calls = content + rest, calls + more
    return (content.strip() or None, calls) if calls else (content, [])


@dataclass(frozen=True)
class ToolFormat:
    """A request's offered tools (their names) and the server's tool-call format."""

    parser: str
    names: frozenset[str]

    def stream(self) -> Optional[ToolCallStream]:
        """A parser for one streamed reply; None without tools (the reply is all content)."""
        return ToolCallStream(self.parser, set(self.names)) if self.names else None

    def parse(self, text: str) -> tuple[Optional[str], list[dict[str, Any]]]:
        return parse_tool_calls(self.parser, set(self.names), text) if self.names else (text, [])
