"""gpt-oss's harmony format through the real server and the official `openai` client, with a
harmony-style chat template of the test's own (`--chat-template`) on the embedded model: the reply,
forced by a regex into an analysis message and then a final one, comes back as `reasoning_content`
and `content`; forced into an analysis message and then a call on the commentary channel under
`tool_choice: "auto"`, as `reasoning_content` and `tool_calls`, whole and streamed;
`reasoning_effort` reaches the template (and a level the API does not name is a 400)."""

from __future__ import annotations

import httpx
import pytest

from helpers import ServerProcess

# The harmony layout (a system message carrying the reasoning level, one message per turn, the
# reply opened as an assistant message); not gpt-oss's own template, which the test has no copy of.
TEMPLATE = (
    "{% if reasoning_effort is defined %}<|start|>system<|message|>Reasoning: {{ reasoning_effort }}<|end|>{% endif %}"
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
ANSWERED = {"regex": r"<\|channel\|>analysis<\|message\|>I add two and two\.<\|end\|><\|start\|>assistant"
                     r"<\|channel\|>final<\|message\|>The answer is 4\.<\|return\|>"}  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
CALLED = {"regex": r"<\|channel\|>analysis<\|message\|>I need the weather\.<\|end\|><\|start\|>assistant"
                   r"<\|channel\|>commentary to=functions\.get_weather <\|constrain\|>json<\|message\|>"
                   r'\{"city": "Paris"\}<\|call\|>'}  # fmt: skip


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("harmony")
    template = folder / "harmony.jinja"
    template.write_text(TEMPLATE)
    srv = ServerProcess("--reasoning-parser", "gpt-oss", "--tool-call-parser", "gpt-oss", "--chat-template",
                        str(template), "--speculative-algorithm", "NONE", "--max-total-tokens", "4096",
                        log_path=str(folder / "server.log"))  # fmt: skip
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(harmony_server):
    import openai

    return openai.OpenAI(base_url=harmony_server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _ask(client, forced, **extra):
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=96,
                                          temperature=0, extra_body=forced, **extra)  # fmt: skip


def test_analysis_then_final_come_apart(client):
    message = _ask(client, ANSWERED).choices[0].message
    assert (message.reasoning_content, message.content) == ("I add two and two.", "The answer is 4.")


def test_a_call_on_the_commentary_channel_is_a_tool_call_whole_and_streamed(client):
    whole = _ask(client, CALLED, tools=[WEATHER], tool_choice="auto").choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.reasoning_content == "I need the weather."
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    calls, reasoning, finish = [], [], None
    stream = client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=96,
                                            temperature=0, tools=[WEATHER], tool_choice="auto", stream=True,
                                            extra_body=CALLED)  # fmt: skip
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            reasoning += [choice.delta.reasoning_content] if getattr(choice.delta, "reasoning_content", None) else []
            calls += [(c.function.name, c.function.arguments) for c in choice.delta.tool_calls or []]
    assert finish == "tool_calls" and "".join(reasoning) == "I need the weather."
    assert calls == [("get_weather", '{"city": "Paris"}')]


def test_reasoning_effort_reaches_the_template_and_an_unknown_level_is_400(client, harmony_server):
    plain = _ask(client, ANSWERED).usage.prompt_tokens
    assert _ask(client, ANSWERED, reasoning_effort="high").usage.prompt_tokens > plain
    model = client.models.list().data[0].id
    bad = httpx.post(harmony_server.url + "/v1/chat/completions",
                     json={"model": model, "messages": MESSAGES, "reasoning_effort": "extreme"})  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"
