"""Engine: the offline API and the serving step of one process (rank 0 under tensor parallelism)."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import sys
import threading
import time
import traceback
import uuid
from typing import Any, Optional, Union

from specserve.args import ServerArgs
from specserve.distributed.group import DistConfig
from specserve.distributed.launch import RankStartupError, first_failure, rendezvous_addr, spawn_ranks
from specserve.engine.broadcast import CommandBroadcast
from specserve.engine.builder import build_rank
from specserve.engine.inputs import Params, Prompt, normalize_inputs, normalize_params
from specserve.engine.messages import AbortRequest, AddRequest, Command, Drain, FlushCache, Shutdown
from specserve.engine.output import request_output
from specserve.engine.tools import ToolSurface
from specserve.logits.grammar import GrammarSpec
from specserve.models.activations import choose_cpu_activations, with_resolved_activations
from specserve.sampling_params import SamplingParams
from specserve.scheduler.req import Req
from specserve.scheduler.scheduler import StepResult

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.5  # an idle rank 0 steps this often under TP (well inside any collective timeout)


class Engine(ToolSurface):
    """Offline engine: `Engine(model_path=None, **server_args).generate(prompt, sampling_params=...)`.

    With `tp_size > 1` this object is rank 0 of an SPMD group: it spawns the other ranks, and every
    step starts with rank 0 broadcasting the commands (new requests, aborts) that all ranks apply
    before scheduling identically. Benchmarks, training and checks use the named methods of
    `ToolSurface` (engine/tools.py), never the runner's attributes.
    """

    def __init__(self, model_path: Optional[str] = None, **kwargs: Any):
        asked = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        # What the quantized linears compute with, and why (the start-up block says both); once, for every rank.
        chosen, reason = choose_cpu_activations(asked.cpu_activations, asked.device, asked.quantization)
        self.cpu_activations_reason: Optional[str] = reason
        args = asked.replace(cpu_activations=chosen)
        self._workers: list = []
        self.rank_figures: Optional[list[dict]] = None  # every rank's measured figures, after shutdown
        dist_cfg = None
        if args.tp_size > 1:
            addr = rendezvous_addr(args)
            self._workers = spawn_ranks(args, addr, True, rank_main)
            # While starting, rank 0 watches the ranks it spawned: one that exits fails it at once.
            dist_cfg = DistConfig.of(args, 0, addr, watch=lambda: first_failure(self._workers))
        try:
            self._build(args, dist_cfg)
        except BaseException as exc:
            failure = self._dead_worker(exc)
            self._stop_workers(timeout_s=5)
            if failure is not None and not isinstance(exc, RankStartupError):
                # The dead rank first (usually the cause), then what rank 0 itself saw.
                raise RankStartupError(f"{failure}; rank 0: {type(exc).__name__}: {exc}") from exc
            raise

    @classmethod
    def for_rank(cls, args: ServerArgs, dist_cfg: DistConfig) -> "Engine":
        """The engine of one non-zero tensor-parallel rank (see rank_main)."""
        engine = cls.__new__(cls)
        engine._workers, engine.rank_figures = [], None
        engine.cpu_activations_reason = None  # rank 0 resolved the activations and reports why
        engine._build(args, dist_cfg)
        return engine

    def _build(self, args: ServerArgs, dist_cfg: Optional[DistConfig]) -> None:
        logging.basicConfig(level=args.log_level.upper())
        args = with_resolved_activations(args)  # a rank started on its own (another node) gets auto here
        parts = build_rank(args, dist_cfg)
        self.args, self.tp_rank = args, dist_cfg.rank if dist_cfg is not None else 0
        self.model, self.tokenizer, self.dist = parts.model, parts.tokenizer, parts.group
        self.runner, self.scheduler, self.loop = parts.runner, parts.scheduler, parts.loop
        if self.dist is not None:
            self.dist.started()  # model loading is over: collectives now use the collective timeout
        self._drafter = args.speculative_algorithm if args.speculating else None  # what new requests draft with
        self._seed_rng = random.Random(args.random_seed)
        self._commands = CommandBroadcast(self.dist)
        self._queued: dict[str, Req] = {}  # rank 0's requests, from their AddRequest's put to its apply
        self._step_lock = threading.RLock()
        self._last_step = time.monotonic()
        self._closed = False
        if self.dist is not None and self.tp_rank == 0:
            threading.Thread(target=self._heartbeat, name="tp-heartbeat", daemon=True).start()

    # ------------------------------------------------------------ API

    def generate(
        self, prompt: Prompt = None, input_ids: Optional[list] = None, sampling_params: Union[Params, list[Params]] = None
    ) -> Union[dict, list[dict]]:
        """Generate for one prompt (returns a dict) or a batch (returns a list of dicts)."""
        single, token_lists = self._normalize_inputs(prompt, input_ids)
        params = self._normalize_params(sampling_params, len(token_lists))
        reqs = [self._make_req(ids, sp) for ids, sp in zip(token_lists, params)]
        for req in reqs:  # validate everything before queueing anything
            self.scheduler.validate_request(req)
        for req in reqs:
            self._put(req)
        done: set[str] = set()
        with self._sanitized(), self._closed_batch():
            while len(done) < len(reqs):
                result = self.step()
                done.update(req.rid for req in result.finished)
                if not self.has_work() and len(done) < len(reqs):
                    raise RuntimeError("engine: scheduler idle with unfinished requests")
            self._commands.put(Drain())  # the overlap loop's last step, on every rank
            self.step()
        outputs = [self.output(r) for r in reqs]
        return outputs[0] if single else outputs

    # ------------------------------------------------------------ serving: one step at a time

    def submit(self, input_ids: list[int], sampling_params: Params, rid: Optional[str] = None) -> Req:
        """Validate and queue one request for the next step (InvalidRequestError names the bad field)."""
        _, [ids] = self._normalize_inputs(None, input_ids)
        req = self._make_req(ids, self._normalize_params(sampling_params, 1)[0])
        if rid is not None:
            req.rid = rid
        self.scheduler.validate_request(req)
        self._put(req)
        return req

    def add(self, command: AddRequest) -> Req:
        """Queue a request a front end parsed and validated (its grammar compiled: `check_grammar`);
        only what depends on this engine's state is checked here (context window, KV room)."""
        req = self._req_of(command)
        self.scheduler.validate_request(req)
        self._put(req)
        return req

    def check_grammar(self, params: SamplingParams) -> None:
        """Compile a request's grammar into the cache (InvalidRequestError if it does not compile);
        thread-safe, so a serving loop can run it off its own thread before `add`."""
        spec = GrammarSpec.of(params)
        grammars = self.runner.request_logits.grammars
        if spec is not None:
            assert grammars is not None, "the builder gives every runner a grammar compiler"
            grammars.check(spec)

    def abort(self, rid: str) -> None:
        """Stop a request at the next step; it then comes back in that step's `finished`."""
        self._commands.put(AbortRequest(rid))

    def flush_cache(self, token: str = "flush") -> None:
        """Drop every cached prefix no request holds, on every rank, at the next step; that step's
        result reports (token, slots freed) in `flushed`."""
        self._commands.put(FlushCache(token))

    def step(self) -> StepResult:
        """Apply the pending commands (on every rank), then run one loop step if there is work."""
        with self._step_lock:
            if self.scheduler.consensus is not None:
                self.scheduler.consensus.raise_if_dead()  # unchecked ranks would go on silently
            result = StepResult()
            for command in self._commands.take():
                self._apply(command, result)
            if self.loop.has_work():
                try:
                    more = self.loop.step()
                except Exception:
                    if self.scheduler.consensus is not None:  # name the first divergent site, not the broken collective
                        self.scheduler.consensus.flush()
                    raise
                result.tokens += more.tokens
                result.finished += more.finished
            self._last_step = time.monotonic()
        self._maybe_log_stats()
        return result

    def _apply(self, command: Command, result: StepResult) -> None:
        """Apply one command, on every rank (rank 0's requests are the objects its callers hold)."""
        if isinstance(command, AddRequest):
            req = self._queued.pop(command.rid, None)
            if req is None:  # another rank: the request as rank 0 republished it
                req = self._req_of(command)
            early = self.scheduler.add_request(req)
            if early is not None:
                result.finished.append(early)
        elif isinstance(command, AbortRequest):
            req = self.scheduler.abort(command.rid)
            if req is not None:
                result.finished.append(req)
        elif isinstance(command, Drain):
            self.loop.drain()
        elif isinstance(command, FlushCache):
            result.flushed.append((command.token, self.scheduler.ledger.tree.flush()))
        elif isinstance(command, Shutdown):
            self._closed = True
            if self.scheduler.consensus is not None:  # a last comparison of everything recorded, then stop
                self.scheduler.consensus.stop()
            if self.dist is not None:  # every rank's figures, on every rank
                self.rank_figures = self.dist.all_gather_json(self._figures(), "engine.shutdown_figures")

    def _figures(self) -> dict[str, Any]:
        """This rank's measured reliability figures (gathered from every rank at shutdown)."""
        lag = self.runner.copy_lag
        return {
            "rank": self.tp_rank,
            "collective_timeouts": self.dist.timeouts if self.dist is not None else 0,
            "consensus": self.scheduler.consensus.figures() if self.scheduler.consensus is not None else None,
            "copy_lag": lag.figures() if lag is not None else None,
        }  # SPECSERVE_FAULT_COPY_LAG_MS

    def follow(self) -> bool:
        """A non-zero rank's loop body: one step as rank 0 commands; False once it shuts down."""
        self.step()
        return not self._closed

    def _heartbeat(self) -> None:
        """Rank 0, idle: an empty step now and then, so that waiting ranks see a live rank 0
        instead of timing out in their command broadcast."""
        while not self._closed:
            time.sleep(HEARTBEAT_S)
            if time.monotonic() - self._last_step < HEARTBEAT_S or self._closed:
                continue
            with self._step_lock:
                if self.loop.has_work() or self._commands or self._closed:
                    continue
                try:
                    self.step()
                except Exception:  # the engine is failing; the caller's own step reports it
                    return

    def has_work(self) -> bool:
        return bool(self._commands) or self.loop.has_work()

    def sanitized(self):
        """The stream sanitizer's scope when STREAM_SANITIZER is set, else a no-op context."""
        return self._sanitized()

    def load(self) -> dict[str, float]:
        """Queue, batch and KV occupancy (slots held by requests vs by the prefix cache) and, with
        the adaptive speculation policy, its step-cost model's mean relative error."""
        out: dict[str, float] = dict(self.scheduler.load())
        policy = self.runner.speculation.policy
        if policy is not None and policy.cost.steps:
            out["spec_cost_residual"] = policy.cost.mean_abs_relative_residual
        return out

    def output(self, req: Req) -> dict[str, Any]:
        """The output dict of a (finished) request, as `generate` returns it."""
        return request_output(req, self.tokenizer)

    def _sanitized(self):
        sanitizer = self.runner.forward.sanitizer  # the streams' (see builder._make_streams)
        return sanitizer.active() if sanitizer is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def _closed_batch(self):
        """While `generate` runs its list, nothing else arrives: a slot a request frees while none
        waits stays empty, which the speculation policy prices (speculative/policy.py)."""
        queues = self.scheduler.queues
        queues.closed = True
        try:
            yield
        finally:
            queues.closed = False

    def _maybe_log_stats(self) -> None:
        # The stats decide when a line is due (on activity, at most every 5 s: SchedulerStats).
        queues = self.scheduler.queues
        policy = self.runner.speculation.policy
        residual = policy.cost.mean_abs_relative_residual if policy is not None else None
        self.scheduler.stats.maybe_log(len(queues.running), len(queues.waiting), residual)

    def shutdown(self) -> None:
        """Stop this engine; rank 0 also tells the other ranks to stop and waits for them."""
        if getattr(self, "runner", None) is None:
            self._stop_workers(timeout_s=5)
            return
        clean = True
        if self.dist is None:
            self.rank_figures = [self._figures()]
        elif self.tp_rank == 0 and not self._closed:
            try:
                self._commands.put(Shutdown())
                self.step()
            except Exception as exc:  # a rank is already gone: nothing to tell it
                logger.warning("tensor-parallel shutdown: %s", exc)
                clean = False
        self._closed = True
        if self.scheduler.consensus is not None and self.scheduler.consensus.alive:
            self.scheduler.consensus.abandon()  # it cannot finish with the groups torn down below
        self.runner.close()
        if self.dist is not None and not clean:  # ranks still waiting on this one see it close at once
            self.dist.close()
        self._stop_workers(timeout_s=30 if clean else 10)
        if self.dist is not None and clean:  # after the others left their loops
            self.dist.close()
        del self.scheduler, self.runner, self.loop  # their memory (the KV pool's) goes now; shutdown() again is a no-op

    def _stop_workers(self, timeout_s: float) -> None:
        for rp in self._workers:
            rp.proc.join(timeout_s)
            if rp.proc.is_alive():
                logger.error("tensor-parallel rank process %s did not exit; killing it", rp.proc.pid)
                rp.proc.kill()
                rp.proc.join(5)
        self._workers = []

    def _dead_worker(self, exc: BaseException, grace_s: float = 2.0) -> Optional[str]:
        """While starting: a spawned rank that has exited (given a moment to be reaped: a peer's
        broken connection is often seen before its exit status)."""
        deadline = time.monotonic() + (grace_s if self._workers and not isinstance(exc, RankStartupError) else 0)
        while True:
            failure = first_failure(self._workers)
            if failure is not None or time.monotonic() >= deadline:
                return failure
            time.sleep(0.05)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------ helpers

    def _normalize_inputs(self, prompt: Prompt, input_ids: Optional[list]) -> tuple[bool, list[list[int]]]:
        return normalize_inputs(prompt, input_ids, self.tokenizer, self.model.config.vocab_size)

    def _normalize_params(self, sampling_params: Union[Params, list[Params]], n: int) -> list[SamplingParams]:
        """The offline API's boundary: each request's params parsed and validated once, its grammar compiled."""
        params = normalize_params(sampling_params, n, self.model.config.vocab_size)
        for p in params:  # a grammar that does not compile is the request's error, before it is queued
            self.check_grammar(p)
        return params

    def _make_req(self, ids: list[int], params: SamplingParams) -> Req:
        return Req(rid=uuid.uuid4().hex, input_ids=ids, params=params, seed=self._seed(params), drafter=self._drafter)

    def _req_of(self, command: AddRequest) -> Req:
        return Req(
            command.rid,
            list(command.input_ids),
            command.params,
            self._seed(command.params, command.seed),
            drafter=self._drafter,
        )

    def _seed(self, params: SamplingParams, republished: Optional[int] = None) -> int:
        """A request's sampling seed: rank 0's republished one, the request's own, else a fresh draw."""
        if republished is not None:
            return republished
        return params.seed if params.seed is not None else self._seed_rng.getrandbits(63)

    def _put(self, req: Req) -> None:
        """Queue a validated request for the next step; rank 0 republishes it with its seed."""
        self._queued[req.rid] = req
        self._commands.put(AddRequest(req.rid, req.input_ids, req.params, req.seed))


def rank_main(args_dict: dict, rank: int, addr: str, started) -> None:
    """A non-zero rank's process: build the engine shard, follow rank 0's steps, exit non-zero on failure.
    A rank that fails exits non-zero; the others then fail their next collective within the timeout
    instead of hanging, and rank 0, while it starts, at once (it watches the processes it spawned)."""
    started.set()  # the spawn bootstrap (re-importing the main module) is behind us
    parent = os.getppid()
    args = ServerArgs.from_kwargs(**args_dict)
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    engine = None
    try:
        engine = Engine.for_rank(args, DistConfig.of(args, rank, addr, watch=lambda: _orphaned(parent)))
        with engine.sanitized():
            while engine.follow():
                pass
    except BaseException:
        logger.critical("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        sys.stdout.flush()
        sys.exit(1)
    finally:
        if engine is not None and engine.runner is not None:
            engine.runner.close()


def _orphaned(parent: int) -> Optional[str]:
    """While joining: the process that spawned this rank is gone (rank 0 will never come)."""
    return None if os.getppid() == parent else f"the process that spawned this rank (pid {parent}) exited"
