"""OpenAI-compatible request models (pydantic) and their translation to specserve sampling params.

Unknown fields are rejected (extra="forbid"); fields of the OpenAI API that specserve does not
implement are accepted only at their neutral value (e.g. `presence_penalty: 0`, `logprobs: false`)
and otherwise rejected with a message naming them, so a client never gets silently different
behaviour.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, Literal, Optional, Union, cast

from pydantic import ConfigDict, Field, StrictBool, StrictStr, model_validator

from specserve.sampling_params import MAX_NEW_TOKENS_LIMIT, MAX_TOP_LOGPROBS, SAMPLING_FIELDS
from specserve.server.errors import FieldError
from specserve.server.fields import MAX_N, Integer, NonEmpty, StrictModel, Text, TokenIds, check_fixed, fixed, neutral_only
from specserve.server.messages import ChatMessage
from specserve.server.sampling_models import openai_sampling_params, sampling_model
from specserve.server.tool_parsers import DEFAULT_TOOL_CALL_PARSER, ToolFormat
from specserve.server.tools import MAX_TOOLS, ToolChoice, ToolDef, call_grammar, check_tools, offered, with_tools


class StreamOptions(StrictModel):
    include_usage: StrictBool = False


class JsonSchemaFormat(StrictModel):
    name: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    description: Optional[StrictStr] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[StrictBool] = None


class ResponseFormat(StrictModel):
    """OpenAI's response_format: free text, any JSON object, or JSON matching a schema (always strict here)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _check_format(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise FieldError("response_format", "json_schema is required with type json_schema, and only then")
        return self

    def schema_text(self) -> Optional[str]:
        """The JSON schema the output must match, as JSON text (None: free text)."""
        if self.type == "json_object":
            return json.dumps({"type": "object"})
        if self.type == "json_schema":
            assert self.json_schema is not None, "_check_format: given with type json_schema"
            return json.dumps(self.json_schema.schema_ if self.json_schema.schema_ is not None else {"type": "object"})
        return None


class _ModelName(StrictModel):
    model: StrictStr


# The sampling fields chat and completions share (temperature, top_p, stop, seed, penalties, ...),
# generated from SamplingParams' declarations (sampling_models.py).
if TYPE_CHECKING:
    _OpenAISampling = _ModelName
else:
    _OpenAISampling = sampling_model("OpenAISampling", SAMPLING_FIELDS, openai=True, base=_ModelName)


