"""When a request stops: EOS, a stop token id, a stop string, or its token budget."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from specserve.scheduler.req import FinishReason, Req


def check_finish(
    req: Req, eos_token_ids: Sequence[int], decode_text: Optional[Callable[[list[int]], str]]
) -> Optional[FinishReason]:
    """The reason req stops after its last output token (recording what matched), or None."""
    token, params = req.output_ids[-1], req.params
    if not params.ignore_eos and token in eos_token_ids:
        req.matched_stop = token
        return FinishReason.STOP
    if token in params.stop_token_ids:
        req.matched_stop = token
        return FinishReason.STOP
    if params.stop and decode_text is not None:
        # Only the tail can hold a new match: a few tokens per character of the longest stop string.
        longest = max(len(s) for s in params.stop)
        tail = decode_text(req.output_ids[-(4 * longest + 4) :])
        for s in params.stop:
            if s in tail:
                req.matched_stop = s
                return FinishReason.STOP
    if len(req.output_ids) >= params.max_new_tokens:
        return FinishReason.LENGTH
    return None
