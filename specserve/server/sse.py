"""Streamed responses (server-sent events) of the chat, completion and native routes.

A stream always ends with `data: [DONE]`. An engine failure after the stream started cannot change
the HTTP status any more, so it is sent as one `data:` line carrying the OpenAI error body, then
[DONE]. Streamed text is always a prefix of the final text (see text_stream.py).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, AsyncIterator, NamedTuple, Optional, Union

from specserve.engine.messages import RequestDone, TokensOut
from specserve.server.engine_client import Delivery
from specserve.server.errors import APIError, server_error
from specserve.server.generation import Generation, every_output
from specserve.server.logprob_format import chat_logprobs, completion_logprobs, echoed_logprobs
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest
from specserve.server.reasoning import ReasoningSetup, Split
from specserve.server.responses import chat_finish_reason, finish_reason, reasoning_tokens, spec_choice, usage
from specserve.server.state import ServerState
from specserve.server.text_stream import TextStream
from specserve.server.tool_parsers import ToolFormat

logger = logging.getLogger(__name__)


class TextDelta(NamedTuple):
    choice: int
    text: str
    logprobs: Optional[list] = None  # the TokenLogprobs of the tokens that arrived with it, if asked
    prompt_logprobs: Optional[list] = None  # with a choice's first tokens, if its prompt was scored


class ChoiceFinished(NamedTuple):
    choice: int
    output: dict


class StreamUsage(NamedTuple):
    usage: dict


class StreamFailed(NamedTuple):
    body: dict


Piece = Union[TextDelta, ChoiceFinished, StreamUsage, StreamFailed]


def sse(obj: Union[dict, str]) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


async def chat_stream(
    state: ServerState,
    body: ChatCompletionRequest,
    gen: Generation,
    first: Delivery,
    prompt_tokens: int,
    reasoning: Optional[ReasoningSetup] = None,
) -> AsyncIterator[str]:
    """Chat chunks: a role delta per choice, reasoning and content deltas, a finish chunk per
    choice, usage if asked."""
    head = {
        "id": f"chatcmpl-{gen.rids[0]}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": state.model_name,
    }

    def chunk(index: int, delta: dict, finish: Optional[str] = None, logprobs: Optional[dict] = None, **extra) -> str:
        return sse(
            {**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}], **extra}
        )

    # Each choice's reply goes through the reasoning splitter (if any), then its answer through the
    # tool-call parser (if tools are offered): content as it comes, each call once it is complete.
    tools = body.tool_format(state.tool_call_parser)
    parts = {i: _ReplyParts(reasoning, tools) for i in range(len(gen.rids))}
    for i in range(len(gen.rids)):
        yield chunk(i, {"role": "assistant", "content": ""})
    async for piece in _text_pieces(state, body.stop_list(), gen, first, prompt_tokens, body.include_usage):
        match piece:
            case TextDelta(index, text, logprobs):
                for delta in parts[index].feed(text, logprobs is not None):
                    scored = chat_logprobs(state.tokenizer, logprobs) if "content" in delta else None
                    yield chunk(index, delta, logprobs=scored)
            case ChoiceFinished(index, output):
                for delta in parts[index].finish():
                    yield chunk(index, delta)
                reason = chat_finish_reason(output, parts[index].calls > 0)
                yield chunk(index, {}, reason, specserve=spec_choice(index, output))
            case StreamUsage(u):
                thought = (p.reasoning for p in parts.values())
                u["completion_tokens_details"]["reasoning_tokens"] = reasoning_tokens(state.tokenizer, thought)
                yield sse({**head, "choices": [], "usage": u})
            case StreamFailed(err):
                yield sse(err)
    yield sse("[DONE]")


class _ReplyParts:
    """One streamed choice's reasoning, content and tool-call deltas."""

    def __init__(self, reasoning: Optional[ReasoningSetup], tools: ToolFormat):
        self.splitter = reasoning.splitter() if reasoning is not None else None
        self.calls_stream = tools.stream()
        self.reasoning, self.calls = "", 0  # the reasoning so far (usage), the calls sent

    def feed(self, text: str, logprobs: bool) -> list[dict[str, Any]]:
        split = self.splitter.feed(text) if self.splitter is not None else Split("", text)
        return self._deltas(split, False, logprobs)

    def finish(self) -> list[dict[str, Any]]:
        split = self.splitter.finish() if self.splitter is not None else Split()
        return self._deltas(split, True, False)

    def _deltas(self, split: Split, last: bool, logprobs: bool) -> list[dict[str, Any]]:
        """Its reasoning, then its content (an empty content delta still carries logprobs), then calls."""
        self.reasoning += split.reasoning
        content, calls = split.content, list[dict[str, Any]]()
        if self.calls_stream is not None:
            content, calls = self.calls_stream.feed(content)
            if last:
                rest, more = self.calls_stream.finish()
                content, calls = content + rest, calls + more
        deltas: list[dict[str, Any]] = [{"reasoning_content": split.reasoning}] if split.reasoning else []
        if content or logprobs:
            deltas.append({"content": content})
        for call in calls:
            deltas.append({"tool_calls": [{"index": self.calls, **call}]})
            self.calls += 1
        return deltas