class SamplingFields(_OpenAISampling):
    """What chat and completion requests share: the model, the generated sampling fields, and these."""

    if TYPE_CHECKING:  # generated fields this code reads by name
        stop: Optional[Union[str, list[str]]]
        seed: Optional[int]
    n: Integer = Field(1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[StrictStr] = None  # accepted for compatibility; not used
    # SGLang's extensions, which its router adds to every request it forwards (at these values):
    no_stop_trim: StrictBool = fixed(False)  # a matched stop string is always cut from the text
    skip_special_tokens: StrictBool = fixed(True)
    return_hidden_states: StrictBool = fixed(False)

    @model_validator(mode="after")
    def _check(self):
        check_fixed(self)
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    def token_limit(self) -> Optional[int]:
        """The request's cap on generated tokens per choice, None for none."""
        raise NotImplementedError

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        """specserve sampling params (those the request gave; OpenAI's defaults are the engine's)."""
        params = {"max_new_tokens": max_new_tokens, **openai_sampling_params(self, SAMPLING_FIELDS)}
        top = self.logprob_count()
        if top is not None:
            params.update(logprobs=True, top_logprobs=top)
        return params

    def logprob_count(self) -> Optional[int]:
        """None: no logprobs; else how many top alternatives per token."""
        raise NotImplementedError

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[Integer] = Field(None, ge=0, le=MAX_NEW_TOKENS_LIMIT)
    max_completion_tokens: Optional[Integer] = Field(None, ge=0, le=MAX_NEW_TOKENS_LIMIT)
    logprobs: Optional[StrictBool] = None
    top_logprobs: Optional[Integer] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: Optional[ResponseFormat] = None
    tools: Optional[Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)]] = None
    tool_choice: Optional[ToolChoice] = None  # "auto" when tools are given, as OpenAI
    parallel_tool_calls: StrictBool = True
    continue_final_message: StrictBool = fixed(False)  # SGLang's: a final assistant message is answered, not continued
    # SGLang's reasoning output: with --reasoning-parser the reasoning goes to `reasoning_content`
    # (unless separate_reasoning is false), streamed as it comes (or whole once it ends); without
    # a parser the whole reply is `content`.
    separate_reasoning: StrictBool = True
    stream_reasoning: StrictBool = True
    # Variables for the chat template (Qwen3's enable_thinking, ...), as SGLang and transformers take them.
    chat_template_kwargs: Optional[dict[Annotated[str, Field(max_length=64)], Any]] = Field(None, max_length=16)
    # OpenAI's, for reasoning models: gpt-oss's harmony template reads it (its system message's
    # "Reasoning: low|medium|high"); given to the template as `reasoning_effort`.
    reasoning_effort: Optional[Literal["low", "medium", "high"]] = None
    regex: Optional[StrictStr] = None  # SGLang's constraints on the reply: a regular expression,
    ebnf: Optional[StrictStr] = None  # or a GBNF grammar

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "needs logprobs: true")
        check_tools(self.tools, self.tool_choice)
        constraints = [name for name, on in (
            ("response_format", self.response_format is not None and self.response_format.type != "text"),
            ("regex", self.regex is not None), ("ebnf", self.ebnf is not None),
            ("tool_choice", call_grammar(self.offered_tools(), self.tool_choice, True) is not None)) if on]  # fmt: skip
        if len(constraints) > 1:
            raise FieldError(constraints[0], f"not with {constraints[1]} (both constrain the output)")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("max_tokens, max_completion_tokens: give at most one")
        return self

    def token_limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprob_count(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling_params(self, max_new_tokens: int, tool_format: str = DEFAULT_TOOL_CALL_PARSER) -> dict[str, Any]:
        """The engine's params; a forced tool call's grammar writes calls in `tool_format`."""
        params = super().sampling_params(max_new_tokens)
        schema = self.response_format.schema_text() if self.response_format else None
        if schema is not None:
            params["json_schema"] = schema
        grammar = call_grammar(self.offered_tools(), self.tool_choice, self.parallel_tool_calls, tool_format)
        if grammar is not None:
            params["lark"] = grammar
        for name in ("regex", "ebnf"):
            if getattr(self, name) is not None:
                params[name] = getattr(self, name)
        return params

    def offered_tools(self) -> list[ToolDef]:
        return offered(self.tools, self.tool_choice)

    def tool_format(self, parser: str) -> ToolFormat:
        """The offered tools' names with the server's tool-call format (`parser`)."""
        return ToolFormat(parser, frozenset(t.function.name for t in self.offered_tools()))

    def template_variables(self) -> Optional[dict[str, Any]]:
        """The chat template's extra variables: `reasoning_effort`, then chat_template_kwargs
        (which win where both name one)."""
        effort = {} if self.reasoning_effort is None else {"reasoning_effort": self.reasoning_effort}
        merged = effort | (self.chat_template_kwargs or {})
        return merged or None

    def template_messages(self, tool_format: str = DEFAULT_TOOL_CALL_PARSER) -> list[dict[str, str]]:
        """The conversation for the chat template, with the offered tools in the system message
        (asking for calls in `tool_format`)."""
        return with_tools([m.as_template_message() for m in self.messages], self.offered_tools(), tool_format)


class CompletionRequest(SamplingFields):
    prompt: Union[Text, NonEmpty[list[Text]], TokenIds, NonEmpty[list[TokenIds]]]
    max_tokens: Optional[Integer] = Field(16, ge=0, le=MAX_NEW_TOKENS_LIMIT)  # OpenAI's default for completions
    logprobs: Optional[Integer] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # top alternatives per token
    echo: StrictBool = False  # the prompt before the completion (with logprobs: the prompt's too)
    suffix: Optional[StrictStr] = neutral_only(None, "")
    best_of: Optional[Integer] = Field(None, json_schema_extra={"enum": [None], "description": "or equal to n"})

    @model_validator(mode="after")
    def _check_completion(self):
        if self.suffix:
            raise ValueError("suffix: not supported by specserve")
        if self.best_of not in (None, self.n):
            raise ValueError("best_of: only best_of == n is supported")
        if isinstance(self.prompt, list) and (not self.prompt or any(p in ("", []) for p in self.prompt)):
            raise ValueError("prompt: must not be empty")
        if self.prompt == "":
            raise ValueError("prompt: must not be empty")
        return self

    def prompts(self) -> list[Union[str, list[int]]]:
        """One entry per prompt: text, or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [cast("list[int]", list(self.prompt))]  # the check above: token ids (mypy cannot follow all())
        return cast("list[Union[str, list[int]]]", list(self.prompt))  # prompts as text or token ids

    def token_limit(self) -> Optional[int]:
        return self.max_tokens

    def logprob_count(self) -> Optional[int]:
        return self.logprobs

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        params = super().sampling_params(max_new_tokens)
        if self.echo and self.logprobs is not None:
            params["prompt_logprobs"] = True  # computed, not taken from the prefix cache
        return params


if TYPE_CHECKING:
    _NativeSampling = StrictModel
else:  # every field SamplingParams declares `native`, at the engine's default (SGLang's names)
    _NativeSampling = sampling_model("NativeSampling", SAMPLING_FIELDS, openai=False)


class GenerateSamplingParams(_NativeSampling):
    """specserve's SamplingParams as the native API takes them (checked again, with the vocabulary, by the engine)."""

    def as_dict(self) -> dict[str, Any]:
        """The fields the client sent (the engine fills in the rest)."""
        return self.model_dump(exclude_unset=True, exclude_none=True)


class GenerateRequest(StrictModel):
    """The native endpoint: text or input_ids, specserve sampling params, the Engine's output dict."""

    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [  # exactly one of text and input_ids
                {"required": ["text"], "properties": {"text": {"type": "string"}, "input_ids": {"type": "null"}}},
                {"required": ["input_ids"], "properties": {"input_ids": {"type": "array"}, "text": {"type": "null"}}},
            ]
        }
    )

    text: Optional[Text] = None
    input_ids: Optional[TokenIds] = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: StrictBool = False
    # SGLang's names, which (as there) only count with return_logprob: meta_info.output_token_logprobs,
    return_logprob: StrictBool = False
    top_logprobs_num: Integer = Field(0, ge=0, le=MAX_TOP_LOGPROBS)  # meta_info.output_top_logprobs,
    logprob_start_len: Integer = Field(-1, ge=-1, le=0)  # 0: meta_info.input_token_logprobs (the prompt's)
    model: Optional[StrictStr] = None  # the router's; if given, it must name the served model
    # SGLang's extensions, which its router adds to every request it forwards (at these values):
    return_text_in_logprobs: StrictBool = fixed(False)
    return_hidden_states: StrictBool = fixed(False)
    return_bytes: StrictBool = fixed(False)
    return_entropy: StrictBool = fixed(False)
    background: StrictBool = fixed(False)
    log_metrics: StrictBool = fixed(True)  # every request is counted in /metrics
    no_logs: StrictBool = False  # either way: specserve never logs request contents

    @model_validator(mode="after")
    def _check_generate(self):
        check_fixed(self)
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("text, input_ids: give exactly one")
        if self.text == "" or self.input_ids == []:
            raise ValueError("text/input_ids: must not be empty")
        return self

    def engine_params(self) -> dict[str, Any]:
        params = self.sampling_params.as_dict()
        if self.return_logprob:
            params.update(logprobs=True, top_logprobs=self.top_logprobs_num, prompt_logprobs=self.logprob_start_len == 0)
        return params
