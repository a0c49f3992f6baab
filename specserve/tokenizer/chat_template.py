"""Chat templates: the model's Jinja2 template rendered the way Hugging Face renders it."""

from __future__ import annotations

import datetime
import json
from typing import Any, Optional

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specserve.errors import InvalidRequestError

_ROLES = ("system", "user", "assistant", "tool")


def _raise(message: str):
    raise InvalidRequestError(f"messages: {message}", param="messages")


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
    """transformers' `tojson`: plain json.dumps (jinja2's own escapes HTML characters)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template (sandboxed, trim_blocks and lstrip_blocks as in transformers), with
    the globals transformers gives it: raise_exception, strftime_now, tojson, bos_token, eos_token."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        self.template = env.from_string(source)
        self.special = {"bos_token": bos_token, "eos_token": eos_token}

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, variables: Optional[dict[str, Any]] = None
    ) -> str:
        """The template's text; `variables`: more template variables (a request's chat_template_kwargs)."""
        validate_messages(messages)
        extra = variables or {}
        taken = sorted(set(extra) & {"messages", "add_generation_prompt", *self.special})
        if taken:
            field = "chat_template_kwargs"
            raise InvalidRequestError(f"{field}: {taken[0]!r} is set by the server", param=field)
        try:
            return self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special, **extra
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"messages: chat template failed: {exc}", param="messages") from exc


def validate_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages: must be a non-empty list of {role, content} objects", param="messages")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise InvalidRequestError(f"messages[{i}]: must be an object with 'role' and 'content'", param=f"messages[{i}]")
        if msg["role"] not in _ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role: must be one of {_ROLES}, got {msg['role']!r}", param=f"messages[{i}].role"
            )
        if not isinstance(msg["content"], str):
            raise InvalidRequestError(f"messages[{i}].content: must be a string", param=f"messages[{i}].content")
