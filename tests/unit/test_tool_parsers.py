"""Tool-call parsers (server/tool_parsers.py) on scripted replies in each model's format: cut
anywhere in a stream (two pieces at every position, or one character at a time) they give the
whole reply's calls, in order, and its content; calls that do not parse or name a tool not
offered stay content; a call is out as soon as it is complete."""

from __future__ import annotations

import json

import pytest

from specserve.server.tool_parsers import ToolCallStream, parse_tool_calls

NAMES = {"get_weather"}
PARIS, ROME = {"city": "Paris"}, {"city": "Rome"}
HARMONY = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{0}<|call|>"
CASES = [
    # (parser, reply, content, calls' arguments)
    ("qwen25", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>', "Sure.", [PARIS, ROME]),
    ("qwen25", "no call, a <tool_ that is text", "no call, a <tool_ that is text", []),
    ("qwen25", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', []),
    ("qwen25", "<tool_call>\n{not json}\n</tool_call> then text", "<tool_call>\n{not json}\n</tool_call> then text", []),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
               '{"name": "get_weather", "parameters": {"city": "Rome"}}', None, [PARIS, ROME]),
    ("llama3", "The weather is fine.", "The weather is fine.", []),
    ("llama3", '{"answer": 4}', '{"answer": 4}', []),
    ("gpt-oss", "Let me check." + HARMONY.format(json.dumps(PARIS)), "Let me check.", [PARIS]),
    ("gpt-oss", "<|channel|>commentary<|message|>Checking now.<|end|>",
     "<|channel|>commentary<|message|>Checking now.<|end|>", []),
]  # fmt: skip


def _arguments(calls) -> list[dict]:
    assert all(c["function"]["name"] == "get_weather" and c["type"] == "function" for c in calls)
    return [json.loads(c["function"]["arguments"]) for c in calls]


def _streamed(parser: str, pieces: list[str]):
    stream, content, calls = ToolCallStream(parser, NAMES), "", []
    for piece in [*pieces, None]:
        text, done = stream.feed(piece) if piece is not None else stream.finish()
        content, calls = content + text, calls + done
    return content, calls


@pytest.mark.parametrize("parser, reply, content, arguments", CASES)
def test_a_reply_parses_alike_whole_and_streamed_cut_anywhere(parser, reply, content, arguments):
    whole_content, calls = parse_tool_calls(parser, NAMES, reply)
    assert (whole_content, _arguments(calls)) == (content, arguments)
    for pieces in [[reply[:cut], reply[cut:]] for cut in range(len(reply) + 1)] + [list(reply)]:
        text, streamed = _streamed(parser, pieces)
        assert _arguments(streamed) == arguments
        assert (text.strip() or None if streamed else text) == content


def test_a_call_comes_out_when_it_is_complete():
    stream = ToolCallStream("qwen25", NAMES)
    assert stream.feed("Checking.\n<tool_call>\n") == ("Checking.\n", [])
    assert stream.feed('{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool') == ("", [])
    content, calls = stream.feed("_call>\nDone.")
    assert content == "\nDone." and _arguments(calls) == [PARIS]
