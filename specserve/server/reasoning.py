"""Reasoning parsers (`--reasoning-parser`, SGLang's names): a reasoning model's reply split into
`reasoning_content` and `content`, whole or as it streams, with the same result either way.

- `deepseek-r1`: the reply is reasoning until `</think>` (the template opens the `<think>`; a
  leading `<think>` the model writes itself is dropped), the answer after it; a reply that never
  closes its reasoning is all reasoning.
- `qwen3`: reasoning only when the reply opens with `<think>`, or when the prompt already did (a
  thinking-only template); Qwen3 with `enable_thinking: false` answers directly, all content.
- `gpt-oss`: the harmony format's channels: `analysis` messages are reasoning, the `final`
  message's text is content, and any other message (a `commentary` tool call) stays in the
  content whole with its header, for the tool-call parser.

Whitespace around the markers belongs to neither part (the reasoning and the answer are stripped
where they meet). Streaming holds back only what could still be part of a marker, or whitespace
that may turn out to end the reasoning; everything else comes out as soon as it is generated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("deepseek-r1", "qwen3", "gpt-oss")


@dataclass
class Split:
    """A piece of a reply: its reasoning and its content (either may be empty)."""

    reasoning: str = ""
    content: str = ""

    def __iadd__(self, other: "Split") -> "Split":
        self.reasoning += other.reasoning
        self.content += other.content
        return self


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker` (held back, since
    the next piece may complete the marker)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class _Splitter:
    """Feeds pieces of a reply through a format's `_step` and releases the reasoning (at once, or,
    without stream_reasoning, whole when it ends)."""

    def __init__(self, stream_reasoning: bool):
        self.stream_reasoning = stream_reasoning
        self.buf, self.unsent = "", ""  # held text; reasoning kept back
        self.reasoning_done = False  # set by _step when a reasoning part ends: what was kept back goes

    def feed(self, text: str) -> Split:
        """The parts of the reply that `text` (its next piece) completes."""
        self.buf += text
        out = Split()
        while self._step(out):
            pass
        return self._release(out)

    def finish(self) -> Split:
        """What is left at the reply's end."""
        out = Split()
        self._flush(out)
        self.buf, self.reasoning_done = "", True  # whatever was kept back goes now
        return self._release(out)

    def _step(self, out: Split) -> bool:
        """One transition on the held text, adding to `out`; False when it needs more text."""
        raise NotImplementedError

    def _flush(self, out: Split) -> None:
        raise NotImplementedError

    def _release(self, out: Split) -> Split:
        self.unsent, out.reasoning = self.unsent + out.reasoning, ""
        if self.stream_reasoning or self.reasoning_done:
            self.unsent, out.reasoning, self.reasoning_done = "", self.unsent, False
        return out


class ThinkSplitter(_Splitter):
    """`<think>...</think>` reasoning (deepseek-r1, qwen3); `forced`: the reply starts inside it."""

    def __init__(self, forced: bool, stream_reasoning: bool = True):
        super().__init__(stream_reasoning)
        self.state, self.forced = "start", forced

    def _flush(self, out: Split) -> None:
        if self.state == "start":  # the reply ended while it could still have opened with <think>
            out.reasoning, out.content = (self.buf.strip(), "") if self.forced else ("", self.buf)
        elif self.state == "reasoning":  # never closed: all of it was reasoning
            out.reasoning = self.buf.rstrip()
        self.state = "done"

    def _step(self, out: Split) -> bool:
        if self.state == "start":
            lead = self.buf.lstrip()
            if lead.startswith(THINK_OPEN):
                self.buf, self.state = lead[len(THINK_OPEN) :], "reasoning-lead"
            elif THINK_OPEN.startswith(lead):
                return False  # nothing but whitespace, or a start of <think>, so far
            else:
                self.state = "reasoning-lead" if self.forced else "content"
            return True
        if self.state in ("reasoning-lead", "content-lead"):
            self.buf = self.buf.lstrip()
            if not self.buf:
                return False
            self.state = self.state.removesuffix("-lead")
            return True
        if self.state == "reasoning":
            return self._reasoning(out)
        out.content += self.buf  # content: verbatim
        self.buf = ""
        return False

    def _reasoning(self, out: Split) -> bool:
        end = self.buf.find(THINK_CLOSE)
        if end >= 0:
            out.reasoning += self.buf[:end].rstrip()
            self.buf, self.state = self.buf[end + len(THINK_CLOSE) :], "content-lead"
            self.reasoning_done = True
            return True
        keep = held_prefix(self.buf, THINK_CLOSE)
        body = self.buf[: len(self.buf) - keep]
        sent = body.rstrip()  # trailing whitespace waits: it may end the reasoning
        out.reasoning += sent
        self.buf = body[len(sent) :] + self.buf[len(self.buf) - keep :]
        return False


