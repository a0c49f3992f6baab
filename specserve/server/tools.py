"""Tool calls: OpenAI's `tools` / `tool_choice` for models whose chat template has no tool format.

specserve uses the Hermes convention (documented in the README): the tools are described in the
system prompt as JSON signatures inside <tools></tools>, and the model answers a call as
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
one block per call. `tool_choice` "required" or a named function is enforced by a grammar (the
blocks, each a JSON object matching one allowed function's parameters), so such a request always
produces valid calls, with speculation on; "auto" lets the model choose and the reply is parsed;
"none" offers no tools. Earlier turns' calls and tool results are rendered in the same format.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from specserve.server.errors import FieldError

MAX_TOOLS = 64
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.S)
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


def system_prompt(tools: list[ToolDef]) -> str:
    """The Hermes-style tool description, put before (or into) the conversation's system message."""
    signatures = "\n".join(
        json.dumps({"type": "function", "function": t.function.model_dump(exclude_none=True)}) for t in tools
    )
    return (
        "You are a function calling AI model. You may call one or more functions to assist with the user "
        f"query. Here are the available tools:\n<tools>\n{signatures}\n</tools>\nFor each function call, "
        f"return a JSON object with the function name and arguments within {CALL_OPEN}{CALL_CLOSE} tags:\n"
        f'{CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CALL_CLOSE}'
    )


def with_tools(messages: list[dict[str, str]], tools: list[ToolDef]) -> list[dict[str, str]]:
    if not tools:
        return messages
    prompt = system_prompt(tools)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + prompt}] + messages[1:]
    return [{"role": "system", "content": prompt}] + messages


def call_grammar(tools: list[ToolDef], choice: Optional[ToolChoice], parallel: bool) -> Optional[str]:
    """llguidance Lark for tool_choice "required" (any tool) or a named one; None when not enforced."""
    if choice == "required":
        allowed = tools
    elif isinstance(choice, NamedToolChoice):
        allowed = [t for t in tools if t.function.name == choice.function.name]
    else:
        return None
    schema = {"anyOf": [_call_schema(t) for t in allowed], "x-guidance": _JSON_STYLE}
    repeat = ' ("\\n" call)*' if parallel else ""
    return f'start: call{repeat}\ncall: "{CALL_OPEN}\\n" body "\\n{CALL_CLOSE}"\nbody: %json {json.dumps(schema)}\n'


def _call_schema(tool: ToolDef) -> dict[str, Any]:
    params = tool.function.parameters if tool.function.parameters is not None else {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def parse_calls(text: str, tools: list[ToolDef]) -> tuple[Optional[str], list[dict[str, Any]]]:
    """(content, tool_calls) of a reply: each well-formed block naming an offered tool becomes a call;
    the text outside the blocks is the content (None when empty)."""
    names = {t.function.name for t in tools}
    calls = []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and call.get("name") in names and isinstance(call.get("arguments", {}), dict):
            calls.append(
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))},
                }
            )
    if not calls:
        return text, []
    content = _CALL.sub("", text).strip()
    return content or None, calls


def render_call_history(content: str, calls: list[ToolCall]) -> str:
    """An earlier assistant turn with calls, as the model would have written it."""
    blocks = [
        f"{CALL_OPEN}\n{json.dumps({'name': c.function.name, 'arguments': _arguments(c)})}\n{CALL_CLOSE}" for c in calls
    ]
    return "\n".join(([content] if content else []) + blocks)


def render_tool_result(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return call.function.arguments
