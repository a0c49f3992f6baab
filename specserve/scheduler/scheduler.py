"""Scheduler: continuous batching over a paged KV cache, in pure Python.

Each step is either one prefill batch (new requests, after their cached prefixes, chunked to
`chunked_prefill_size`) or one decode batch (every running request advances one token, or one
verify window). It never touches the model: a loop (scheduler/loops.py) hands each batch's
StepInput to an executor and the outcomes back to `process_result`, which keeps the whole
policy testable with a fake one.

The Scheduler composes its parts, each a class or function that can be read and tested alone:
- RequestQueues (req.py): waiting, chunked, running, in flight;
- KVLedger (kv_ledger.py): KV and table, the one writer of a request's positions;
- MemoryPressure (batching.py): admission's reserve estimate and retraction;
- Admission (batching.py): prefill batches, chunked prefill;
- DecodeWindows (batching.py): decode batches and their windows;
- finishing: stop checks (check_finish, req.py) as results are committed here;
- SchedulerStats (at the end of this file): the counters behind the activity log line.

The KV bookkeeping invariant (check_kv_integrity, at the end of this file), checked by tests and
by the engine's debug paths: free + cached + in use == total, no slot counted twice, the scratch
slot 0 never handed out, and every lock released when no request is live.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from specserve.executor.step_io import EXTEND, StepOutcome, VerifyStats
from specserve.kv.pool import ReqToTokenPool, TokenSlotAllocator
from specserve.kv.radix_cache import RadixCache
from specserve.scheduler.batching import Admission, DecodeWindows, MemoryPressure, SchedulerConfig
from specserve.scheduler.kv_ledger import KVLedger
from specserve.scheduler.req import FinishReason, Req, RequestQueues, ScheduleBatch, check_finish, validate_request

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one step produced: (request, new token) pairs and the requests that finished."""

    tokens: list[tuple[Req, int]] = field(default_factory=list)
    finished: list[Req] = field(default_factory=list)
    flushed: list[tuple[str, int]] = field(default_factory=list)  # (flush token, cache slots freed)


