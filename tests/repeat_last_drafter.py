"""The example drafter of docs/adding.md, whole in this one file: REPEAT_LAST proposes a request's
last committed token again for every draft (right exactly where the text repeats a token).

Registered by one line, `drafters.register(repeat_last_drafter.DRAFTER)`
(tests/integration/test_drafter_plugin.py); after that `--speculative-algorithm REPEAT_LAST`, the
adaptive policy, the cost warm-up and the flag checks know it from its declaration."""

from __future__ import annotations

from specserve.drafters import Cost, Drafter
from specserve.speculative.worker import DraftContext, DraftInput, Drafts, WorkerDefaults

NAME = "REPEAT_LAST"


class RepeatLastWorker(WorkerDefaults):
    """Drafts from the window's anchor alone: no state, no tokens, no K/V of its own."""

    name = NAME

    def draft(self, inp: DraftInput) -> Drafts:
        return Drafts(inp.anchors.unsqueeze(1).expand(-1, inp.gamma).contiguous())


def make_worker(ctx: DraftContext) -> RepeatLastWorker:
    return RepeatLastWorker()


DRAFTER = Drafter(
    name=NAME,
    summary="the request's last token, again",
    worker=f"{__name__}:make_worker",
    cost=Cost.LOOKUP,  # no model: priced like a host lookup
    priors=(0.05,),  # a token rarely repeats
)
