"""The engine's surface for tools: what bench/, train/, benchmarks/ and scripts/ may ask of an `Engine`.

Tools measure the engine, train against its target and check its paths; they do that through the
named methods below, never through attribute chains into the runner (`engine.runner.model...`), so
that the runner, the speculation and the scheduler can change behind them. tests/unit/test_tool_surface.py
greps the tools for such chains. The methods, by purpose:

- caches: `reset_prefix_cache`, `prefix_cache_stats`;
- the target model: `target_model`, `forward_rows` (one raw forward of N new rows after P cached ones);
- speculation: `dspark_drafter`, `forget_past_outputs`, `kv_pool_bytes`, `speculation_cost_coefficients`,
  `verified_draft_length`;
- the step's paths and instruments: `set_step_choices`, `new_loop`, `instrument`, `take_host_waits`,
  `step_facts`.

None of them is for serving: they run between `generate` calls (or on an engine built for the tool),
with no request running.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Optional

import torch

from specserve.errors import ConfigError
from specserve.executor.model_runner import ModelRunner
from specserve.models.dspark import DsparkDrafter
from specserve.models.forward_batch import ForwardBatch
from specserve.models.llama import LlamaForCausalLM
from specserve.names import Algorithm
from specserve.runtime.host_waits import HostWait
from specserve.scheduler.loops import NormalLoop, OverlapLoop
from specserve.scheduler.scheduler import Scheduler
from specserve.speculative.dspark_worker import DsparkWorker

# The parts of a step `instrument` can wrap, and the runner's method each one is.
STEP_PARTS = {
    "launch": "launch",  # a step queued on the forward stream: launch(step) -> handle
    "plan": "_plan",  # a verify step's windows: _plan(step, gamma) -> plan
    "decode": "_decode",  # a plain decode step on the stream: _decode(step, handle)
    "verify": "_verify",  # a verify step on the stream: _verify(step, plan, handle)
    "verify_epilogue": "_epilogue",  # the verify epilogue of a window width, made at the first verify step
}


class ToolSurface:
    """Mixed into `Engine`: the named operations tools use (see the module docstring)."""

    runner: ModelRunner
    scheduler: Scheduler
    loop: NormalLoop | OverlapLoop

    # ------------------------------------------------------------ caches

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix (device tier; no request may be running), so that the next
        requests prefill from scratch: a benchmark's runs then each pay their whole prefill."""
        self.scheduler.ledger.tree.reset()

    def prefix_cache_stats(self) -> dict[str, Any]:
        """The hierarchical cache's counters (evictions to host, host hits, ...); {} for the radix cache."""
        stats = getattr(self.scheduler.ledger.tree, "stats", None)
        return dict(vars(stats)) if stats is not None else {}

    # ------------------------------------------------------------ the target model

    @property
    def target_model(self) -> LlamaForCausalLM:
        """The loaded target network, for tools that read or hook its layers (weight bytes, linears,
        expert routing) or run it on their own batches (teacher hidden states, perplexity); not for
        serving, which goes through the steps."""
        return self.runner.model

    @contextlib.contextmanager
    def forward_rows(
        self,
        rows: int,
        cached: int,
        width: Optional[int] = None,
        input_ids: Optional[list[int]] = None,
        last_logit_only: bool = False,
    ) -> Iterator[Callable[[], Any]]:
        """A raw target forward of `rows` new rows after `cached` cached tokens, for timing and
        routing counts: yields a callable that runs it once (returning the logits). The rows go in
        windows of `width` (default: all in one), one scratch request each, at distinct token slots
        whose K/V content is whatever the pool holds; `input_ids` default to random ids; only the
        last row's logits with `last_logit_only`. On exit the scratch requests' table rows are
        cleared and the prefix cache dropped (its K/V may be overwritten). No request may run."""
        if self.loop.has_work():
            raise RuntimeError("forward_rows: requests are running (scratch rows would overwrite theirs)")
        batch = self._scratch_batch(rows, width or rows, cached)
        if input_ids is not None:
            if len(input_ids) != rows:
                raise ValueError(f"forward_rows: {len(input_ids)} input ids for {rows} rows")
            logit_rows = torch.tensor([rows - 1]) if last_logit_only else batch.logit_rows
            batch = dataclasses.replace(
                batch, input_ids=torch.tensor(input_ids, device=batch.input_ids.device), logit_rows=logit_rows
            )
        model, kv = self.runner.model, self.runner.kv
        try:
            yield lambda: model(batch, kv)
        finally:
            self.runner.req_to_token.table.zero_()
            self.reset_prefix_cache()

    def _scratch_batch(self, total: int, width: int, prefix_len: int) -> ForwardBatch:
        """A verify-shaped batch over scratch request rows: `total` rows in windows of `width`."""
        lens = [width] * (total // width) + ([total % width] if total % width else [])
        bs, dev, table = len(lens), self.runner.device, self.runner.req_to_token.table
        if bs > table.shape[0] or bs * (prefix_len + width) > self.scheduler.ledger.allocator.size:
            raise ConfigError(
                f"{total} rows need {bs} requests of {prefix_len + width} slots; "
                "raise --max-running-requests / --max-total-tokens"
            )
        rows = list(range(bs))
        for r in rows:  # distinct slots per request; their values are whatever the pool holds
            table[r, : prefix_len + width] = torch.arange(1, prefix_len + width + 1) + r * (prefix_len + width)
        seq = [prefix_len + n for n in lens]
        meta = self.runner.model.ops.attention_metadata(table, rows, seq, lens, dev)
        positions = torch.tensor([prefix_len + i for n in lens for i in range(n)], device=dev)
        slots = torch.cat([table[r, prefix_len : prefix_len + n] for r, n in zip(rows, lens)])
        return ForwardBatch(
            input_ids=torch.randint(3, 1000, (total,), device=dev),
            positions=positions,
            out_cache_loc=slots,
            attn=meta,
            logit_rows=torch.arange(total, device=dev),
        )

    # ------------------------------------------------------------ speculation

    def dspark_drafter(self) -> Optional[DsparkDrafter]:
        """The loaded DSpark draft network (None without one), for tools that evaluate or time it directly."""
        worker = self.runner.speculation.worker(Algorithm.DSPARK)
        return worker.drafter if isinstance(worker, DsparkWorker) else None

    def forget_past_outputs(self) -> None:
        """Drafters forget what earlier requests generated (SUFFIX's index of past outputs), so that
        a benchmark's run never drafts from an earlier run's answers."""
        for worker in self.runner.speculation.workers.values():
            forget = getattr(worker, "forget_outputs", None)
            if forget is not None:
                forget()

    def kv_pool_bytes(self) -> int:
        """Bytes of the K/V pools: the target's and every drafter's."""
        pools = [self.runner.kv, *self.runner.speculation.kv_pools]
        return sum(t.numel() * t.element_size() for pool in pools for t in (*pool.k, *pool.v))

    def speculation_cost_coefficients(self) -> Optional[dict[str, float]]:
        """The adaptive policy's step-cost model, as fitted so far (None without the policy)."""
        policy = self.runner.speculation.policy
        return policy.cost.coefficients() if policy is not None else None

    def verified_draft_length(self) -> int:
        """Draft tokens per window of the verify steps run so far (the verify epilogue's window less
        the bonus row); 0 before the first verify step."""
        epilogue = self.runner.epilogue
        return epilogue.num_verify_tokens - 1 if epilogue is not None else 0

    # ------------------------------------------------------------ the step's paths and instruments

    def set_step_choices(
        self,
        captured: Optional[bool] = None,
        static_windows: Optional[bool] = None,
        lagged_plans: Optional[bool] = None,
        drafts_on_device: Optional[bool] = None,
    ) -> None:
        """Set the step's device-dependent choices (None: as built), for benchmarks that compare
        them and checks that run CUDA's choices on a CPU: captured steps (CUDA graphs), planned
        windows verified whole (static windows), the adaptive policy planning from the commits two
        launches back (lagged plans), SUFFIX drafting on the device."""
        if captured is not None:
            self.runner.capture.enabled = captured
        if static_windows is not None:
            self.runner.capture.static_windows = static_windows
        speculation = self.runner.speculation
        if lagged_plans is not None:
            speculation.lagged_plans = lagged_plans
        if drafts_on_device is not None:
            for worker in speculation.workers.values():
                if hasattr(worker, "drafts_on_device"):
                    worker.drafts_on_device = drafts_on_device

    def new_loop(self, overlap: bool) -> NormalLoop | OverlapLoop:
        """A new step loop (the overlap loop, or the normal one) over this engine's scheduler and
        runner, for benchmarks that compare loops: assign it to `engine.loop` between requests."""
        return (OverlapLoop if overlap else NormalLoop)(self.scheduler, self.runner)

    def instrument(self, part: str, wrap: Callable[[Callable], Callable]) -> None:
        """Profilers and censuses: this engine's step part `part` (a key of STEP_PARTS) replaced by
        `wrap(original)` for the engine's life; the wrapper takes and returns what the part does."""
        if part not in STEP_PARTS:
            raise ValueError(f"instrument: no step part {part!r} (have {sorted(STEP_PARTS)})")
        name = STEP_PARTS[part]
        setattr(self.runner, name, wrap(getattr(self.runner, name)))

    def take_host_waits(self) -> list[HostWait]:
        """The host's waits on the device inside launches since the last call (the host-wait detector,
        SPECSERVE_HOST_WAITS=count when the engine was built), and the count started over."""
        if self.runner.host_waits is None:
            raise RuntimeError("take_host_waits: no host-wait detector (set SPECSERVE_HOST_WAITS before building)")
        return self.runner.host_waits.reset()

    def step_facts(self) -> dict[str, Any]:
        """What the step's paths did, for checks: CUDA graphs captured so far, whether the streams run
        on worker threads, and the planted copy lag's figures (None without SPECSERVE_FAULT_COPY_LAG_MS)."""
        lag = self.runner.copy_lag
        return {
            "cuda_graphs": sum(len(step._graphs) for step in self.runner._captured.values()),
            "threaded_streams": self.runner.forward.threaded,
            "copy_lag": lag.figures() if lag is not None else None,
        }