async def completion_stream(
    state: ServerState,
    body: CompletionRequest,
    gen: Generation,
    first: Delivery,
    prompt_tokens: int,
    echo: list[tuple[str, list[int]]],
) -> AsyncIterator[str]:
    """Completion chunks: text deltas, a finish chunk per choice, usage if asked. With `echo` (per
    choice its prompt's text and ids) a choice's first chunk starts with its prompt (and its logprobs)."""
    head = {"id": f"cmpl-{gen.rids[0]}", "object": "text_completion", "created": int(time.time()), "model": state.model_name}

    def chunk(index: int, text: str, finish: Optional[str] = None, logprobs: Optional[dict] = None, **extra) -> str:
        return sse(
            {**head, "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}], **extra}
        )

    offsets = [0] * len(gen.rids)  # text_offset of each choice's next token
    pending = set(range(len(gen.rids))) if body.echo else set()  # choices whose prompt is not sent yet

    def echoed(index: int, text: str, logprobs: Optional[dict], scored: Optional[list]) -> tuple[str, Optional[dict]]:
        pending.discard(index)
        prompt_text, prompt_ids = echo[index]
        if logprobs is not None and scored is not None:
            logprobs = echoed_logprobs(state.tokenizer, prompt_ids, scored, logprobs)
        offsets[index] += len(prompt_text)
        return prompt_text + text, logprobs

    async for piece in _text_pieces(state, body.stop_list(), gen, first, prompt_tokens, body.include_usage):
        match piece:
            case TextDelta(index, text, logprobs, scored):
                formatted = completion_logprobs(state.tokenizer, logprobs, offsets[index])
                if formatted:
                    offsets[index] += sum(len(t) for t in formatted["tokens"])
                if index in pending:
                    text, formatted = echoed(index, text, formatted, scored)
                yield chunk(index, text, logprobs=formatted)
            case ChoiceFinished(index, output):
                if index in pending:  # no token came before the end
                    yield chunk(index, echoed(index, "", None, None)[0])
                yield chunk(index, "", finish_reason(output), specserve=spec_choice(index, output))
            case StreamUsage(u):
                yield sse({**head, "choices": [], "usage": u})
            case StreamFailed(err):
                yield sse(err)
    yield sse("[DONE]")


async def _text_pieces(
    state: ServerState, stops: list[str], gen: Generation, first: Delivery, prompt_tokens: int, include_usage: bool
) -> AsyncIterator[Piece]:
    """TextDelta and ChoiceFinished per choice, then StreamUsage (if asked) or, on failure, StreamFailed last."""
    streams = [TextStream(state.tokenizer, stops) for _ in gen.rids]
    outputs: list[Optional[dict[str, Any]]] = [None] * len(gen.rids)
    try:
        async for index, event in gen.events(first):
            if isinstance(event, TokensOut):
                delta = streams[index].add(event.token_ids)
                if delta or event.logprobs or event.prompt_logprobs:
                    yield TextDelta(index, delta, event.logprobs, event.prompt_logprobs)
            elif isinstance(event, RequestDone):
                outputs[index] = event.output
                rest = streams[index].finish(event.output["text"])
                if rest:
                    yield TextDelta(index, rest)
                yield ChoiceFinished(index, event.output)
    except APIError as exc:
        yield StreamFailed(exc.body())
        return
    except Exception as exc:  # this stream's own host work (detokenizing) failed: it ends, the server goes on
        yield StreamFailed(_stream_failure(gen, exc).body())
        return
    if include_usage:
        yield StreamUsage(usage(prompt_tokens, every_output(outputs)))


async def generate_stream(state: ServerState, gen: Generation, first: Delivery) -> AsyncIterator[str]:
    """Native streaming: cumulative text and ids per delivery, then the final output dict."""
    ids: list[int] = []
    logprobs: list = []
    try:
        async for _, event in gen.events(first):
            if isinstance(event, TokensOut):
                ids += event.token_ids
                chunk: dict[str, Any] = {"text": state.tokenizer.decode(ids), "output_ids": ids}
                if event.logprobs is not None:
                    logprobs += event.logprobs
                    chunk["meta_info"] = {"output_token_logprobs": [[lp.logprob, lp.token, None] for lp in logprobs]}
                yield sse(chunk)
            elif isinstance(event, RequestDone):
                yield sse(event.output)
    except APIError as exc:
        yield sse(exc.body())
    except Exception as exc:
        yield sse(_stream_failure(gen, exc).body())
    yield sse("[DONE]")


def _stream_failure(gen: Generation, exc: Exception) -> APIError:
    logger.error("stream of request %s failed", gen.rids[0], exc_info=True)
    return server_error(f"request {gen.rids[0]} failed: {type(exc).__name__}: {exc}")
