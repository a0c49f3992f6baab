"""The output dict of a finished request, as `Engine.generate` returns it and the server sends it."""

from __future__ import annotations

from typing import Any

from specserve.scheduler.req import Req
from specserve.tokenizer.tokenizer import Tokenizer


def request_output(req: Req, tokenizer: Tokenizer) -> dict[str, Any]:
    text = tokenizer.decode(req.output_ids, skip_special_tokens=req.params.skip_special_tokens)
    if isinstance(req.matched_stop, str):
        cut = text.find(req.matched_stop)
        text = text[:cut] if cut >= 0 else text
    return {
        "text": text,
        "output_ids": list(req.output_ids),
        "meta_info": {
            "id": req.rid,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_reason": _finish_reason(req),
            **_spec_info(req),
            **_logprob_info(req),
        },
    }


def _logprob_info(req: Req) -> dict[str, Any]:
    """SGLang's native layout: [logprob, token_id, null] per output token, and per position its top list."""
    out: dict[str, Any] = {}
    if req.params.prompt_logprobs:  # the first prompt token has no logprob
        first = [[None, req.input_ids[0], None]]
        out["input_token_logprobs"] = first + [[lp.logprob, lp.token, None] for lp in req.prompt_logprobs]
        if req.params.top_logprobs:
            out["input_top_logprobs"] = [None] + [[[v, t, None] for t, v in lp.top] for lp in req.prompt_logprobs]
    if req.params.logprobs:
        out["output_token_logprobs"] = [[lp.logprob, lp.token, None] for lp in req.output_logprobs]
        if req.params.top_logprobs:
            out["output_top_logprobs"] = [[[v, t, None] for t, v in lp.top] for lp in req.output_logprobs]
    return out


def _finish_reason(req: Req) -> dict[str, Any]:
    out: dict[str, Any] = {"type": req.finish_reason.value if req.finish_reason else None}
    if req.matched_stop is not None:
        out["matched"] = req.matched_stop
    if req.error is not None:
        out["message"] = req.error
    return out


def _spec_info(req: Req) -> dict[str, Any]:
    """Speculative counters of a request. The accept length counts its steps with drafts only (the
    bonus plus accepted drafts per such step): tokens from its prefill and from steps without
    drafts (the policy chose none, or --speculative-disable-batch-size) are not speculation's.
    The plan counters cover every step of a speculating engine, with or without drafts."""
    out: dict[str, Any] = {}
    if req.spec_draft_len_hist:
        out["spec_draft_len_histogram"] = dict(sorted(req.spec_draft_len_hist.items()))
        out["spec_drafter_steps"] = dict(sorted(req.spec_drafter_steps.items()))
    if req.spec_verify_ct == 0:
        return out
    out.update(
        {
            "spec_verify_ct": req.spec_verify_ct,
            "spec_num_correct_drafts": req.spec_num_correct_drafts,
            "spec_accept_length": 1.0 + req.spec_num_correct_drafts / req.spec_verify_ct,
            "spec_correct_drafts_histogram": dict(sorted(req.spec_correct_hist.items())),
            "spec_cap_trim_histogram": dict(sorted(req.spec_cap_trim_hist.items())),
            "spec_accepted_drafts_per_step": list(req.spec_emitted_trace),
        }
    )
    if req.spec_predicted_sum > 0:
        out["spec_predicted_accept_length"] = req.spec_predicted_sum / req.spec_verify_ct
    return out
