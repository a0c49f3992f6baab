"""Structured outputs and tool calls through the live server with the official `openai` client
(the default engine: int8 activations, the adaptive policy over DSPARK and NGRAM)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from helpers import MODEL

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 24}},
                                                "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _chat(client, messages=None, **kw):
    kw.setdefault("max_tokens", 96)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=messages or ASK, **kw)


def test_json_schema_response_validates(client):
    resp = _chat(client, messages=[{"role": "user", "content": "Describe Ann, 31, as JSON."}],
                 response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                         "strict": True}})
    jsonschema.validate(json.loads(resp.choices[0].message.content), PERSON)
    # A prompt the default model answers briefly: an object cut at max_tokens would prove nothing.
    obj = _chat(client, messages=[{"role": "user", "content": "Give me a JSON object with one key."}], max_tokens=160,
                response_format={"type": "json_object"}, extra_body={"ignore_eos": False})
    assert obj.choices[0].finish_reason == "stop", obj.choices[0].message.content
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_enforced_tool_choice_always_calls_validly(client, choice):
    resp = _chat(client, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False)
    msg = resp.choices[0].message
    assert resp.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_streamed_tool_call_reassembles_to_the_non_streamed(client):
    kw = dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = _chat(client, **kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    for chunk in _chat(client, stream=True, **kw):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole]


def test_a_conversation_with_tool_results_continues(client):
    first = _chat(client, tools=[WEATHER], tool_choice="required").choices[0].message
    call = first.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 18, "sky": "clear"}'}]
    reply = _chat(client, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=24)
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None


@pytest.mark.parametrize("kw, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "format": "not-a-format"}}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"tools": [WEATHER] * 65}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
])
def test_bad_structured_requests_get_400_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, **kw)
    if param is not None:
        assert info.value.body["param"].startswith(param) and param in info.value.body["message"]


def test_native_regex_and_grammar_errors(server, auth):
    body = {"text": "The year is", "sampling_params": {"max_new_tokens": 8, "temperature": 0, "regex": " [12][0-9]{3}"}}
    out = httpx.post(server.url + "/generate", json=body, headers=auth, timeout=120).json()
    assert re.fullmatch(r" [12][0-9]{3}", out["text"]), out
    body["sampling_params"]["regex"] = "(unclosed"
    bad = httpx.post(server.url + "/generate", json=body, headers=auth, timeout=120)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_params.regex"
