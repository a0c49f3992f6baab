"""Validating what a caller hands the engine: prompts (text or token ids) and sampling params."""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

from specserve.errors import InvalidRequestError
from specserve.sampling_params import SamplingParams
from specserve.tokenizer.tokenizer import Tokenizer

Prompt = Union[str, list[str], None]
Params = Union[dict, SamplingParams, None]  # a dict is parsed; a SamplingParams object is validated as given


def normalize_inputs(
    prompt: Prompt, input_ids: Optional[list], tokenizer: Tokenizer, vocab: int
) -> tuple[bool, list[list[int]]]:
    """(single, token lists): one prompt or a batch, as text or token ids, validated."""
    if (prompt is None) == (input_ids is None):
        raise InvalidRequestError("prompt/input_ids: give exactly one of them", param="prompt")
    if prompt is not None:
        single = isinstance(prompt, str)
        texts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise InvalidRequestError("prompt: must be a string or a non-empty list of strings", param="prompt")
        if any(t == "" for t in texts):
            raise InvalidRequestError("prompt: must not be empty", param="prompt")
        return single, [tokenizer.encode(t) for t in texts]
    assert input_ids is not None, "exactly one of them, checked above"
    single = bool(input_ids) and all(isinstance(t, int) for t in input_ids)
    lists = [input_ids] if single else input_ids
    if not isinstance(lists, list) or not lists:
        raise InvalidRequestError(
            "input_ids: must be a list of token ids or a non-empty list of such lists", param="input_ids"
        )
    for ids in lists:
        if not isinstance(ids, list) or not ids:
            raise InvalidRequestError("input_ids: every prompt must be a non-empty list of token ids", param="input_ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"input_ids: token ids must be integers in [0, {vocab})", param="input_ids")
    return single, [list(ids) for ids in lists]


def normalize_params(sampling_params: Union[Params, list[Params]], n: int, vocab: int) -> list[SamplingParams]:
    """One validated SamplingParams per prompt (a list gives each its own, one is shared), each
    parsed and validated once: the engine and its ranks take them as they are."""
    if isinstance(sampling_params, list):
        if len(sampling_params) != n:
            raise InvalidRequestError(
                f"sampling_params: list of {len(sampling_params)} for {n} prompts", param="sampling_params"
            )
        return [_parse(p, vocab) for p in sampling_params]
    return [_parse(sampling_params, vocab) for _ in range(n)]


def _parse(params: Params, vocab: int) -> SamplingParams:
    """Each request its own object: the scheduler caps a request's max_new_tokens to its context."""
    if isinstance(params, SamplingParams):
        params = dataclasses.replace(params)
        params.validate(vocab)
        return params
    return SamplingParams.from_dict(params, vocab)
