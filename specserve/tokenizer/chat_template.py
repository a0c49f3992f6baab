"""Chat templates: the model's Jinja2 template rendered the way Hugging Face renders it."""

from __future__ import annotations

from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specserve.errors import InvalidRequestError

_ROLES = ("system", "user", "assistant", "tool")


def _raise(message: str):
    raise InvalidRequestError(f"messages: {message}", param="messages")


class ChatTemplate:
    """A compiled chat template (sandboxed, trim_blocks and lstrip_blocks as in transformers)."""

    def __init__(self, source: str):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(source)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        validate_messages(messages)
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **extra)
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
