"""Reasoning parsers (server/reasoning.py) on scripted replies: a stream cut anywhere (in two
pieces at every position, and one character at a time) adds up to the whole reply's split, with
the reasoning streamed or kept back until it ends; each format's own rules."""

from __future__ import annotations

import pytest

from specserve.server.reasoning import ReasoningSetup, Split

HARMONY_PROMPT = "<|start|>user<|message|>2+2?<|end|><|start|>assistant"
CALL = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>"
CASES = [
    # (parser, prompt, reply, reasoning, content)
    ("deepseek-r1", "<|im_start|>assistant\n<think>\n", "Let me add.\n2 + 2 = 4.\n</think>\n\nThe answer is 4.",
     "Let me add.\n2 + 2 = 4.", "The answer is 4."),
    ("deepseek-r1", "A:", "<think>\nhmm</think>Yes", "hmm", "Yes"),
    ("deepseek-r1", "A:", "cut off while thinking <thi", "cut off while thinking <thi", ""),
    ("qwen3", "A:", "<think>\nreason\n</think>\n\nanswer  ", "reason", "answer  "),
    ("qwen3", "A:", "plain answer, a <think> later is text", "", "plain answer, a <think> later is text"),
    ("qwen3", "A:", "  <thi", "", "  <thi"),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "opened by the template</think>rest", "opened by the template", "rest"),
    ("qwen3", "A:", "<think></think>\n\nno thoughts", "", "no thoughts"),
    ("gpt-oss", HARMONY_PROMPT, "<|channel|>analysis<|message|>User asks.<|end|><|start|>assistant<|channel|>final"
     "<|message|>It is 4.<|return|>", "User asks.", "It is 4."),
    ("gpt-oss", HARMONY_PROMPT, "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant" + CALL,
     "Need weather.", CALL),
]  # fmt: skip


def _streamed(setup: ReasoningSetup, pieces: list[str]) -> tuple[Split, list[Split]]:
    splitter, parts = setup.splitter(), []
    for piece in pieces:
        parts.append(splitter.feed(piece))
    parts.append(splitter.finish())
    total = Split()
    for part in parts:
        total += part
    return total, parts


@pytest.mark.parametrize("parser, prompt, reply, reasoning, content", CASES)
def test_a_reply_splits_alike_whole_and_streamed_cut_anywhere(parser, prompt, reply, reasoning, content):
    for stream_reasoning in (True, False):
        setup = ReasoningSetup.for_prompt(parser, prompt, stream_reasoning)
        assert setup.split(reply) == Split(reasoning, content)
        for cut in range(len(reply) + 1):
            assert _streamed(setup, [reply[:cut], reply[cut:]])[0] == Split(reasoning, content), cut
        assert _streamed(setup, list(reply))[0] == Split(reasoning, content)


def test_streamed_reasoning_comes_before_its_end_only_when_asked():
    reply = "<think>step one, step two</think>done"
    before_end = reply.index("</think>")
    live = ReasoningSetup.for_prompt("qwen3", "A:", True).splitter()
    assert live.feed(reply[:before_end]).reasoning == "step one, step two"
    held = ReasoningSetup.for_prompt("qwen3", "A:", False).splitter()
    assert held.feed(reply[:before_end]) == Split()
    assert held.feed(reply[before_end:]) == Split("step one, step two", "done")


def test_nothing_is_held_but_a_possible_marker_or_trailing_whitespace():
    splitter = ReasoningSetup.for_prompt("deepseek-r1", "A:", True).splitter()
    assert splitter.feed("thinking </th") == Split("thinking", "")  # " </th" may still close it
    assert splitter.feed("ey said") == Split(" </they said", "")
    assert splitter.feed("</think>\n\nAn") == Split("", "An")
    assert splitter.feed("swer") == Split("", "swer")


def test_no_parser_means_no_setup():
    assert ReasoningSetup.for_prompt(None, "A:<think>") is None


def test_template_variables_reach_the_template_and_its_prompt_decides_the_split():
    """Qwen3's enable_thinking through chat_template_kwargs: false closes an empty <think> in the
    prompt (the reply is all answer); a template that opens <think> itself starts the reply in it."""
    from specserve.errors import InvalidRequestError
    from specserve.tokenizer.chat_template import ChatTemplate

    qwen3 = ChatTemplate("{{ messages[0]['content'] }}|{% if enable_thinking is defined and not enable_thinking %}"
                         "<think>\n\n</think>\n\n{% endif %}")  # fmt: skip
    messages = [{"role": "user", "content": "hi"}]
    assert qwen3.render(messages) == "hi|"
    off = qwen3.render(messages, variables={"enable_thinking": False})
    assert off == "hi|<think>\n\n</think>\n\n"
    assert ReasoningSetup.for_prompt("qwen3", off).split("plain") == Split("", "plain")
    opened = ChatTemplate("{{ messages[0]['content'] }}<think>\n").render(messages)
    assert ReasoningSetup.for_prompt("qwen3", opened).split("why</think>so") == Split("why", "so")
    with pytest.raises(InvalidRequestError, match="'bos_token' is set by the server"):
        qwen3.render(messages, variables={"bos_token": "x"})