class Scheduler:
    """Owns the request queues and all KV bookkeeping, through its parts (see the module docstring)."""

    def __init__(
        self,
        cfg: SchedulerConfig,
        allocator: TokenSlotAllocator,
        req_to_token: ReqToTokenPool,
        tree: RadixCache,
        decode_text: Optional[Callable[[list[int]], str]] = None,
        consensus: Any = None,
    ):
        self.cfg = cfg
        self.decode_text = decode_text
        self.consensus = consensus  # a RankConsensusChecker under tensor parallelism
        # Each decode step covers this many positions per request: the anchor plus its drafts,
        # which the executor's drafters propose on the forward stream (DSPARK or NGRAM).
        self.window = 1 + cfg.num_draft_tokens
        self.queues = RequestQueues()
        self.ledger = KVLedger(allocator, req_to_token, tree, self._agree)
        self.pressure = MemoryPressure(self.ledger, self.queues, self.window)
        self.admission = Admission(cfg, self.ledger, self.queues, self.pressure)
        self.windows = DecodeWindows(self.window, self.ledger, self.queues, self.pressure)
        self._arrivals = 0
        self.stats = SchedulerStats(self.window - 1)

    def _agree(self, site: str, value: Any) -> None:
        """An event the other tensor-parallel ranks must reproduce exactly (see distributed/consensus.py)."""
        if self.consensus is not None:
            self.consensus.record(site, value)

    def load(self) -> dict[str, int]:
        """Queue, batch and KV occupancy: slots held by requests vs by the prefix cache."""
        allocator, queues = self.ledger.allocator, self.queues
        cached, free = self.ledger.tree.total_size, allocator.available
        return {
            "waiting": len(queues.waiting),
            "running": len(queues.running) + (queues.chunked is not None),
            "kv_total_tokens": allocator.size,
            "kv_free_tokens": free,
            "kv_cached_tokens": cached,
            "kv_request_tokens": allocator.size - free - cached,
        }

    # ------------------------------------------------------------ requests in and out

    def add_request(self, req: Req) -> Optional[Req]:
        """Queue a request; returns it at once if it needs no step (max_new_tokens == 0). Its
        params were validated where it came in: only what depends on this scheduler is checked."""
        self.validate_request(req)
        room = self.cfg.context_length - len(req.input_ids)
        req.params.max_new_tokens = min(req.params.max_new_tokens, room)
        req.arrival = self._arrivals
        self._arrivals += 1
        if req.params.max_new_tokens == 0:
            req.finish_reason = FinishReason.LENGTH
            return req
        self.queues.waiting.append(req)
        return None

    def validate_request(self, req: Req) -> None:
        """What only the scheduler can check, before a request is queued: its context window and KV room."""
        validate_request(req, self.cfg.context_length, self.window, self.ledger.allocator.size)

    def abort(self, rid: str) -> Optional[Req]:
        """Stop a request wherever it is; its KV is released exactly once."""
        queues = self.queues
        for req in queues.waiting:
            if req.rid == rid:
                queues.waiting.remove(req)
                return _finish(req, FinishReason.ABORT)
        for req in queues.live():
            if req.rid == rid and not req.finished:
                if req is queues.chunked:
                    queues.chunked = None
                elif req in queues.running:
                    queues.running.remove(req)
                # A request in the in-flight batch only; process_result skips it once finished.
                self.ledger.release(req)
                return _finish(req, FinishReason.ABORT)
        return None

    def has_work(self) -> bool:
        return bool(self.queues.waiting or self.queues.running or self.queues.chunked)

    # ------------------------------------------------------------ one step

    def schedule(self) -> Optional[ScheduleBatch]:
        """Next batch: a prefill when anything can be admitted, else a decode of all running requests."""
        batch = self.admission.schedule()
        if batch is None and self.queues.running:
            batch = self.windows.schedule()
        if batch is not None:
            self.queues.in_flight.append(batch)
            self._agree("batch", (batch.mode, [(r.rid, n) for r, n in zip(batch.reqs, batch.extend_lens)]))
        return batch

    def overlap_ready(self) -> bool:
        return self.windows.overlap_ready()

    def process_result(self, batch: ScheduleBatch, outcomes: Sequence[StepOutcome]) -> StepResult:
        """Commit a step's outcomes (one per request, whatever the step): tokens, stops, KV
        lengths; finished requests release their KV."""
        result = StepResult()
        self.queues.in_flight.remove(batch)
        for req, n, sampled, outcome in zip(batch.reqs, batch.extend_lens, batch.sample, outcomes):
            if req.finished:  # aborted while its step was in flight; its KV is already released
                continue
            if outcome.prompt_logprobs is not None:
                req.add_prompt_logprobs(outcome.prompt_logprobs.start, outcome.prompt_logprobs.logprobs)
            if not sampled:
                req.kv_len += n
                self.queues.chunked = req
                continue
            reason = self._commit(req, batch.mode == EXTEND, n, outcome, result)
            if reason is not None:
                self.queues.running.remove(req)
                self.ledger.release(req)
                result.finished.append(_finish(req, reason))
        if batch.mode != EXTEND:
            self.pressure.decode_step_done()
        self._agree("committed", [(r.rid, r.kv_len, len(r.output_ids)) for r in batch.reqs])
        return result

    def _commit(self, req: Req, prefill: bool, n: int, outcome: StepOutcome, result: StepResult) -> Optional[FinishReason]:
        """One sampling request's emitted tokens, up to a stop; returns why it finished, if it did."""
        emitted = outcome.tokens
        assert emitted, "a sampling request's outcome carries its tokens"
        start = req.kv_len
        reason, appended = None, 0
        for tok in emitted:  # stop conditions apply inside an accepted run: nothing past a stop
            req.output_ids.append(tok)
            result.tokens.append((req, tok))
            appended += 1
            self.stats.generated_tokens += 1
            reason = self._check_finish(req)
            if reason is not None:
                break
        if outcome.logprobs is not None:
            req.output_logprobs.extend(outcome.logprobs[:appended])
        if prefill:
            req.kv_len += n
            self.queues.running.append(req)
        else:
            # Window rows 0..appended-1 (the anchor and the emitted drafts) hold committed KV.
            # The slots past them stay with the request: the next window overwrites them.
            req.kv_len = start + appended
            if outcome.verify is not None:
                self.stats.record_window(req, outcome.verify, appended, len(emitted))
        return reason

    def _check_finish(self, req: Req) -> Optional[FinishReason]:
        try:
            return check_finish(req, self.cfg.eos_token_ids, self.decode_text)
        except Exception as exc:  # one request's host work (detokenizing for its stop strings) fails it alone
            logger.error("request %s failed in its stop check", req.rid, exc_info=True)
            req.error = f"stop check failed: {type(exc).__name__}: {exc}"
            return FinishReason.ERROR

    # ------------------------------------------------------------ integrity

    def live_requests(self) -> list[Req]:
        """Requests holding KV: running, the chunked one, and those of the in-flight batch."""
        return self.queues.live()

    def check_integrity(self) -> None:
        """free + cached + in use == total, no slot counted twice, and locks balanced when idle."""
        check_kv_integrity(self.ledger.allocator, self.ledger.tree, self.live_requests())


