"""The messages of a chat request (OpenAI's), one pydantic model per role, and each as the chat
template gets it: text content, earlier tool calls and tool results in the tool-call format."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal, Optional, Union

from pydantic import Field, StrictStr

from specserve.server.fields import StrictModel
from specserve.server.tools import MAX_TOOLS, ToolCall, render_call_history, render_tool_result


class TextPart(StrictModel):
    type: Literal["text"]
    text: StrictStr


class _Message(StrictModel):
    content: Union[StrictStr, list[TextPart], None] = None
    name: Optional[StrictStr] = None
    if TYPE_CHECKING:
        role: str  # each message type declares its own (a field there, so not here)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])

    def as_template_message(self) -> dict[str, str]:
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


class SystemMessage(_Message):
    role: Literal["system", "developer"]


class UserMessage(_Message):
    role: Literal["user"]


class AssistantMessage(_Message):
    role: Literal["assistant"]
    tool_calls: Optional[Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)]] = None  # earlier calls

    def as_template_message(self) -> dict[str, str]:
        text = render_call_history(self.text(), self.tool_calls) if self.tool_calls else self.text()
        return {"role": "assistant", "content": text}


class ToolMessage(_Message):
    role: Literal["tool"]
    tool_call_id: StrictStr  # the call this is the result of

    def as_template_message(self) -> dict[str, str]:
        return {"role": "tool", "content": render_tool_result(self.text())}


# One model per role, told apart by `role`: what each role may carry is in the API schema itself.
ChatMessage = Annotated[Union[SystemMessage, UserMessage, AssistantMessage, ToolMessage], Field(discriminator="role")]
