"""The sampling schema is declared once (SamplingParams' fields, sampling_params.py) and every surface
is derived from it: the engine's checks, the native /generate model, OpenAI's chat and completion
models, the error-name map and the `generate` flags. Each test reads its values from the
declarations, so a field added there is covered here with no edit; the mutation tests declare extra
fields and show that every surface picks them up with no other change (issue 71, item 4)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Optional

import pytest
from pydantic import BaseModel, ValidationError

from specserve import cli
from specserve.errors import InvalidRequestError
from specserve.sampling_params import (
    BOOLEAN,
    GRAMMAR,
    INTEGER,
    NUMBER,
    SAMPLING_FIELDS,
    STOP,
    TEXT,
    TOKEN_BIAS,
    TOKEN_IDS,
    SamplingField,
    SamplingParams,
    declared,
    sampling,
)
from specserve.server.errors import from_validation_errors
from specserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    GenerateSamplingParams,
    SamplingFields,
)
from specserve.server.routes import OPENAI_PARAM_NAMES
from specserve.server.sampling_models import openai_param_names, openai_sampling_params, sampling_model

VOCAB = 1000
IDS = [spec.name for spec in SAMPLING_FIELDS]
# What chat and completions share besides the generated sampling fields (each endpoint's own are in its model).
OPENAI_OWN = {"model", "n", "stream", "stream_options", "user",
              "no_stop_trim", "skip_special_tokens", "return_hidden_states"}  # SGLang's router's, at fixed values


def _step(spec: SamplingField, value: float) -> float:
    return 1 if spec.kind == INTEGER else max(abs(value), 1) * 1e-6


def upper(spec: SamplingField, openai: bool = False, vocab: Optional[int] = None) -> Optional[float]:
    """The upper bound a surface enforces: OpenAI's where narrower; the vocabulary's only with a vocabulary."""
    if openai and spec.openai_high is not None:
        return spec.openai_high
    if spec.vocab:
        return vocab
    return spec.high


def outside(spec: SamplingField, openai: bool = False, vocab: Optional[int] = None) -> list[Any]:
    """Values just outside the declared range (or of the wrong shape), as the models and the engine see them."""
    if spec.kind in (INTEGER, NUMBER):
        out: list[Any] = []
        if spec.off is not None:
            out += [spec.off - 1, *([spec.off + 1] if spec.off + 1 < spec.low else [])]
        elif spec.low is not None:
            out.append(spec.low if spec.open_low else spec.low - _step(spec, spec.low))
        high = upper(spec, openai, vocab)
        if high is not None:
            out.append(high if spec.open_high else high + _step(spec, high))
        return out
    return {
        BOOLEAN: ["yes", 1],
        STOP: [["s"] * (spec.max_items + 1), "s" * (spec.max_chars + 1), [""]],
        TOKEN_IDS: [[0] * (spec.max_items + 1), [-1]],
        TOKEN_BIAS: [{str(i): 0 for i in range(spec.max_items + 1)}],
        TEXT: [5],
        GRAMMAR: [5],
    }[spec.kind]


def inside(spec: SamplingField, openai: bool = False, vocab: Optional[int] = None) -> list[Any]:
    """Values at the edges of the declared range (and the off value)."""
    if spec.kind in (INTEGER, NUMBER):
        out: list[Any] = [] if spec.off is None else [spec.off]
        if spec.low is not None:
            out.append(spec.low + _step(spec, spec.low) if spec.open_low else spec.low)
        high = upper(spec, openai, vocab)
        if high is not None:
            out.append(high - _step(spec, high) if spec.open_high else high)
        return out
    return {
        BOOLEAN: [not spec.default],
        STOP: [["s" * spec.max_chars] * spec.max_items, "s"],
        TOKEN_IDS: [list(range(min(spec.max_items, vocab or spec.max_items)))],
        TOKEN_BIAS: [{str(i): spec.high for i in range(min(spec.max_items, vocab or spec.max_items))}],
        TEXT: ["x"],
        GRAMMAR: ["x"],
    }[spec.kind]


def rejected(model: type[BaseModel], body: dict[str, Any]):
    """The API's error for a body the model refuses."""
    with pytest.raises(ValidationError) as err:
        model.model_validate(body)
    return from_validation_errors(err.value.errors())


def names_field(error, name: str) -> bool:
    """The error names the field: its param (a field's own check) or its message (a check across the model)."""
    return (error.param or "").startswith(name) or f"{name}:" in error.message


