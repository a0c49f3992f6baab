"""Tool calls: OpenAI's `tools` / `tool_choice` for models whose chat template has no tool format.

specserve uses the Hermes convention (documented in the README): the tools are described in the
system prompt as JSON signatures inside <tools></tools>, and the model answers a call as
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
one block per call (with `--tool-call-parser llama3`: bare JSON objects `{"name": ..., "parameters":
...}` separated by "; ", as Llama 3 writes them). `tool_choice` "required" or a named function is
enforced by a grammar (the calls, each a JSON object matching one allowed function's parameters),
so such a request always produces valid calls, with speculation on; "auto" lets the model choose
and the reply is parsed (server/tool_parsers.py); "none" offers no tools. Earlier turns' calls and
tool results are rendered in the Hermes format.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from specserve.server.errors import FieldError
from specserve.server.tool_parsers import HERMES_CLOSE, HERMES_OPEN

MAX_TOOLS = 64
# The JSON inside a call block: json.dumps's separators, no free whitespace (llguidance's options).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class FunctionDef(_Strict):
    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[StrictStr] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class CalledFunction(_Strict):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    """A call in an earlier assistant turn (the client sends the history back)."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: CalledFunction


def check_tools(tools: Optional[list[ToolDef]], choice: Optional[ToolChoice]) -> None:
    """FieldError for a tool set or choice that cannot be served."""
    names = [t.function.name for t in tools or []]
    if len(set(names)) != len(names):
        raise FieldError("tools", "function names must be unique")
    if choice in ("required",) or isinstance(choice, NamedToolChoice):
        if not tools:
            raise FieldError("tool_choice", "needs tools")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise FieldError("tool_choice", f"no tool named {choice.function.name!r}")


def offered(tools: Optional[list[ToolDef]], choice: Optional[ToolChoice]) -> list[ToolDef]:
    """The tools the model is told about: none for tool_choice "none", else all of them."""
    return [] if not tools or choice == "none" else list(tools)


def system_prompt(tools: list[ToolDef], fmt: str = "qwen25") -> str:
    """The tool description put before (or into) the conversation's system message, asking for
    calls in the tool-call parser's format: Hermes blocks, or (llama3) bare JSON objects."""
    signatures = "\n".join(
        json.dumps({"type": "function", "function": t.function.model_dump(exclude_none=True)}) for t in tools
    )
    intro = ("You are a function calling AI model. You may call one or more functions to assist with the user "
             f"query. Here are the available tools:\n<tools>\n{signatures}\n</tools>\n")  # fmt: skip
    if fmt == "llama3":
        return intro + ('To call functions, answer with only JSON objects separated by "; ", each '
                        '{"name": <function-name>, "parameters": <args-json-object>}')  # fmt: skip
    call = '{"name": <function-name>, "arguments": <args-json-object>}'
    return intro + (
        f"For each function call, return a JSON object with the function name and arguments within "
        f"{HERMES_OPEN}{HERMES_CLOSE} tags:\n{HERMES_OPEN}\n{call}\n{HERMES_CLOSE}"
    )


def with_tools(messages: list[dict[str, str]], tools: list[ToolDef], fmt: str = "qwen25") -> list[dict[str, str]]:
    if not tools:
        return messages
    prompt = system_prompt(tools, fmt)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + prompt}] + messages[1:]
    return [{"role": "system", "content": prompt}] + messages


def call_grammar(tools: list[ToolDef], choice: Optional[ToolChoice], parallel: bool, fmt: str = "qwen25") -> Optional[str]:
    """llguidance Lark for tool_choice "required" (any tool) or a named one, in the tool-call
    parser's format; None when not enforced."""
    if choice == "required":
        allowed = tools
    elif isinstance(choice, NamedToolChoice):
        allowed = [t for t in tools if t.function.name == choice.function.name]
    else:
        return None
    if fmt == "gpt-oss":
        raise FieldError("tool_choice", "required or named calls are not forced with --tool-call-parser gpt-oss")
    key = "parameters" if fmt == "llama3" else "arguments"
    schema = {"anyOf": [_call_schema(t, key) for t in allowed], "x-guidance": _JSON_STYLE}
    if fmt == "llama3":
        repeat = ' ("; " call)*' if parallel else ""
        return f"start: call{repeat}\ncall: %json {json.dumps(schema)}\n"
    repeat = ' ("\\n" call)*' if parallel else ""
    return f'start: call{repeat}\ncall: "{HERMES_OPEN}\\n" body "\\n{HERMES_CLOSE}"\nbody: %json {json.dumps(schema)}\n'


def _call_schema(tool: ToolDef, key: str) -> dict[str, Any]:
    params = tool.function.parameters if tool.function.parameters is not None else {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, key: params},
        "required": ["name", key],
        "additionalProperties": False,
    }


def render_call_history(content: str, calls: list[ToolCall]) -> str:
    """An earlier assistant turn with calls, as the model would have written it."""
    blocks = [
        f"{HERMES_OPEN}\n{json.dumps({'name': c.function.name, 'arguments': _arguments(c)})}\n{HERMES_CLOSE}" for c in calls
    ]
    return "\n".join(([content] if content else []) + blocks)


def render_tool_result(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return call.function.arguments
