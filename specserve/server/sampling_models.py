"""The request models' sampling fields, generated from SamplingParams' declarations (sampling_params.py):
the native /generate's `sampling_params` takes every `native` field at the engine's default, OpenAI's
chat and completions every `openai_shared` one under its OpenAI name, default None (the engine's).

A kind of field is one pydantic type (`KIND_TYPES`); the declared bounds are its constraints (OpenAI's
where they are narrower), and a field with an off value below its range (top_k -1) is checked by the
model: a new field of an existing kind needs no edit here. The engine checks every field again,
with the vocabulary (SamplingParams.validate); the models give the API's errors and OpenAPI schema.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Optional, Sequence, Union

from pydantic import BaseModel, Field, StrictBool, StrictStr, create_model, model_validator

from specserve.sampling_params import BOOLEAN, GRAMMAR, INTEGER, NUMBER, STOP, TEXT, TOKEN_BIAS, TOKEN_IDS, SamplingField
from specserve.server.fields import VOCAB_BOUND, Integer, Number, StrictModel, TokenId


def _stop(spec: SamplingField) -> Any:
    one = Annotated[StrictStr, Field(min_length=1, max_length=spec.max_chars)]
    return Union[one, Annotated[list[one], Field(max_length=spec.max_items)]]


KIND_TYPES: dict[str, Callable[[SamplingField], Any]] = {
    INTEGER: lambda spec: Integer,
    NUMBER: lambda spec: Number,
    BOOLEAN: lambda spec: StrictBool,
    TEXT: lambda spec: StrictStr,  # its length: the engine's check
    GRAMMAR: lambda spec: StrictStr,
    STOP: _stop,
    TOKEN_IDS: lambda spec: Annotated[list[TokenId], Field(max_length=spec.max_items)],
    TOKEN_BIAS: lambda spec: Annotated[dict[str, Number], Field(max_length=spec.max_items)],  # values: the engine's
}


def _constraints(spec: SamplingField, openai: bool) -> dict[str, Any]:
    """The declared range as pydantic's constraints: from the off value up where there is one (the
    model refuses what lies between), up to the vocabulary where it bounds the field (the OpenAPI
    schema states it, see fields.bound_by_vocab)."""
    if spec.kind not in (INTEGER, NUMBER):
        return {}
    out: dict[str, Any] = {}
    if spec.off is not None:
        out["ge"] = spec.off
    elif spec.low is not None:
        out["gt" if spec.open_low else "ge"] = spec.low
    high = spec.openai_high if openai and spec.openai_high is not None else spec.high
    if spec.vocab:
        out["json_schema_extra"] = {VOCAB_BOUND: 0}
    elif high is not None:
        out["lt" if spec.open_high else "le"] = high
    return out


def _definition(spec: SamplingField, openai: bool) -> tuple[Any, Any]:
    kind = KIND_TYPES[spec.kind](spec)
    if openai and spec.kind != BOOLEAN:  # OpenAI's: absent or null is the engine's default
        return Optional[kind], Field(None, **_constraints(spec, openai))
    nullable = spec.nullable or spec.route_default
    annotation = Optional[kind] if nullable else kind
    if isinstance(spec.default, (list, dict)) and not nullable:
        return annotation, Field(default_factory=type(spec.default), **_constraints(spec, openai))
    return annotation, Field(None if nullable else spec.default, **_constraints(spec, openai))


def _off_check(names: dict[str, SamplingField]) -> Any:
    """A model validator: a field with an off value (top_k -1) is that value or within its range."""

    def check(model: BaseModel) -> BaseModel:
        for name, spec in names.items():
            value = getattr(model, name)
            if value is not None and value != spec.off and spec.low is not None and value < spec.low:
                raise ValueError(f"{name}: must be {spec.off} (off) or >= {spec.low}")
        return model

    return model_validator(mode="after")(check)


def _api_name(spec: SamplingField, openai: bool) -> Optional[str]:
    """The field's name in the API's model, None where that model does not take it."""
    if openai:
        return spec.openai if spec.openai_shared else None
    return spec.name if spec.native else None


def sampling_model(
    name: str, fields: Sequence[SamplingField], openai: bool, base: type[BaseModel] = StrictModel
) -> type[BaseModel]:
    """A request model holding the sampling fields of one API: OpenAI's (`openai`, under their
    OpenAI names) or the native one's."""
    chosen = {api_name: spec for spec in fields if (api_name := _api_name(spec, openai)) is not None}
    definitions: dict[str, Any] = {api_name: _definition(spec, openai) for api_name, spec in chosen.items()}
    offs = {api_name: spec for api_name, spec in chosen.items() if spec.off is not None}
    validators: dict[str, Callable[..., Any]] = {"_check_off_values": _off_check(offs)} if offs else {}
    return create_model(name, __base__=base, __validators__=validators, **definitions)


def openai_sampling_params(request: BaseModel, fields: Sequence[SamplingField]) -> dict[str, Any]:
    """The engine's sampling params from an OpenAI request's shared fields (those it gave)."""
    params: dict[str, Any] = {}
    for spec in fields:
        api_name = _api_name(spec, openai=True)
        if api_name is not None and getattr(request, api_name) is not None:
            params[spec.name] = getattr(request, api_name)
    return params


def openai_param_names(fields: Sequence[SamplingField]) -> dict[str, str]:
    """The engine's field name (in its errors, "sampling_params.top_k") -> OpenAI's request field."""
    return {f"sampling_params.{spec.name}": spec.openai for spec in fields if spec.openai is not None}