def openai_body(name: str, value: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "x"}], name: value}


# ------------------------------------------------------------------- the shipped surfaces


def test_the_native_and_openai_models_hold_exactly_the_declared_fields():
    assert set(GenerateSamplingParams.model_fields) == {spec.name for spec in SAMPLING_FIELDS if spec.native}
    shared = {spec.openai for spec in SAMPLING_FIELDS if spec.openai is not None and spec.openai_shared}
    assert set(SamplingFields.model_fields) - OPENAI_OWN == shared


@pytest.mark.parametrize("spec", SAMPLING_FIELDS, ids=IDS)
def test_the_engine_checks_each_field_as_declared(spec):
    for value in outside(spec, vocab=VOCAB):
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams.from_dict({spec.name: value}, VOCAB)
        assert err.value.param == f"sampling_params.{spec.name}", (value, err.value)
        assert len(str(err.value)) < 400
    for value in inside(spec, vocab=VOCAB):
        if spec.name != "top_logprobs":  # it needs logprobs (a check across fields)
            SamplingParams.from_dict({spec.name: value}, VOCAB)


@pytest.mark.parametrize("spec", [s for s in SAMPLING_FIELDS if s.native], ids=[s.name for s in SAMPLING_FIELDS if s.native])
def test_the_native_model_takes_each_native_field_with_its_declared_bounds(spec):
    for value in outside(spec):
        error = rejected(GenerateRequest, {"text": "x", "sampling_params": {spec.name: value}})
        assert names_field(error, f"sampling_params.{spec.name}") or f"{spec.name}:" in error.message, (value, error.message)
    for value in inside(spec):
        params = GenerateRequest.model_validate({"text": "x", "sampling_params": {spec.name: value}}).engine_params()
        assert spec.name in params
    default = GenerateSamplingParams.model_fields[spec.name].get_default(call_default_factory=True)
    assert default == (None if spec.route_default else spec.default)


OPENAI = [s for s in SAMPLING_FIELDS if s.openai is not None and s.openai_shared]


@pytest.mark.parametrize("spec", OPENAI, ids=[s.name for s in OPENAI])
@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest], ids=["chat", "completions"])
def test_openai_models_take_each_shared_field_under_its_openai_name_with_openai_bounds(spec, model):
    def body(value):
        if model is ChatCompletionRequest:
            return openai_body(spec.openai, value)
        return {"model": "m", "prompt": "x", spec.openai: value}

    for value in outside(spec, openai=True):
        assert names_field(rejected(model, body(value)), spec.openai), value
    for value in inside(spec, openai=True):
        assert model.model_validate(body(value)).sampling_params(5)[spec.name] == value
    if spec.kind != BOOLEAN:  # null (or absent): the engine's default
        assert spec.name not in model.model_validate(body(None)).sampling_params(5)


def test_openai_bounds_are_narrower_where_declared():
    narrower = [s for s in SAMPLING_FIELDS if s.openai_high is not None]
    assert {s.name for s in narrower} == {"temperature", "seed"}
    for spec in narrower:
        value = spec.openai_high if spec.open_high else spec.openai_high + 1
        SamplingParams.from_dict({spec.name: value})  # the engine takes it
        assert names_field(rejected(ChatCompletionRequest, openai_body(spec.openai, value)), spec.openai)


def test_engine_errors_are_renamed_to_openai_names_from_the_declarations():
    assert OPENAI_PARAM_NAMES == {f"sampling_params.{s.name}": s.openai for s in SAMPLING_FIELDS if s.openai}
    assert OPENAI_PARAM_NAMES["sampling_params.max_new_tokens"] == "max_tokens"


def generate_flags() -> dict[str, argparse.Action]:
    parser = cli.build_parser(only="generate")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["generate"]
    return {a.dest: a for a in sub._actions}


@pytest.mark.parametrize("spec", SAMPLING_FIELDS, ids=IDS)
def test_generate_has_a_flag_for_each_field_declared_with_one(spec, capsys):
    flags = generate_flags()
    assert (spec.name in flags) == spec.flag
    if not spec.flag:
        return
    flag = "--" + spec.name.replace("_", "-")
    assert flags[spec.name].option_strings == [flag]
    assert flags[spec.name].default == (spec.flag_default if spec.flag_default is not None else
                                        None if spec.kind in (STOP, TOKEN_IDS) else spec.default)
    good, bad = cli_values(spec)
    ns = cli.build_parser(only="generate").parse_args(["generate", f"{flag}={good}"])
    assert cli.sampling_flags(ns)[spec.name] == ([good] if spec.kind == STOP else good)
    assert cli.main(["generate", f"{flag}={bad}"]) == 2  # refused before the model (or torch) loads: one line
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and (flag in err or f"sampling_params.{spec.name}" in err), err


