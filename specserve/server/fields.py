"""The strict field types every request model is built from (OpenAI and native; the sampling fields'
through sampling_models.py), and the vocabulary bound the app writes into its OpenAPI schema.

Strict: ints are accepted as numbers, bools and strings are not; JSON's one number type means an
integral float (2.0) is the integer 2.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, model_validator

from specserve.server.errors import FieldError


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 2**64 else value


Number = StrictFloat  # strict: ints are accepted, bools and strings are not
Integer = StrictInt  # integral floats are accepted too: see StrictModel._integral_floats
# The vocabulary bounds token ids and top_k; the app writes it into its OpenAPI schema (VOCAB_BOUND).
VOCAB_BOUND = "x-vocab-bound"
TokenId = Annotated[StrictInt, Field(ge=0, json_schema_extra={VOCAB_BOUND: -1}), BeforeValidator(_integral)]
Text = Annotated[StrictStr, Field(min_length=1)]
T = TypeVar("T")
NonEmpty = Annotated[T, Field(min_length=1)]
TokenIds = NonEmpty[list[TokenId]]


def neutral_only(*values: Any) -> Any:
    """A field of the OpenAI API that specserve accepts only at its neutral values; the schema says so."""
    return Field(None, json_schema_extra={"enum": list(values)})


def fixed(value: Any) -> Any:
    """An SGLang extension (its router sends it on every request) that specserve implements at this
    value only: accepted there, a 400 naming it otherwise (`check_fixed`)."""
    return Field(value, json_schema_extra={"enum": [value]})


def check_fixed(model: BaseModel) -> None:
    """Every `fixed` field of a request at its one supported value, else a FieldError naming it."""
    for name, info in type(model).model_fields.items():
        extra = info.json_schema_extra
        if (
            isinstance(extra, dict)
            and extra.get("enum") == [info.default]
            and info.default is not None
            and getattr(model, name) != info.default
        ):
            raise FieldError(name, f"only {json.dumps(info.default)} is supported by specserve")


MAX_N = 16  # choices per request


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        """JSON has one number type: 2.0 is the integer 2 (JSON Schema agrees); 2.5, "2" and true are not."""
        return {k: _integral(v) for k, v in data.items()} if isinstance(data, dict) else data


def bound_by_vocab(schema: Any, vocab_size: int) -> None:
    """In an OpenAPI schema (in place): each VOCAB_BOUND marker becomes `maximum: vocab_size + offset`."""
    if isinstance(schema, dict):
        if VOCAB_BOUND in schema:
            schema["maximum"] = vocab_size + schema.pop(VOCAB_BOUND)
        for value in schema.values():
            bound_by_vocab(value, vocab_size)
    elif isinstance(schema, list):
        for value in schema:
            bound_by_vocab(value, vocab_size)