def _finish(req: Req, reason: FinishReason) -> Req:
    req.finish_reason = reason
    return req


def check_kv_integrity(allocator: TokenSlotAllocator, tree: RadixCache, live: Sequence[Req]) -> None:
    """free + cached + in use == total, no slot counted twice, the scratch slot 0 never handed
    out, and every lock released when no request is live. Raises AssertionError naming the gap."""
    allocator.check_no_duplicates()
    owned = [s for r in live for s in r.kv_slots[r.cache_protected_len :]]
    cached = tree.all_slots()
    total = allocator.available + len(cached) + len(owned)
    if total != allocator.size:
        raise AssertionError(
            f"KV integrity: free {allocator.available} + cached {len(cached)} + "
            f"in use {len(owned)} = {total} != pool size {allocator.size}"
        )
    everything = set(allocator._free) | set(cached) | set(owned)
    if len(everything) != allocator.size or 0 in everything:
        raise AssertionError("KV integrity: a token slot is both free and in use, or the scratch slot leaked")
    if len(cached) != tree.total_size:
        raise AssertionError(f"KV integrity: tree size {tree.total_size} != slots in tree {len(cached)}")
    if not live and tree.evictable_size != tree.total_size:
        raise AssertionError("KV integrity: idle but some cache is still locked")


# ------------------------------------------------------------ the counters behind the activity line

LOG_INTERVAL_S = 5.0  # at most one activity line this often (at INFO)


