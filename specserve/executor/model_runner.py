"""ModelRunner: runs one StepInput on the forward stream and copies its results back.

- `launch(step)` (host): submits the step to the forward stream, orders the copy stream after it
  and submits the device-to-host copy of the step's results; returns a StepHandle at once, and
  must never wait for the device (runtime/host_waits.py counts where it does).
- the step (forward stream): decode and verify steps read anchors and lengths from the FutureMap.
  A verify step plans and drafts (rank 0's windows under TP), runs the target over the windows,
  accepts (owned results), records logprobs and commits (CommitPath). Tokens are sampled on the
  device; the commit's host parties read them late unless one must know them at once.
- `resolve(handle)` (host): waits for the copy's event, tells the late host parties, and turns
  the host copies into one StepOutcome per request whatever the step.
The runner never sees the scheduler; fault injection lives in executor/faulty_runner.py.
"""

from __future__ import annotations

import functools
import itertools
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional

import torch

from specserve.executor.captured_step import CaptureConfig, CapturedStep, VerifyPath
from specserve.executor.commit_path import CommitPath, Committed, HostCommit, tighter, verified_rows
from specserve.executor.request_logits import RequestLogits, verify_row_layout
from specserve.executor.step_io import EXTEND, VERIFY, FutureMap, PromptLogprobs, StepInput, StepOutcome, VerifyStats
from specserve.executor.tp_decisions import TPDecisions
from specserve.kv.pool import KVPool, ReqToTokenPool
from specserve.logits.grammar import GrammarCompiler
from specserve.logits.logprobs import DeviceLogprobs
from specserve.models.forward_batch import ForwardBatch
from specserve.models.llama import LlamaForCausalLM
from specserve.runtime.faults import CopyLag
from specserve.runtime.host_waits import HostWaitDetector
from specserve.runtime.stream import Event, Stream, staged
from specserve.sampler import sample_tokens, seeds_tensor, token_counter
from specserve.speculative.accept import AcceptOuts, VerifyEpilogue, VerifyWindows
from specserve.speculative.committed import CommittedRows
from specserve.speculative.cost_model import StepShape
from specserve.speculative.policy import StepPlan
from specserve.speculative.speculation import Proposal, Speculation
from specserve.speculative.worker import DraftInput


