"""Whether a request can ever run: it has tokens, fits the context window and the KV pool."""

from __future__ import annotations

from specserve.errors import InvalidRequestError
from specserve.scheduler.req import Req

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def validate_request(req: Req, context_length: int, window: int, pool_size: int) -> None:
    """Raise InvalidRequestError (param "prompt") for a request no schedule could serve."""
    n = len(req.input_ids)
    if n == 0:
        raise InvalidRequestError("prompt: must contain at least one token", param="prompt")
    if n >= context_length:
        raise InvalidRequestError(
            f"prompt: {n} tokens do not fit the context window of {context_length} (need prompt_tokens < context_length)",
            param="prompt",
            code=CONTEXT_LENGTH_EXCEEDED,
        )
    # A verify window needs window - 1 slots past the last token it keeps.
    need = n + min(req.params.max_new_tokens, context_length - n) + window - 1
    if need > pool_size:
        raise InvalidRequestError(
            f"prompt: {n} tokens + max_new_tokens need {need} KV slots but the pool holds "
            f"{pool_size} (raise max_total_tokens or lower max_new_tokens)",
            param="prompt",
            code=CONTEXT_LENGTH_EXCEEDED,
        )