def cli_values(spec: SamplingField) -> tuple[Any, Any]:
    """A value of the field's range and one outside it, as a flag takes them."""
    if spec.kind == STOP:
        return "s", "s" * (spec.max_chars + 1)
    return inside(spec)[0], outside(spec)[0]


# ------------------------------------------------------------------- a field added: one declaration

NEW_FIELDS = {
    "typical_p": sampling(1.0, NUMBER, "typical sampling's mass", low=0, open_low=True, high=1, openai="typical_p",
                          flag=True),
    "min_tokens": sampling(0, INTEGER, "no EOS before this many tokens", low=0, high=2**31 - 1, openai="min_tokens",
                           flag=True),
    "top_a": sampling(-1, INTEGER, "a made-up cut with an off value", low=2, high=50, off=-1, openai="top_a", flag=True),
    "echo_stop": sampling(False, BOOLEAN, "a made-up switch", openai="echo_stop", flag=True),
    "banned_ids": sampling([], TOKEN_IDS, "token ids never sampled", max_items=8),
    "prefix": sampling(None, TEXT, "a made-up text field", max_chars=32, openai="prefix", flag=True),
}


def extended(name: str) -> type:
    """SamplingParams with one more declared field, and nothing else changed."""
    annotation = {INTEGER: int, NUMBER: float, BOOLEAN: bool, TOKEN_IDS: list, TEXT: Optional[str]}
    spec = NEW_FIELDS[name].metadata["sampling"]
    return dataclasses.make_dataclass("Extended", [(name, annotation[spec.kind], NEW_FIELDS[name])], bases=(SamplingParams,))


@pytest.mark.parametrize("name", NEW_FIELDS)
def test_a_new_field_is_checked_by_the_engine_from_its_declaration(name):
    cls = extended(name)
    spec = declared(cls)[-1]
    assert spec.name == name and declared(cls)[:-1] == SAMPLING_FIELDS
    for value in inside(spec, vocab=VOCAB):
        assert getattr(cls.from_dict({name: value}, VOCAB), name) == value
    for value in outside(spec, vocab=VOCAB):
        with pytest.raises(InvalidRequestError) as err:
            cls.from_dict({name: value}, VOCAB)
        assert err.value.param == f"sampling_params.{name}"
    assert getattr(cls(), name) == spec.default


@pytest.mark.parametrize("name", NEW_FIELDS)
def test_a_new_field_is_in_the_generated_models_names_and_flags(name, capsys):
    fields = declared(extended(name))
    spec = fields[-1]
    native = sampling_model("Native", fields, openai=False)
    assert set(native.model_fields) == set(GenerateSamplingParams.model_fields) | {name}
    for value in outside(spec):
        assert names_field(from_validation_errors(_errors(native, {name: value})), name), value
    for value in inside(spec):
        assert native.model_validate({name: value}).model_dump()[name] == value
    if spec.openai is not None:
        openai = sampling_model("OpenAI", fields, openai=True)
        for value in outside(spec, openai=True):
            assert names_field(from_validation_errors(_errors(openai, {spec.openai: value})), spec.openai), value
        for value in inside(spec, openai=True):
            assert openai_sampling_params(openai.model_validate({spec.openai: value}), fields)[name] == value
        assert openai_param_names(fields)[f"sampling_params.{name}"] == spec.openai
    parser = argparse.ArgumentParser()
    cli._add_sampling_args(parser, fields)
    flag = "--" + name.replace("_", "-")
    assert (flag in parser._option_string_actions) == spec.flag
    if spec.flag:
        value = inside(spec)[-1]
        if spec.kind == BOOLEAN:
            argv = [flag if value else f"--no-{flag[2:]}"]
        else:
            argv = [flag, str(value)]
        assert cli.sampling_flags(parser.parse_args(argv), fields)[name] == value
        assert parser._option_string_actions[flag].help == spec.help


def _errors(model: type[BaseModel], body: dict[str, Any]) -> list[Any]:
    with pytest.raises(ValidationError) as err:
        model.model_validate(body)
    return err.value.errors()