@dataclass
class StepResults:
    """What one step produced, by name: on the device (the forward stream writes it) and, the same
    record with every tensor copied, on the host (the copy stream's `copied`). A prefill or plain
    decode step has its tokens; a verify step its owned accept results; either may carry the commit
    its host parties read late (CommitPath) and the logprobs some request asked for."""

    tokens: Optional[torch.Tensor] = None  # [bs]: each request's token (a prefill chunk's: 0 where none is sampled)
    accept: Optional[AcceptOuts] = None  # a verify step's windows, owned (never views of the epilogue's buffers)
    commit: Optional[Committed] = None  # the commit, where its host parties read it with this copy
    logprobs: list[DeviceLogprobs] = field(default_factory=list)

    def copied(self, copy: Callable[[torch.Tensor], torch.Tensor]) -> "StepResults":
        """This record with every tensor through `copy` (a device-to-host copy), each tensor once:
        a verify step's commit holds the accept results' own tokens, lengths and accepted counts."""
        done: dict[int, torch.Tensor] = {}  # id -> host copy (the tensors live in self meanwhile)

        def once(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in done:
                done[id(t)] = copy(t)
            return done[id(t)]

        return StepResults(
            None if self.tokens is None else once(self.tokens),
            None if self.accept is None else self.accept.map(once),
            None if self.commit is None else self.commit.map(once),
            [part.map(once) for part in self.logprobs],
        )


@dataclass
class StepHandle:
    """One launched step: its plan, its results on the device, their host copies and the copy's
    event; `outcomes` reads the host copies only, once the event has fired."""

    step: StepInput
    plan: Optional[StepPlan] = None  # a verify step's decisions, set on the forward stream
    device: StepResults = field(default_factory=StepResults)  # set on the forward stream
    host: Optional[StepResults] = None  # set on the copy stream
    done: Optional[Event] = None
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)  # request index -> its chunk's

    def commit(self, done: Committed, host_parties_wait: bool) -> None:
        """The step's commit (forward stream), joining the late copy if its host parties still wait."""
        self.device.commit = done if host_parties_wait else None

    def outcomes(self) -> list[StepOutcome]:
        """Each request's outcome, from the host copies only (the copy's event has fired)."""
        assert self.host is not None, "the copy stream made the host copies"
        tokens, stats = self._tokens(self.host)
        lps, prompt = self._logprobs(self.host), self.prompt_logprobs
        return [StepOutcome(t, lps.get(i), prompt.get(i), v) for i, (t, v) in enumerate(zip(tokens, stats))]

    def _logprobs(self, host: StepResults) -> dict[int, list]:
        """Request index -> its TokenLogprobs (a window's up to its commit)."""
        out: dict[int, list] = {}
        commit_lens = host.accept.commit_lens.tolist() if host.accept is not None else None
        for part in host.logprobs:
            for i, found in part.read(commit_lens).items():
                out.setdefault(i, []).extend(found)
        return out

    def _tokens(self, host: StepResults) -> tuple[list[list[int]], list[Optional[VerifyStats]]]:
        """Per request its emitted tokens and, for a speculating engine's decode step (planned:
        its windows), the window's statistics."""
        plan, size = self.plan, self.step.size
        if host.accept is not None:
            out = host.accept
            commit, rows, trimmed = out.commit_lens.tolist(), out.out_tokens.tolist(), out.cap_trim_lens.tolist()
            tokens = [row[:n] for row, n in zip(rows, commit)]
        else:
            assert host.tokens is not None, "a step without windows has its tokens"
            if plan is None:  # a prefill chunk (a token only where one is sampled) or a plain decode step
                return [[t] if s else [] for t, s in zip(host.tokens.tolist(), self.step.sample)], [None] * size
            tokens, trimmed = [[t] for t in host.tokens.tolist()], [0] * size  # planned, no drafts
        assert plan is not None, "a verify step is planned"
        windows = zip(plan.drafters, plan.drafts, plan.predicted, trimmed)
        return tokens, [VerifyStats(drafter, k, predicted, cap) for drafter, k, predicted, cap in windows]


def copy_to_host(src: torch.Tensor, pinned: bool) -> torch.Tensor:
    """One result tensor's host copy (copy stream): into pinned memory, non-blocking, on CUDA."""
    host = torch.empty(src.shape, dtype=src.dtype, pin_memory=pinned)
    return host.copy_(src, non_blocking=pinned)