@dataclass
class SchedulerStats:
    """Counts since start. `gamma` is the drafts per verify step (0 without speculation)."""

    gamma: int
    generated_tokens: int = 0
    verify_steps: int = 0
    correct_drafts: int = 0
    correct_hist: dict[int, int] = field(default_factory=dict)  # accepted drafts per request-step -> count
    cap_trim_hist: dict[int, int] = field(default_factory=dict)  # matches cut by the verify length -> count
    draft_len_hist: dict[int, int] = field(default_factory=dict)  # drafts planned per request-step (k) -> count
    drafter_steps: dict[str, int] = field(default_factory=dict)  # request-steps with drafts, per drafter
    predicted_windows: int = 0  # windows the policy predicted an accept length for
    predicted_sum: float = 0.0
    predicted_abs_error_sum: float = 0.0  # |predicted - realised accept length|
    _last_time: float = field(default_factory=time.monotonic)
    _last_tokens: int = 0
    _last_queues: tuple[int, int] = (0, 0)  # (running, waiting) at the last line

    def record_verify(self, correct: int, cap_trimmed: int) -> None:
        self.verify_steps += 1
        self.correct_drafts += correct
        self.correct_hist[correct] = self.correct_hist.get(correct, 0) + 1
        self.cap_trim_hist[cap_trimmed] = self.cap_trim_hist.get(cap_trimmed, 0) + 1

    def record_window(self, req: Req, window: VerifyStats, appended: int, committed: int) -> None:
        """A verify step's window: what was planned for it and, if it had drafts, how they fared."""
        req.record_plan(window.drafter, window.drafts)
        self.record_plan(window.drafter, window.drafts)
        if window.drafts == 0:
            return  # one verified row, no drafts: a plain decode step for this request
        correct = req.record_verify(appended, committed, window.cap_trimmed)
        self.record_verify(correct, window.cap_trimmed)
        if window.predicted > 0:
            req.spec_predicted_sum += window.predicted
            self.record_prediction(window.predicted, committed)

    def record_plan(self, drafter: Optional[str], drafts: int) -> None:
        self.draft_len_hist[drafts] = self.draft_len_hist.get(drafts, 0) + 1
        if drafter is not None and drafts > 0:
            self.drafter_steps[drafter] = self.drafter_steps.get(drafter, 0) + 1

    def record_prediction(self, predicted: float, realised: int) -> None:
        self.predicted_windows += 1
        self.predicted_sum += predicted
        self.predicted_abs_error_sum += abs(predicted - realised)

    @property
    def accept_length(self) -> float:
        """Tokens committed per request-step: accepted drafts plus the bonus."""
        return 1.0 + self.correct_drafts / self.verify_steps if self.verify_steps else 0.0

    def maybe_log(self, running: int, waiting: int, cost_residual: float | None = None, now: float | None = None) -> bool:
        """Log `log_line` (at INFO) when one is due: LOG_INTERVAL_S since the last and activity since
        (tokens generated, or requests came or went). An idle engine logs nothing, as SGLang logs its
        decode batches rather than the clock; once the last request leaves, one more line gives the
        final rate. Called after every engine step; True when it logged."""
        now = time.monotonic() if now is None else now
        if now - self._last_time < LOG_INTERVAL_S or not logger.isEnabledFor(logging.INFO):
            return False
        if self.generated_tokens == self._last_tokens and (running, waiting) == self._last_queues:
            self._last_time = now  # idle: the next line's rate covers its own interval, not the idle time
            return False
        logger.info("%s", self.log_line(running, waiting, cost_residual, now))
        return True

    def log_line(self, running: int, waiting: int, cost_residual: float | None = None, now: float | None = None) -> str:
        """One line for the engine log: throughput since the last line, spec totals and the
        policy's decisions (`cost_residual`: the step-cost model's mean relative error)."""
        now = time.monotonic() if now is None else now
        rate = (self.generated_tokens - self._last_tokens) / max(now - self._last_time, 1e-9)
        self._last_time, self._last_tokens, self._last_queues = now, self.generated_tokens, (running, waiting)
        line = f"running {running}, waiting {waiting}, gen {rate:.1f} tok/s, total {self.generated_tokens} tokens"
        if self.verify_steps:
            accepted = self.correct_drafts / (self.verify_steps * self.gamma) if self.gamma else 0.0
            line += (
                f", accept length {self.accept_length:.2f}, accept rate {accepted:.3f}, "
                f"correct drafts hist {dict(sorted(self.correct_hist.items()))}, "
                f"cap-trim hist {dict(sorted(self.cap_trim_hist.items()))}"
            )
        if self.draft_len_hist:
            line += (
                f", drafts hist {dict(sorted(self.draft_len_hist.items()))}, "
                f"drafter steps {named_counts(self.drafter_steps)}"
            )
        if self.predicted_windows:
            n = self.predicted_windows
            line += (
                f", predicted accept length {self.predicted_sum / n:.2f} "
                f"(mean abs error {self.predicted_abs_error_sum / n:.2f})"
            )
        if cost_residual is not None:
            line += f", step-cost residual {100 * cost_residual:.1f}%"
        return line


def named_counts(counts: Mapping[str, int]) -> str:
    """`DSPARK 6, NGRAM 2`: each key by its name (str(), never an enum's repr), in name order."""
    return ", ".join(f"{name} {n}" for name, n in sorted((str(k), v) for k, v in counts.items()))
