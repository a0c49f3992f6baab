"""Grammars on the real tokenizer: masks, draft checks and rollback; tool-call grammars and parsing;
the API's response_format and tools translated into engine params."""

from __future__ import annotations

import json

import pytest

from specserve.errors import InvalidRequestError
from specserve.logits.grammar import GrammarCompiler, GrammarSpec
from specserve.server.protocol import ChatCompletionRequest
from specserve.server.tool_parsers import parse_tool_calls
from specserve.server.tools import ToolDef, call_grammar

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}
WEATHER = ToolDef.model_validate({"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"], "additionalProperties": False}}})


@pytest.fixture(scope="module")
def tokenizer():
    from specserve.models.loader import default_model_path
    from specserve.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer.backend.to_str, tokenizer.vocab_size, tokenizer.eos_token_ids)


def test_masks_follow_the_committed_tokens_and_windows_roll_back(compiler, tokenizer):
    state = compiler.state(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    ids = tokenizer.encode('{"n": 7}')
    assert state.valid_prefix(ids + ids) == len(ids)  # a second object leaves the grammar
    first = state.mask_after([])
    assert tokenizer.decode(first.nonzero().view(-1).tolist()) == '{"'
    inside = state.mask_after(ids[:-2])  # after '{"n": ', only digits 0-9
    assert {tokenizer.decode([t]) for t in inside.nonzero().view(-1).tolist()} <= {str(d) for d in range(10)}
    assert state.mask_after([]).equal(first)  # the window was rolled back
    state.commit(ids)
    assert state.mask_after([]).nonzero().view(-1).tolist() == list(tokenizer.eos_token_ids)


def test_a_window_consumed_by_the_committed_matcher_is_visible(compiler, tokenizer, monkeypatch):
    """Mutation: a window consumed by the committed matcher itself (no copy) stays consumed, and
    the next mask is wrong."""
    state = compiler.state(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    ids = tokenizer.encode('{"n": 7}')
    monkeypatch.setattr(type(state.matcher), "deep_copy", lambda self: self, raising=False)
    first = state.mask_after([])
    state.mask_after(ids[:2])
    assert not state.mask_after([]).equal(first)


def token(tokenizer, text: str) -> int:
    return next(i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == text)


@pytest.mark.parametrize("via_rollback", [False, True])
def test_masks_after_a_deep_window_match_a_fresh_matchers(compiler, tokenizer, via_rollback):
    """Found by speculation on the extraction workload: a two-token window ['":', ' {"'] masked after
    '{"items', then '": ["type' committed, and the next mask allowed '":' inside the array when the
    window had been consumed and rolled back on the committed matcher (llguidance 1.9); the copy
    gives a fresh matcher's mask. `via_rollback` plants the old way and shows it fails."""
    spec = GrammarSpec("json_schema", json.dumps({"type": "object"}))
    state, fresh = compiler.state(spec), compiler.state(spec)
    head = tokenizer.encode('{"items')
    state.commit(head)
    window = [token(tokenizer, '":'), token(tokenizer, ' {"')]
    if via_rollback:
        consumed = state.matcher.try_consume_tokens(window)
        state.matcher.compute_bitmask()
        state.matcher.rollback(consumed)
    else:
        state.mask_after(window)
    tail = [token(tokenizer, '":'), token(tokenizer, ' ["'), token(tokenizer, "type")]
    state.commit(tail)
    fresh.commit(head + tail)
    colon = token(tokenizer, '":')
    assert not fresh.mask_after([])[colon]  # a string in an array: no colon after it
    assert state.mask_after([]).equal(fresh.mask_after([])) != via_rollback


@pytest.mark.parametrize("spec, message", [
    (GrammarSpec("json_schema", "{oops"), "json_schema"), (GrammarSpec("json_schema", "[1]"), "must be an object"),
    (GrammarSpec("regex", "(open"), "regex"), (GrammarSpec("ebnf", "root ::= missing"), "missing"),
    (GrammarSpec("json_schema", json.dumps({"type": "string", "format": "no-such-format"})), "format"),
])
def test_malformed_grammars_name_their_field(compiler, spec, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        compiler.check(spec)
    assert info.value.param == f"sampling_params.{spec.kind}"


def test_required_tool_choice_grammar_admits_exactly_valid_calls(compiler, tokenizer):
    lark = call_grammar([WEATHER], "required", parallel=False)
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    wrong_name = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert compiler.state(GrammarSpec("lark", lark)).valid_prefix(tokenizer.encode(good)) == len(tokenizer.encode(good))
    bad_ids = tokenizer.encode(wrong_name)
    assert compiler.state(GrammarSpec("lark", lark)).valid_prefix(bad_ids) < len(bad_ids)
    content, calls = parse_tool_calls("qwen25", {"get_weather"}, good)
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert parse_tool_calls("qwen25", {"get_weather"}, "no call here") == ("no call here", [])
    assert parse_tool_calls("qwen25", {"get_weather"}, wrong_name) == (wrong_name, [])  # not offered: plain text


def test_a_forced_llama3_call_is_the_json_llama3_writes(compiler, tokenizer):
    lark = call_grammar([WEATHER], "required", parallel=True, fmt="llama3")
    two = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_weather", "parameters": {"city": "Rome"}}'
    assert compiler.state(GrammarSpec("lark", lark)).valid_prefix(tokenizer.encode(two)) == len(tokenizer.encode(two))
    hermes = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert compiler.state(GrammarSpec("lark", lark)).valid_prefix(tokenizer.encode(hermes)) == 0
    content, calls = parse_tool_calls("llama3", {"get_weather"}, two)
    assert content is None and [c["function"]["arguments"] for c in calls] == ['{"city": "Paris"}', '{"city": "Rome"}']


def _chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kw)


def test_response_format_and_tool_choice_become_engine_grammars():
    schema = _chat(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}})
    assert json.loads(schema.sampling_params(8)["json_schema"]) == SCHEMA
    assert json.loads(_chat(response_format={"type": "json_object"}).sampling_params(8)["json_schema"]) == {
        "type": "object"}
    tools = [WEATHER.model_dump()]
    named = _chat(tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert "get_weather" in named.sampling_params(8)["lark"]
    assert "lark" not in _chat(tools=tools).sampling_params(8)  # auto: parsed, not enforced
    assert _chat(tools=tools, tool_choice="none").template_messages() == [{"role": "user", "content": "hi"}]
    assert "<tools>" in _chat(tools=tools).template_messages()[0]["content"]


@pytest.mark.parametrize("kw, message", [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER.model_dump()], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "no tool named"),
    ({"tools": [WEATHER.model_dump()] * 2}, "unique"),
    ({"response_format": {"type": "json_schema"}}, "json_schema is required"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
])
def test_bad_tool_and_format_requests_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        _chat(**kw)


def test_grammar_bench_library_part(tmp_path):
    """`python -m benchmarks grammar --skip-engine`: every generated instance walks its grammar's masks."""
    from benchmarks.cli import main as cli_main

    out = tmp_path / "grammar.json"
    assert cli_main(["grammar", "--skip-engine", "--schemas", "4", "--out", str(out)]) == 0
    lib = json.loads(out.read_text())["libraries"]["llguidance"]
    assert lib["available"] and lib["instances_rejected"] == 0 and lib["tokens_walked"] > 10
    assert lib["features"]["$ref/$defs"] and not lib["features"]["uniqueItems"]  # refused, never ignored
    assert lib["accepted_but_not_enforced"] == []
    assert lib["compile_ms_median"] > 0 and lib["mask_ms_per_token"] > 0
