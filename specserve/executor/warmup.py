"""The speculation cost model's starting point, measured on this machine before the first request.

A few synthetic steps time what a step costs: plain decode (captured, as the engine runs it),
eager decode and full verify windows at batch 1 and a larger batch, the DSpark drafter at both,
and an NGRAM lookup. They run through the engine's own
forward (drafters commit the rows as in a real step) over request slots and token slots that no
request holds yet; the first prefill overwrites whatever they wrote. Every rank runs the same
steps in the same order (the model's collectives need it); rank 0's numbers are the ones used.
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from typing import Callable, Optional, Sequence

import torch

from specserve import drafters as registry
from specserve.errors import ConfigError
from specserve.sampling_params import SamplingParams
from specserve.speculative.committed import CommittedRows, RequestTokens
from specserve.speculative.cost_model import FEATURES
from specserve.speculative.ngram_worker import TokenHistory
from specserve.speculative.worker import DraftInput

CONTEXT = 128  # tokens of context per synthetic request (fewer when the context window is smaller)
SPREAD = 7919  # a prime stride through the vocabulary for the synthetic rows' token ids


def spread_ids(n: int, vocab: int, device) -> torch.Tensor:
    """n distinct-looking token ids: on a mixture of experts, rows of one token would all route to
    the same few experts and make a verify window look cheaper than text's (more rows read more
    experts); these route about as unrelated tokens do."""
    return (torch.arange(1, n + 1, dtype=torch.int64, device=device) * SPREAD) % vocab


def measure_cost_prior(runner, gamma: int, batch: int = 4, repeats: int = 2) -> list[float]:
    """Coefficients for StepCostModel (speculative/cost_model.py FEATURES), in seconds."""
    width = gamma + 1
    table = runner.req_to_token.table
    ctx = max(1, min(CONTEXT, table.shape[1] - width))
    per_req = ctx + width
    batch = max(2, min(batch, runner.req_to_token.table.shape[0], (runner.kv.size - 1) // per_req))
    if batch * per_req >= runner.kv.size:
        raise ConfigError(
            f"speculation warm-up: the KV pool ({runner.kv.size} tokens) is too small to time "
            f"steps; give --max-total-tokens >= {2 * per_req + 1} or a cost table"
        )
    saved = table[:batch].clone()
    for r in range(batch):  # synthetic requests r: slots 1 + r * per_req ...
        table[r, :per_req] = torch.arange(1 + r * per_req, 1 + (r + 1) * per_req, device=table.device)
    timer = _Timer(runner.device, repeats)
    try:
        step = {(bs, w): timer(partial(_forward, runner, bs, w, ctx)) for bs in (1, batch) for w in (1, width)}
        # A plain decode step runs captured where the engine captures it; a verify with drafts eagerly.
        plain = {
            bs: timer(partial(_captured_decode, runner, bs, ctx)) if runner.capture.covers(bs) else step[(bs, 1)]
            for bs in (1, batch)
        }
        drafting = _drafting_cost(runner, timer, batch, gamma, ctx)
    finally:
        runner.speculation.flush()  # the synthetic rows go now, before any request holds their slots
        table[:batch] = saved
    return _fit(step, plain, drafting, batch, gamma, timer(_ngram_lookup))


def _drafting_cost(runner, timer: "_Timer", batch: int, gamma: int, ctx: int) -> tuple[float, float]:
    """The drafting model's fixed part and part per draft (0, 0 without one), measured as its
    declaration says it drafts (drafters/declaration.py). All drafts in one pass (DSPARK's block):
    its part per draft is a row of its heads, from drafting at batch 1 and at `batch`. A pass per
    draft (STANDALONE's decode steps): from drafting 1 and gamma tokens at batch 1 (its steps cost
    nearly the same at a larger batch, so the cost model's part per drafted row overprices a
    batch's drafts, never underprices them)."""
    worker = next((w for name, w in runner.speculation.workers.items() if registry.get(name).runs_a_model), None)
    if worker is None:
        return 0.0, 0.0
    if registry.get(worker.name).drafts_in_one_pass:
        draft = {bs: timer(partial(_draft, runner, worker, bs, gamma, ctx)) for bs in (1, batch)}
        row = max(0.0, (draft[batch] - draft[1]) / ((batch - 1) * gamma))
        return max(0.0, draft[1] - gamma * row), row
    ids = spread_ids(ctx + 1, runner.model.config.vocab_size, "cpu").tolist()
    request = RequestTokens(ids, ctx)  # the synthetic request's tokens, the anchor last
    one, full = (timer(partial(_draft, runner, worker, 1, gamma, ctx, k, [request])) for k in (1, gamma))
    row = max(0.0, (full - one) / max(gamma - 1, 1))
    return max(0.0, one - row), row


def _forward(runner, bs: int, width: int, ctx: int) -> None:
    rows = list(range(bs))
    fb = runner._forward_batch(
        rows,
        [ctx] * bs,
        [width] * bs,
        spread_ids(bs * width, runner.model.config.vocab_size, runner.device),
        runner.req_to_token.table[rows, ctx : ctx + width].reshape(-1).tolist(),
        every_row=width > 1,
    )
    runner.model(fb, runner.kv)
    if runner.speculation.reads_rows:  # a DSpark engine's plain pass also writes the drafter's context rows
        runner.speculation.commit_rows(CommittedRows(fb.captured_hidden, fb.positions, fb.out_cache_loc))


def _captured_decode(runner, bs: int, ctx: int) -> None:
    dev = runner.device
    rows = torch.arange(bs, device=dev)
    runner._captured_step(1).run(
        rows,
        torch.full((bs,), ctx, dtype=torch.int64, device=dev),
        spread_ids(bs, runner.model.config.vocab_size, dev).view(bs, 1),
        ctx + 1,
    )


def _draft(
    runner, worker, bs: int, gamma: int, ctx: int, needed: Optional[int] = None, requests: Sequence[RequestTokens] = ()
) -> None:
    dev = runner.device
    rows = torch.arange(bs, device=dev)
    worker.draft(
        DraftInput(
            rows,
            torch.zeros(bs, dtype=torch.int64, device=dev),
            torch.full((bs,), ctx, dtype=torch.int64, device=dev),
            torch.zeros(bs, dtype=torch.int64),
            [SamplingParams(temperature=0.0)] * bs,
            [0] * bs,
            gamma,
            needed,
            requests=requests,
        )
    )


def _ngram_lookup() -> None:
    history = TokenHistory()
    history.extend([i % 97 for i in range(CONTEXT)])
    history.match(8)


class _Timer:
    """Median seconds of `repeats` runs after one untimed run."""

    def __init__(self, device: str, repeats: int):
        self.cuda = torch.device(device).type == "cuda"
        self.repeats = repeats

    @torch.inference_mode()
    def __call__(self, fn: Callable[[], None]) -> float:
        fn()
        times = []
        for _ in range(self.repeats):
            self._sync()
            start = time.perf_counter()
            fn()
            self._sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _fit(
    step: dict[tuple[int, int], float],
    plain: dict[int, float],
    drafting: tuple[float, float],
    batch: int,
    gamma: int,
    lookup_s: float,
) -> list[float]:
    """Plain decode steps give the fixed and per-request parts; eager steps over full windows the
    part per verified row and, against plain decode, the fixed cost of taking the verify path;
    the drafting model's parts are measured by `_drafting_cost`."""
    per_request = (plain[batch] - plain[1]) / (batch - 1)
    fixed = plain[1] - per_request
    per_row = statistics.mean((step[(bs, gamma + 1)] - step[(bs, 1)]) / (bs * gamma) for bs in (1, batch))
    verify_step = statistics.mean(step[(bs, 1)] - plain[bs] for bs in (1, batch))
    model_draft_step, model_draft_row = drafting
    coefficients = dict(
        fixed=fixed,
        requests=per_request,
        verify_rows=max(per_row, 0.0),
        model_draft_step=model_draft_step,
        model_draft_rows=model_draft_row,
        lookup_requests=lookup_s,
        verify_step=max(verify_step, 0.0),
    )
    return [coefficients[name] for name in FEATURES]
