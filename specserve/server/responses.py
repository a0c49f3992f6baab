"""Response bodies of the OpenAI routes, built from the engine's output dicts (one per choice)."""

from __future__ import annotations

import time
from typing import Any, Iterable, Optional

from specserve.server.logprob_format import (
    chat_logprobs,
    completion_logprobs,
    echoed_logprobs,
    output_logprobs,
    prompt_logprobs,
)
from specserve.server.reasoning import ReasoningSetup
from specserve.server.tool_parsers import ToolFormat
from specserve.tokenizer.tokenizer import Tokenizer

SPEC_KEYS = (
    "spec_verify_ct",
    "spec_num_correct_drafts",
    "spec_accept_length",
    "spec_correct_drafts_histogram",
    "spec_cap_trim_histogram",
    "spec_draft_len_histogram",
    "spec_drafter_steps",
    "spec_predicted_accept_length",
)


def finish_reason(output: dict) -> str:
    return output["meta_info"]["finish_reason"]["type"]


def spec_choice(index: int, output: dict) -> dict[str, Any]:
    """The `specserve` extension of one choice: cached prompt tokens and speculative statistics."""
    meta = output["meta_info"]
    return {"index": index, "cached_tokens": meta["cached_tokens"], **{k: meta[k] for k in SPEC_KEYS if k in meta}}


def spec_extension(outputs: list[dict]) -> dict[str, Any]:
    return {"choices": [spec_choice(i, o) for i, o in enumerate(outputs)]}


def usage(prompt_tokens: int, outputs: list[dict], reasoning_tokens: int = 0) -> dict[str, Any]:
    """OpenAI usage; accepted drafts count as accepted_prediction_tokens; reasoning_tokens: the
    tokens of the replies' reasoning_content (0 without a reasoning parser)."""
    completion = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    accepted = sum(o["meta_info"].get("spec_num_correct_drafts", 0) for o in outputs)
    cached = max(o["meta_info"]["cached_tokens"] for o in outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"accepted_prediction_tokens": accepted, "reasoning_tokens": reasoning_tokens},
    }


def reasoning_tokens(tokenizer: Tokenizer, texts: Iterable[Optional[str]]) -> int:
    """Tokens of the replies' reasoning texts, as the tokenizer encodes them."""
    return sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in texts if t)


def chat_completion(
    request_id: str,
    model: str,
    outputs: list[dict],
    prompt_tokens: int,
    tokenizer: Tokenizer,
    tools: ToolFormat,
    reasoning: Optional[ReasoningSetup] = None,
) -> dict[str, Any]:
    choices = [chat_choice(i, o, tokenizer, tools, reasoning) for i, o in enumerate(outputs)]
    thought = (c["message"].get("reasoning_content") for c in choices)
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(prompt_tokens, outputs, reasoning_tokens(tokenizer, thought)),
        "specserve": spec_extension(outputs),
    }


def completion_choice(
    index: int, output: dict, tokenizer: Tokenizer, echo: Optional[tuple[str, list[int]]]
) -> dict[str, Any]:
    logprobs = completion_logprobs(tokenizer, output_logprobs(output))
    text = output["text"]
    if echo is not None:
        prompt_text, prompt_ids = echo
        scored = prompt_logprobs(output)
        if logprobs is not None and scored is not None:
            logprobs = echoed_logprobs(tokenizer, prompt_ids, scored, logprobs)
        text = prompt_text + text
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(output)}


def chat_choice(
    index: int, output: dict, tokenizer: Tokenizer, tools: ToolFormat, reasoning: Optional[ReasoningSetup] = None
) -> dict[str, Any]:
    """One choice; with a reasoning parser its reasoning is `reasoning_content`; with tools offered,
    the calls in its answer become `tool_calls` (finish_reason "tool_calls")."""
    split = reasoning.split(output["text"]) if reasoning is not None else None
    content, calls = tools.parse(split.content if split is not None else output["text"])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if split is not None:
        message["reasoning_content"] = split.reasoning or None
    if calls:
        message["tool_calls"] = calls
    return {
        "index": index,
        "message": message,
        "logprobs": chat_logprobs(tokenizer, output_logprobs(output)),
        "finish_reason": chat_finish_reason(output, bool(calls)),
    }


def chat_finish_reason(output: dict, called: bool) -> str:
    return "tool_calls" if called and finish_reason(output) == "stop" else finish_reason(output)


def text_completion(
    request_id: str,
    model: str,
    outputs: list[dict],
    prompt_tokens: int,
    tokenizer: Tokenizer,
    echo: Optional[list[tuple[str, list[int]]]] = None,
) -> dict[str, Any]:
    """`echo`: per choice its prompt's text and ids, put before the completion (and its logprobs)."""
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [completion_choice(i, o, tokenizer, echo[i] if echo else None) for i, o in enumerate(outputs)],
        "usage": usage(prompt_tokens, outputs),
        "specserve": spec_extension(outputs),
    }
