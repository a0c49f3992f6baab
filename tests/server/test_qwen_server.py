"""The real Qwen2.5-Coder-0.5B-Instruct Q4_K_M file served over HTTP (bf16, its GGUF codes in the
CPU kernels with int8 activations, this file's default under `--cpu-activations auto`; NGRAM on
request) and driven with the official `openai` client: chat, streaming that reassembles to the
same text, a forced tool call with valid arguments, and a json_schema response."""

from __future__ import annotations

import json

import jsonschema
import pytest

from helpers import API_KEY, ServerProcess
from tests.server.test_openai_structured import PERSON, WEATHER
from specserve.models.packaged import packaged_model_path

NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    import openai

    srv = ServerProcess("--model-path", packaged_model_path(NAME), "--api-key", API_KEY, "--max-total-tokens", "4096",
                        "--speculative-algorithm", "NGRAM", log_path=str(tmp_path_factory.mktemp("qwen") / "server.log"))
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    assert srv.stop() == 0, srv.log()


def test_models_lists_the_file_and_chat_answers(qwen):
    assert [m.id for m in qwen.models.list().data] == [NAME]
    reply = qwen.chat.completions.create(model=NAME, temperature=0, max_tokens=32, messages=[
        {"role": "user", "content": "Write a Python function that returns the square of x."}])
    assert "def " in reply.choices[0].message.content and reply.usage.completion_tokens > 0


def test_stream_reassembles_to_the_same_text(qwen):
    kw = dict(model=NAME, temperature=0, max_tokens=24, messages=[{"role": "user", "content": "What is a tuple?"}])
    whole = qwen.chat.completions.create(**kw).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in qwen.chat.completions.create(stream=True, **kw) if c.choices]
    assert "".join(parts) == whole and whole


def test_forced_tool_call_and_json_schema_are_valid(qwen):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = qwen.chat.completions.create(model=NAME, temperature=0, max_tokens=64, messages=ask, tools=[WEATHER],
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert call.choices[0].message.tool_calls, call.choices[0].message
    tool = call.choices[0].message.tool_calls[0]
    assert tool.function.name == "get_weather"
    jsonschema.validate(json.loads(tool.function.arguments), WEATHER["function"]["parameters"])
    person = qwen.chat.completions.create(
        model=NAME, temperature=0, max_tokens=64, messages=[{"role": "user", "content": "Invent a person."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(person.choices[0].message.content), PERSON)
