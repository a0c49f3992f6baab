"""A reasoning parser through the real server and the official `openai` client: the embedded
model's reply is forced by a regex into a DeepSeek-R1-style `<think>` block and an answer, which
come back as `reasoning_content` and `content`, alike whole and streamed (live, or the reasoning
whole once it ends), counted in usage; `separate_reasoning: false` keeps it all in `content`."""

from __future__ import annotations

import httpx
import pytest

from helpers import ServerProcess

REASONING, ANSWER = "I add two and two.", "The answer is 4."
FORCED = {"regex": r"<think>\nI add two and two\.\n</think>\n\nThe answer is 4\."}
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def reasoning_server(tmp_path_factory):
    srv = ServerProcess("--reasoning-parser", "deepseek-r1", "--speculative-algorithm", "NONE",
                        "--max-total-tokens", "4096", log_path=str(tmp_path_factory.mktemp("rs") / "server.log"))  # fmt: skip
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(reasoning_server):
    import openai

    return openai.OpenAI(base_url=reasoning_server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _ask(client, **extra):
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=64,
                                          temperature=0, extra_body={**FORCED, **extra})  # fmt: skip


def test_reasoning_and_answer_come_apart_with_their_token_count(client):
    reply = _ask(client)
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == (REASONING, ANSWER)
    assert reply.usage.completion_tokens_details.reasoning_tokens > 0
    whole = _ask(client, separate_reasoning=False).choices[0].message
    assert whole.content == f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"
    assert getattr(whole, "reasoning_content", None) is None


@pytest.mark.parametrize("stream_reasoning", [True, False])
def test_a_stream_adds_up_to_the_whole_reply(client, stream_reasoning):
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=64, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={**FORCED, "stream_reasoning": stream_reasoning},
    )  # fmt: skip
    reasoning, content, usage = [], [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            reasoning += [choice.delta.reasoning_content] if getattr(choice.delta, "reasoning_content", None) else []
            content += [choice.delta.content] if choice.delta.content else []
    assert ("".join(reasoning), "".join(content)) == (REASONING, ANSWER)
    assert len(reasoning) == 1 or stream_reasoning  # kept back: one delta, once the reasoning ended
    assert usage.completion_tokens_details.reasoning_tokens == _ask(client).usage.completion_tokens_details.reasoning_tokens


def test_template_variables_the_server_sets_and_two_constraints_are_400(reasoning_server):
    url, model = reasoning_server.url + "/v1/chat/completions", "x"
    model = httpx.get(reasoning_server.url + "/v1/models").json()["data"][0]["id"]
    taken = httpx.post(url, json={"model": model, "messages": MESSAGES, "chat_template_kwargs": {"messages": []}})
    assert taken.status_code == 400 and taken.json()["error"]["param"] == "chat_template_kwargs"
    both = httpx.post(url, json={"model": model, "messages": MESSAGES, **FORCED, "ebnf": 'root ::= "a"'})
    assert both.status_code == 400 and "both constrain the output" in both.json()["error"]["message"]


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
THEN_CALL = {"regex": r'<think>\nI need the weather\.\n</think>\n\n<tool_call>\n\{"name": "get_weather", '
                      r'"arguments": \{"city": "Paris"\}\}\n</tool_call>'}  # fmt: skip


def test_reasoning_then_a_call_under_tool_choice_auto_whole_and_streamed(client):
    """The reply reasons, then writes a call in its own (Hermes) format: reasoning_content and
    tool_calls, finish_reason tool_calls; streamed, the reasoning deltas and then the call's delta."""
    ask = dict(model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=96, temperature=0,
               tools=[WEATHER], tool_choice="auto", extra_body=THEN_CALL)  # fmt: skip
    whole = client.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.reasoning_content == "I need the weather."
    assert whole.message.content is None
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    kinds, calls, finish = [], [], None
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            if getattr(choice.delta, "reasoning_content", None):
                kinds.append("reasoning")
            if choice.delta.tool_calls:
                kinds.append("call")
                calls += [(c.index, c.function.name, c.function.arguments) for c in choice.delta.tool_calls]
    assert finish == "tool_calls" and calls == [(0, "get_weather", '{"city": "Paris"}')]
    assert kinds[0] == "reasoning" and kinds[-1] == "call" and kinds.count("call") == 1
