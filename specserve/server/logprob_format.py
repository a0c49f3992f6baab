"""Logprobs in the OpenAI layouts, from the engine's per-token logprobs.

The engine reports, per output token, its logprob and the top alternatives (`TokenLogprob`; the
output dict carries them in SGLang's layout, `meta_info.output_token_logprobs`). Chat responses
list them as `logprobs.content` entries with the token's text and bytes; completions as the
legacy parallel lists (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, overload

from specserve.logits.logprobs import TokenLogprob
from specserve.tokenizer.tokenizer import Tokenizer


def output_logprobs(output: dict) -> Optional[list[TokenLogprob]]:
    """The TokenLogprobs of an engine output dict; None if the request did not ask for logprobs."""
    meta = output["meta_info"]
    if "output_token_logprobs" not in meta:
        return None
    tops = meta.get("output_top_logprobs") or [[] for _ in meta["output_token_logprobs"]]
    return [
        TokenLogprob(tok, lp, tuple((t, v) for v, t, _ in top))
        for (lp, tok, _), top in zip(meta["output_token_logprobs"], tops)
    ]


def prompt_logprobs(output: dict) -> Optional[list[TokenLogprob]]:
    """The prompt's TokenLogprobs (from its second token) of an output dict; None if not computed."""
    meta = output["meta_info"]
    if "input_token_logprobs" not in meta:
        return None
    tops = meta.get("input_top_logprobs") or [None] * len(meta["input_token_logprobs"])
    return [
        TokenLogprob(tok, lp, tuple((t, v) for v, t, _ in top or ()))
        for (lp, tok, _), top in list(zip(meta["input_token_logprobs"], tops))[1:]
    ]


def echoed_logprobs(
    tokenizer: Tokenizer, prompt_ids: Sequence[int], scored: Sequence[TokenLogprob], completion: Optional[dict[str, Any]]
) -> dict[str, Any]:
    """Legacy completion logprobs with the prompt first (its first token has none), as `echo` returns them."""
    head = completion_logprobs(tokenizer, scored)
    first = token_text(tokenizer, prompt_ids[0])
    tokens = [first] + head["tokens"]
    lists = {
        "tokens": tokens,
        "token_logprobs": [None] + head["token_logprobs"],
        "top_logprobs": [None] + head["top_logprobs"],
        "text_offset": [0] + [o + len(first) for o in head["text_offset"]],
    }
    if completion:
        shift = sum(len(t) for t in tokens)
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            lists[key] += completion[key]
        lists["text_offset"] += [o + shift for o in completion["text_offset"]]
    return lists


def chat_logprobs(tokenizer: Tokenizer, logprobs: Optional[Sequence[TokenLogprob]]) -> Optional[dict[str, Any]]:
    """A chat choice's (or delta's) `logprobs` object."""
    if logprobs is None:
        return None
    return {
        "content": [
            dict(_entry(tokenizer, lp.token, lp.logprob), top_logprobs=[_entry(tokenizer, t, v) for t, v in lp.top])
            for lp in logprobs
        ],
        "refusal": None,
    }


@overload
def completion_logprobs(tokenizer: Tokenizer, logprobs: Sequence[TokenLogprob], text_offset: int = 0) -> dict[str, Any]: ...


@overload
def completion_logprobs(
    tokenizer: Tokenizer, logprobs: Optional[Sequence[TokenLogprob]], text_offset: int = 0
) -> Optional[dict[str, Any]]: ...


def completion_logprobs(
    tokenizer: Tokenizer, logprobs: Optional[Sequence[TokenLogprob]], text_offset: int = 0
) -> Optional[dict[str, Any]]:
    """A completion choice's (or chunk's) `logprobs`: parallel lists; `text_offset` of the first token."""
    if logprobs is None:
        return None
    tokens, offsets = [], []
    for lp in logprobs:
        text = token_text(tokenizer, lp.token)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{token_text(tokenizer, t): v for t, v in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


def token_text(tokenizer: Tokenizer, token: int) -> str:
    """A token's text; bytes that are only part of a UTF-8 character show as U+FFFD."""
    return tokenizer.token_bytes(token).decode("utf-8", errors="replace")


def _entry(tokenizer: Tokenizer, token: int, logprob: float) -> dict[str, Any]:
    raw = tokenizer.token_bytes(token)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}