# The harmony format (gpt-oss): [<|start|>ROLE]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>TEXT END
HARMONY_START, HARMONY_CHANNEL, HARMONY_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")


class HarmonySplitter(_Splitter):
    """gpt-oss's channels (module docstring). The reply begins with an assistant message's header
    (the prompt ends with `<|start|>assistant`)."""

    def __init__(self, stream_reasoning: bool = True):
        super().__init__(stream_reasoning)
        self.channel: Optional[str] = None  # the open message's channel; None between messages
        self.header = ""

    def _step(self, out: Split) -> bool:
        if self.channel is None:
            at = self.buf.find(HARMONY_MESSAGE)
            if at < 0:
                return False  # headers are short: held until their <|message|>
            header = self.buf[:at]
            self.header = header[header.find(HARMONY_CHANNEL) :] if HARMONY_CHANNEL in header else header
            words = self.header.removeprefix(HARMONY_CHANNEL).split()
            self.channel = words[0] if words else ""
            self.buf = self.buf[at + len(HARMONY_MESSAGE) :]
            if self.channel not in ("analysis", "final"):
                out.content += self.header + HARMONY_MESSAGE  # a tool call or preamble: whole, for its parser
            return True
        ends = [(self.buf.find(e), e) for e in HARMONY_ENDS if e in self.buf]
        if ends:
            at, end = min(ends)
            self._body(self.buf[:at], out)
            if self.channel not in ("analysis", "final"):
                out.content += end
            self.reasoning_done = self.reasoning_done or self.channel == "analysis"
            self.buf, self.channel = self.buf[at + len(end) :], None
            return True
        keep = max(held_prefix(self.buf, e) for e in HARMONY_ENDS)
        self._body(self.buf[: len(self.buf) - keep], out)
        self.buf = self.buf[len(self.buf) - keep :]
        return False

    def _flush(self, out: Split) -> None:
        if self.channel is not None:  # cut off inside a message
            self._body(self.buf, out)
        elif self.buf.strip():  # an unfinished header: not a message, its text is kept
            out.content += self.buf

    def _body(self, text: str, out: Split) -> None:
        if self.channel == "analysis":
            out.reasoning += text
        else:
            out.content += text


@dataclass(frozen=True)
class ReasoningSetup:
    """How one request's replies split: the server's parser, and whether its prompt already opened
    the reasoning (a template that ends the generation prompt with `<think>`)."""

    parser: str
    opened: bool = False
    stream_reasoning: bool = True

    @classmethod
    def for_prompt(cls, parser: Optional[str], prompt: str, stream_reasoning: bool = True) -> Optional["ReasoningSetup"]:
        """None without a parser (the whole reply is content)."""
        if parser is None:
            return None
        return cls(parser, prompt.rstrip().endswith(THINK_OPEN), stream_reasoning)

    def splitter(self) -> _Splitter:
        if self.parser == "gpt-oss":
            return HarmonySplitter(self.stream_reasoning)
        return ThinkSplitter(forced=self.parser == "deepseek-r1" or self.opened, stream_reasoning=self.stream_reasoning)

    def split(self, text: str) -> Split:
        """A whole reply split (what the pieces of a stream add up to)."""
        splitter = self.splitter()
        out = splitter.feed(text)
        out += splitter.finish()
        return out
