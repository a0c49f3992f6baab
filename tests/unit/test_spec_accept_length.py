"""The reported accept length counts speculative steps only: a request's tokens from its prefill
and from plain decode steps (drafting switched off above --speculative-disable-batch-size) must
not inflate it (bench serving once reported 122.75 at concurrency 16 for that reason)."""

from __future__ import annotations

from specserve.engine.output import _spec_info
from specserve.sampling_params import SamplingParams
from specserve.scheduler.req import Req


def test_accept_length_is_per_verify_step_whatever_else_the_request_decoded():
    req = Req(rid="r", input_ids=[1, 2, 3], params=SamplingParams(), seed=0)
    req.output_ids = list(range(100))  # 1 from prefill, 90 from plain decode steps, 9 from verify steps
    for committed in (3, 4, 2):  # three verify steps: 2, 3 and 1 accepted drafts plus the bonus
        req.record_verify(appended=committed, committed=committed, cap_trimmed=0)
    info = _spec_info(req)
    assert info["spec_verify_ct"] == 3 and info["spec_num_correct_drafts"] == 6
    assert info["spec_accept_length"] == 3.0  # (3 + 4 + 2) / 3, not 100 / 3


def test_a_request_without_verify_steps_reports_no_speculation():
    req = Req(rid="r", input_ids=[1], params=SamplingParams(), seed=0)
    req.output_ids = [5, 6]
    assert _spec_info(req) == {}