class ModelRunner:
    """Owns the model, its K/V tensors and the streams; the scheduler owns which slots mean what."""

    # What the fault-injecting subclass plants (executor/faulty_runner.py); the engine reports them.
    alias_accept_buffers: bool = False
    copy_lag: Optional[CopyLag] = None
    epilogue_class: type[VerifyEpilogue] = VerifyEpilogue

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv: KVPool,
        req_to_token: ReqToTokenPool,
        device: str = "cpu",
        max_bs: int = 64,
        speculation: Optional[Speculation] = None,
        forward_stream: Optional[Stream] = None,
        copy_stream: Optional[Stream] = None,
        capture: Optional[CaptureConfig] = None,
        tp: Optional[TPDecisions] = None,
        grammars: Optional[GrammarCompiler] = None,
        host_waits: Optional[HostWaitDetector] = None,
    ):
        self.model = model
        self.kv = kv
        self.req_to_token = req_to_token
        self.device = device
        self.max_bs = max_bs
        self.speculation = speculation or Speculation()
        self.forward = forward_stream or Stream("forward", device)
        self.copy = copy_stream or Stream("copy", device)
        self.future = FutureMap(req_to_token.table.shape[0], device)
        self.epilogue: Optional[VerifyEpilogue] = None  # made at the first verify step
        self.capture = (capture or CaptureConfig(max_bs=max_bs)).fitted(max_bs, device)
        self._captured: dict[int, CapturedStep] = {}  # by window width: 1 (decode) or gamma + 1 (verify)
        self.tp = tp  # rank 0's sampled tokens, drafts, verify lengths and accept results, on every rank
        self.request_logits = RequestLogits(grammars)  # penalties' histories, grammar states (forward stream)
        self.commits = CommitPath(self.future, self.speculation, self.request_logits, device)
        self.host_waits = host_waits  # counts (or refuses) the host's waits on the device inside launch
        self._launches = itertools.count(1)

    @property
    def capture_layer_ids(self) -> tuple[int, ...]:
        return self.speculation.capture_layer_ids

    # ------------------------------------------------------------ host side

    def run(self, step: StepInput) -> list[StepOutcome]:
        """The synchronous loop's step: launch, then wait for its results."""
        return self.resolve(self.launch(step))

    def launch(self, step: StepInput) -> StepHandle:
        """Queue the step on the forward stream and its device-to-host copy after it; returns at once."""
        with self._watching_host_waits():
            if self.tp is not None:
                self.tp.agree_on_batch_shape(step.size, step.num_tokens)
            step.launch = next(self._launches)
            handle = StepHandle(step)
            self.forward.submit(self._step, handle)
            Event().record(self.forward).wait(self.copy)  # the copy reads what the step produced
            self._queue_copy(handle)
        return handle

    def _queue_copy(self, handle: StepHandle) -> None:
        self.copy.submit(self._copy_to_host, handle)
        handle.done = Event().record(self.copy)

    def resolve(self, handle: StepHandle) -> list[StepOutcome]:
        """Wait for the step's copy; one outcome per request of the step."""
        assert handle.done is not None, "launch records the copy's event"
        handle.done.synchronize()
        self.forward.raise_pending()  # a failed step surfaces here, not as a missing result
        assert handle.host is not None, "the copy stream made the host copies"
        if handle.host.commit is not None:  # the host parties, from the late copy (see CommitPath)
            self.commits.commit_host(handle.step, HostCommit.of(handle.host.commit))
        return handle.outcomes()

    def _copy_to_host(self, handle: StepHandle) -> None:
        """Copy stream: the device-to-host copy (pinned and non-blocking on CUDA)."""
        handle.host = handle.device.copied(functools.partial(copy_to_host, pinned=self.copy.device.type == "cuda"))

    # ------------------------------------------------------------ forward stream

    @torch.inference_mode()
    def _step(self, handle: StepHandle) -> None:
        """One step on the forward stream. A decode step of a speculating engine (VERIFY) is planned
        first: with drafts it verifies windows, without any it is a plain decode step."""
        with self._watching_host_waits():  # a threaded stream's too
            self._run_step(handle)

    def _run_step(self, handle: StepHandle) -> None:
        step = handle.step
        start = time.perf_counter()
        if step.mode == EXTEND:
            handle.device.tokens = self._extend(step, handle)
            return
        plan = handle.plan = self._plan(step, step.width - 1) if step.mode == VERIFY else None
        if plan is not None and plan.speculates:
            handle.device.accept = self._verify(step, plan, handle)
            shape = plan.shape
        else:
            handle.device.tokens = self._decode(step, handle)
            shape = StepShape(step.size)
        policy = self.speculation.policy
        if policy is not None and self.forward.device.type == "cpu":  # CUDA steps run asynchronously
            policy.observe_step(shape, time.perf_counter() - start)

    def _extend(self, step: StepInput, handle: StepHandle) -> torch.Tensor:
        every_row = step.prompt_logprobs if any(step.prompt_logprobs) else False
        fb = self._forward_batch(
            step.rows,
            step.prefix_lens,
            step.extend_lens,
            staged(step.input_ids, torch.int64, self.device),
            step.out_cache_loc,
            every_row=every_row,
            sample=step.sample,
        )
        logits = self.model(fb, self.kv)
        if every_row:  # score the prompt rows, keep each sampling request's last row
            logits = self.request_logits.prompt_logprobs(handle.prompt_logprobs, step, logits)
        tokens = torch.zeros(step.size, dtype=torch.int64, device=self.device)
        wanted = [i for i, s in enumerate(step.sample) if s]
        done = Committed.nothing()  # a chunk before its prompt's last commits rows only
        if wanted:
            params, rows = [step.params[i] for i in wanted], [step.rows[i] for i in wanted]
            self.speculation.starting(rows, step.launch)
            for i in wanted:
                fills = step.fills[i]
                assert fills is not None, "a sampling request's prefill carries its tokens"
                self.request_logits.start(step.rows[i], step.params[i], fills, step.out_lens[i])
            out_lens = self._to_device([step.out_lens[i] for i in wanted])
            seeds = [step.seeds[i] for i in wanted]
            counters = token_counter(out_lens)
            picked = self._pick(handle, wanted, logits, rows, params, seeds, counters, "runner.extend_tokens")
            tokens[wanted] = picked
            seq = self._to_device([step.prefix_lens[i] + step.extend_lens[i] for i in wanted])
            done = Committed.one_each(wanted, picked, seq, out_lens + 1, first=True)
        computed = self.commits.rows(fb.captured_hidden, fb.positions, fb.out_cache_loc)
        handle.commit(done, self.commits.commit(step, done, computed))
        return tokens

    def _decode(self, step: StepInput, handle: StepHandle) -> torch.Tensor:
        """One row per request: sample, commit. Output token n draws the uniform of token_counter(n)
        in every kind of step (a seeded request's verify window too: see speculative/accept.py), so
        a seeded request's token does not depend on whether this step drafted."""
        rows = self._to_device(step.rows)
        anchors, prefix, out_lens = self.future.read(rows)
        counters = token_counter(out_lens)
        if self.capture.covers(step.size):
            out = self._captured_step(1).run(rows, prefix, anchors.view(-1, 1), step.kv_bound)
            computed = self.commits.rows(out.hidden, out.positions, out.slots)
            logits = out.logits  # a persistent buffer: sampled right here, before the next replay
        else:
            slots = self.req_to_token.table[rows, prefix].tolist()
            fb = self._forward_batch(
                step.rows, prefix.tolist(), [1] * step.size, anchors, slots, every_row=False, sample=step.sample
            )
            logits = self.model(fb, self.kv)
            computed = self.commits.rows(fb.captured_hidden, fb.positions, fb.out_cache_loc)
        indices = list(range(step.size))
        tokens = self._pick(handle, indices, logits, step.rows, step.params, step.seeds, counters, "runner.decode_tokens")
        done = Committed.one_each(indices, tokens, prefix + 1, out_lens + 1)
        handle.commit(done, self.commits.commit(step, done, computed))
        return tokens

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """Host integers as an int64 tensor on the device (a host-to-device copy: no wait)."""
        return staged(values, torch.int64, self.device)

    def _pick(self, handle: StepHandle, indices: list[int], logits, rows, params, seeds, counters, site) -> torch.Tensor:
        """One token per row, on the device: logits shaped, sampled, rank 0's under TP; logprobs
        computed where a request asks (read with the step's late copy)."""
        logits = self.request_logits.shape(logits, rows, params)
        picked = sample_tokens(logits, params, seeds_tensor(seeds, self.device), counters)
        picked = self._agree([picked], site)[0]
        if (found := self.request_logits.record_logprobs(indices, logits, params, picked)) is not None:
            handle.device.logprobs.append(found)
        return picked

    def _captured_step(self, width: int) -> CapturedStep:
        """The captured step for this window width, made (and registered as persistent) on first use."""
        epilogue = self.epilogue if width > 1 else None
        step = self._captured.get(width)
        if step is None or step.epilogue is not epilogue:
            step = CapturedStep(
                self.model,
                self.kv,
                self.req_to_token.table,
                width,
                self.capture.max_bs,
                self.capture_layer_ids,
                epilogue,
                use_cuda_graph=self.forward.device.type == "cuda",
                compile=self.capture.compile,
                pad_batches=self.capture.pad_batches,
            )
            if self.forward.sanitizer is not None:
                self.forward.sanitizer.register_persistent(step.buffers(), self.forward)
            self._captured[width] = step
        return step

    def _forward_batch(self, rows, prefix_lens, extend_lens, input_ids, slots, every_row, sample=None) -> ForwardBatch:
        """Tensors for one pass (see ForwardBatch.for_requests for which rows get logits)."""
        table, ops, layers = self.req_to_token.table, self.model.ops, self.capture_layer_ids
        return ForwardBatch.for_requests(
            table, rows, prefix_lens, extend_lens, input_ids, slots, every_row, sample, ops, layers
        )

    # ------------------------------------------------------------ speculative verify (forward stream)

    def _verify(self, step: StepInput, plan: StepPlan, handle: StepHandle) -> AcceptOuts:
        """Draft as planned, verify the windows, accept (owned results, rank 0's under TP), then
        the results: logprobs, the policy's observation, the commit."""
        epilogue = self._epilogue(step.width)
        rows = self._to_device(step.rows)
        anchors, prefix, out_lens = self.future.read(rows)
        ids, proposal, verify_lens = self._draft_windows(step, plan, rows, anchors, prefix, out_lens)
        columns = torch.arange(step.width, device=prefix.device)
        window_slots = self.req_to_token.table[rows.unsqueeze(1), prefix.unsqueeze(1) + columns]
        path = VerifyPath.select(step, verify_lens, self.capture)
        logits, hidden, keep = self._window_logits(step, path, rows, ids, prefix, window_slots, verify_lens)
        layout = verify_row_layout(step.size, step.width, keep)
        logits = self.request_logits.shape_windows(logits, step.rows, step.params, ids, layout)
        draft_probs = functools.partial(proposal.draft_probs, ids)
        windows = VerifyWindows(
            ids, logits, prefix, out_lens, step.params, step.seeds, draft_probs, verify_lens, keep, path is VerifyPath.FOLDED
        )
        out = epilogue.accept(windows)  # owned: nothing below reads the *_buf tensors
        done = Committed.accepted(out, out_lens, plan)
        if (found := self.request_logits.window_logprobs(step.params, logits, layout, out.out_tokens)) is not None:
            handle.device.logprobs.append(found)
        reads_rows = self.speculation.reads_rows
        packed = verify_lens if keep is not None else None  # a captured step's hidden rows are every row
        computed = self._verified_rows(hidden, out, prefix, window_slots, packed) if reads_rows else None
        handle.commit(done, self.commits.commit(step, done, computed))  # the policy, the drafters, the FutureMap, ...
        return out

    def _draft_windows(
        self,
        step: StepInput,
        plan: StepPlan,
        rows: torch.Tensor,
        anchors: torch.Tensor,
        prefix: torch.Tensor,
        out_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, Proposal, Optional[list[int]]]:
        """The windows [anchor, drafts] as planned, their drafters' proposal, and the rows of each
        window to verify (None: every row), agreed across ranks."""
        bs, width = step.size, step.width
        ids = torch.empty(bs, width, dtype=torch.int64, device=self.device)
        ids[:, 0] = anchors
        proposal = self._draft(step, rows, ids, prefix, out_lens, plan=plan)
        verify_lens = proposal.verify_lens
        if any(k < width - 1 for k in plan.drafts):  # a window with fewer drafts verifies fewer rows
            verify_lens = tighter(verify_lens, [1 + k for k in plan.drafts])
        if any(p.constrained for p in step.params):  # a draft leaving its grammar ends the window there
            verify_lens = tighter(verify_lens, self.request_logits.draft_limits(step.rows, ids[:, 1:].tolist()))
        if self.tp is not None:
            verify_lens = self.tp.agree_windows(ids, verify_lens)
        return ids, proposal, verify_lens

    def _watching_host_waits(self) -> ContextManager[None]:
        """The host-wait detector watching a launch (a no-op without one)."""
        return nullcontext() if self.host_waits is None else self.host_waits.watching(self.forward.device.type == "cuda")

    def _plan(self, step: StepInput, gamma: int) -> StepPlan:
        """This step's drafter and draft count per request: rank 0's under tensor parallelism."""
        greedy = [p.is_greedy for p in step.params]
        plan = self.speculation.plan(step.drafters, step.rows, gamma, step.refills, greedy, step.launch)
        return plan if self.tp is None else self.tp.agree_plan(plan, sorted(self.speculation.workers))

    def _epilogue(self, width: int) -> VerifyEpilogue:
        if self.epilogue is None or self.epilogue.num_verify_tokens != width:
            agree = self.tp.agree if self.tp is not None else None
            self.epilogue = self.epilogue_class(self.max_bs, width, self.device, agree)
            if self.forward.sanitizer is not None:
                self.forward.sanitizer.register_persistent(self.epilogue.buffers(), self.forward)
        return self.epilogue

    def _draft(
        self,
        step: StepInput,
        rows: torch.Tensor,
        ids: torch.Tensor,
        prefix: torch.Tensor,
        out_lens: torch.Tensor,
        plan: StepPlan,
    ) -> Proposal:
        """Fill ids[:, 1:] with each request's drafts as planned; returns their distributions
        and verify lengths."""
        static = bool(self.capture.static_windows and self.capture.covers(step.size))
        gamma, bound = ids.shape[1] - 1, step.kv_bound or None
        draft = DraftInput(rows, ids[:, 0], prefix, out_lens, step.params, step.seeds, gamma, None, bound, step.launch)
        return self.speculation.propose(plan, draft, step.rows, ids, compact=not static)

    def _agree(self, tensors: list[torch.Tensor], site: str) -> list[torch.Tensor]:
        """Rank 0's values of these int64 CPU tensors on every rank (identity without TP)."""
        return tensors if self.tp is None else self.tp.agree(tensors, site)

    def _window_logits(
        self,
        step: StepInput,
        path: VerifyPath,
        rows: torch.Tensor,
        ids: torch.Tensor,
        prefix: torch.Tensor,
        window_slots: torch.Tensor,
        verify_lens: Optional[list[int]],
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The target over the windows, on the path chosen (see `_verify_forward` for what it returns)."""
        if path is VerifyPath.EAGER:
            return self._verify_forward(step, ids, prefix, window_slots, verify_lens)
        ran = self._captured_step(step.width).run(rows, prefix, ids, step.kv_bound, accept=path is VerifyPath.FOLDED)
        return ran.logits, ran.hidden, None

    def _verify_forward(
        self,
        step: StepInput,
        ids: torch.Tensor,
        prefix: torch.Tensor,
        window_slots: torch.Tensor,
        verify_lens: Optional[list[int]],
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Target logits of the computed rows, packed, the packed rows' hidden states, and which
        window rows they are ([bs, W]; None: every row, the strided [bs * W, V] layout)."""
        bs, width = ids.shape
        lens = verify_lens or [width] * bs
        keep = torch.arange(width, device=self.device).unsqueeze(0) < self._to_device(lens).unsqueeze(1)
        fb = self._forward_batch(step.rows, prefix.tolist(), lens, ids[keep], window_slots[keep].tolist(), every_row=True)
        packed = self.model(fb, self.kv)
        return packed, fb.captured_hidden, None if verify_lens is None else keep

    def _verified_rows(self, hidden, out: AcceptOuts, prefix, window_slots, verify_lens) -> CommittedRows:
        """The drafters' rows of a verify step (a seam the tests plant faults at)."""
        return verified_rows(hidden, out.commit_lens, prefix, window_slots, verify_lens)

    def discard_captured(self) -> None:
        """Drop the captured steps and the epilogue, and their sanitizer registrations: a runner
        built only to time steps (engine/builder.py) leaves nothing persistent behind."""
        sanitizer = self.forward.sanitizer
        owned = [b for step in self._captured.values() for b in step.buffers()]
        owned += self.epilogue.buffers() if self.epilogue is not None else []
        if sanitizer is not None:
            sanitizer.unregister_persistent(owned)
        self._captured.clear()
        self.epilogue = None

    def close(self) -> None:
        self.forward.close()
        self.copy.close()
        cache = getattr(self.model, "weight_cache", None)
        if cache is not None:  # a first start's packed weights still being written
            cache.finish()
