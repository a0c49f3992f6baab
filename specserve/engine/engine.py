"""Engine: offline generation on one process (scheduler, model runner and KV cache together)."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
import uuid
from typing import Any, Optional, Union

import torch

from specserve import envs
from specserve.args import DEFAULT_BLOCK_SIZE, MAX_DRAFT_TOKENS, ServerArgs
from specserve.distributed.consensus import RankConsensusChecker
from specserve.distributed.group import DistConfig, TPGroup
from specserve.tokenizer.tokenizer import Tokenizer, load_tokenizer
from specserve.kv.pool import KVPool, ReqToTokenPool, TokenSlotAllocator
from specserve.kv.radix_cache import RadixCache
from specserve.models.layers import TPContext
from specserve.models.llama import LlamaForCausalLM
from specserve.models.loader import load_model, resolve_model_path
from specserve.models.dspark import DraftVocabHead, DsparkDrafter, load_drafter
from specserve.models.model_runner import CaptureConfig, DsparkParts, ModelRunner
from specserve.sampling_params import SamplingParams
from specserve.runtime.faults import FaultConfig
from specserve.runtime.sanitizer import StreamSanitizer
from specserve.runtime.stream import Stream
from specserve.scheduler.loops import NormalLoop, OverlapLoop
from specserve.scheduler.req import Req
from specserve.scheduler.scheduler import Scheduler, SchedulerConfig, StepResult
from specserve.speculative.ngram import NgramDrafter
from specserve.speculative.planner import SpsTable, VerifyPlanner

logger = logging.getLogger(__name__)

Prompt = Union[str, list[str], None]
STATS_LOG_INTERVAL_S = 5.0  # the periodic engine log line (at INFO)
class RankDivergence(RuntimeError):
    """Tensor-parallel ranks scheduled different batches."""


HEARTBEAT_S = 0.5  # an idle rank 0 steps this often under TP (well inside any collective timeout)


def resolve_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def kv_pool_tokens(args: ServerArgs, bytes_per_token: int) -> int:
    if args.max_total_tokens is not None:
        return args.max_total_tokens
    if args.device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
        budget = free * args.mem_fraction_static
    else:
        budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * args.mem_fraction_static
    return max(16, int(budget // bytes_per_token))


class Engine:
    """Offline engine: `Engine(model_path=None, **server_args).generate(prompt, sampling_params=...)`.

    With `tp_size > 1` this object is rank 0 of an SPMD group: it spawns the other ranks, and every
    step starts with rank 0 broadcasting the commands (new requests, aborts) that all ranks apply
    before scheduling identically.
    """

    def __init__(self, model_path: Optional[str] = None, **kwargs: Any):
        args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        self._workers: list = []
        dist_cfg = None
        if args.tp_size > 1:
            from specserve.distributed.launch import rendezvous_addr, spawn_local_workers

            addr = rendezvous_addr(args)
            self._workers = spawn_local_workers(args, addr, skip_rank0=True)
            dist_cfg = DistConfig(0, args.tp_size, addr, args.collective_timeout, args.device)
        try:
            self._build(args, dist_cfg)
        except BaseException:
            self._stop_workers(timeout_s=5)
            raise

    @classmethod
    def for_rank(cls, args: ServerArgs, dist_cfg: "DistConfig") -> "Engine":
        """The engine of one non-zero tensor-parallel rank (see specserve/distributed/launch.py)."""
        engine = cls.__new__(cls)
        engine._workers = []
        engine._build(args, dist_cfg)
        return engine

    def _build(self, args: ServerArgs, dist_cfg: Optional["DistConfig"]) -> None:
        self.args = args
        logging.basicConfig(level=self.args.log_level.upper())
        if self.args.num_threads:
            torch.set_num_threads(self.args.num_threads)
        self.dist = TPGroup(dist_cfg) if dist_cfg is not None else None
        self.tp_rank = dist_cfg.rank if dist_cfg is not None else 0
        tp = TPContext(self.tp_rank, args.tp_size, self.dist)
        path = resolve_model_path(self.args.model_path)
        loaded = load_model(path)
        self.model_config = cfg = loaded.config
        if self.args.tokenizer_path:
            self.tokenizer: Tokenizer = load_tokenizer(self.args.tokenizer_path)
        else:
            self.tokenizer = load_tokenizer(path, loaded.gguf_reader)
        self.context_length = min(self.args.context_length or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.dtype = resolve_dtype(self.args.dtype)
        device = self.args.device
        # A verify window may reach gamma positions past the last token that can be emitted.
        max_positions = self.context_length + MAX_DRAFT_TOKENS + 1
        model = LlamaForCausalLM(cfg, self.dtype, tp=tp, max_positions=max_positions).to(device)
        model.load_weights(loaded.weights, loaded.q4 if self.args.quantization == "auto" else None)
        if not self.args.enable_torch_compile:  # inductor packs weights itself and cannot trace ours
            model.pack_for_cpu()
        model.eval()
        # The drafter is replicated on every rank: it is small, its context (the target's captured
        # hidden states) is full-width on every rank after the row-parallel all-reduces, and its
        # embedding and LM head are the target's parallel ones, so ranks draft identically. A
        # reduced draft vocabulary takes its rows from the full (unsharded) head weight.
        full_head = loaded.weights.get("lm_head.weight", loaded.weights["model.embed_tokens.weight"])
        del loaded
        drafter = self._load_drafter(model, max_positions, full_head)
        del full_head
        gamma = self._block_size(drafter)
        draft_layers = drafter.config.num_layers if drafter is not None else 0
        local_kv_heads = model.layers[0].self_attn.num_kv_heads
        per_token = (KVPool.bytes_per_token(cfg.num_layers, local_kv_heads, cfg.head_dim, self.dtype)
                     + (KVPool.bytes_per_token(draft_layers, drafter.config.num_kv_heads, drafter.config.head_dim,
                                               self.dtype) if drafter is not None else 0))
        size = kv_pool_tokens(self.args, per_token)
        if self.dist is not None:  # every rank must schedule against the same pool size
            size = int(self.dist.all_reduce_(torch.tensor([size]), "engine.kv_pool_size", op="min")[0])
        self.kv = KVPool(size, cfg.num_layers, local_kv_heads, cfg.head_dim, self.dtype, device)
        self.allocator = TokenSlotAllocator(size)
        self._make_streams()
        self.req_to_token = ReqToTokenPool(self.args.max_running_requests + 1, max_positions, device,
                                           stream=self.forward_stream)
        dspark = None
        if drafter is not None:  # the draft K/V share the target's token slots, so one allocator serves both
            draft_kv = KVPool(size, draft_layers, drafter.config.num_kv_heads, drafter.config.head_dim, self.dtype, device)
            dspark = DsparkParts(drafter, draft_kv, self._planner())
        self.tree = self._make_tree(size, [self.kv] + ([dspark.kv] if dspark else []))
        ngram = NgramDrafter(gamma) if self.args.speculative_algorithm == "NGRAM" else None
        self.runner = ModelRunner(model, self.kv, self.req_to_token, device, max_bs=self.args.max_running_requests,
                                  dspark=dspark, ngram=ngram, forward_stream=self.forward_stream,
                                  copy_stream=self.copy_stream, alias_accept_buffers=self.faults.alias_accept_buffers,
                                  capture=CaptureConfig(not self.args.disable_cuda_graph, self.args.cuda_graph_max_bs,
                                                        self.args.enable_torch_compile),
                                  tp_group=self.dist)
        sched_cfg = SchedulerConfig(
            context_length=self.context_length,
            eos_token_ids=self.tokenizer.eos_token_ids,
            max_running_requests=self.args.max_running_requests,
            max_prefill_tokens=self.args.max_prefill_tokens,
            chunked_prefill_size=self.args.chunked_prefill_size,
            schedule_policy=self.args.schedule_policy,
            num_draft_tokens=gamma,
            speculative_disable_batch_size=self.args.speculative_disable_batch_size,
        )
        self.scheduler = Scheduler(sched_cfg, self.runner, self.allocator, self.req_to_token, self.tree,
                                   decode_text=self.tokenizer.decode)
        self.consensus = RankConsensusChecker.from_env(self.dist)
        self.scheduler.consensus = self.tree.consensus = self.consensus
        if self.dist is not None:
            self.runner.before_launch = self._agree_on_batch_shape
        loop = NormalLoop if self.args.disable_overlap_schedule else OverlapLoop
        self.loop = loop(self.scheduler, self.runner)
        self._seed_rng = random.Random(self.args.random_seed)
        self._last_log = time.monotonic()
        self._pending: list[tuple] = []  # commands for the next step (broadcast first under TP)
        self._step_lock = threading.RLock()
        self._last_step = time.monotonic()
        self._closed = False
        if self.dist is not None and self.tp_rank == 0:
            threading.Thread(target=self._heartbeat, name="tp-heartbeat", daemon=True).start()
        logger.info("engine ready (rank %d/%d): %s, %s, KV pool %d tokens", self.tp_rank, args.tp_size, path,
                    self.dtype, size)

    def _make_tree(self, size: int, device_pools: list[KVPool]) -> RadixCache:
        """The radix cache, or with --enable-hierarchical-cache its host (and file) tiers too."""
        args = self.args
        if not args.enable_hierarchical_cache:
            return RadixCache(self.allocator.free, disabled=args.disable_radix_cache)
        from specserve.kv.hicache import FileKVStorage, HiRadixCache, HostKVPool

        host = HostKVPool(device_pools, args.hicache_size or max(16, int(size * args.hicache_ratio)),
                          self.forward_stream, self.copy_stream)
        storage = FileKVStorage(args.hicache_storage_dir, self.tp_rank) if args.hicache_storage_backend else None

        def agree_min(value: int, site: str) -> int:
            if self.dist is None:
                return value
            return int(self.dist.all_reduce_(torch.tensor([value]), site, op="min")[0])

        # Loading back needs device slots, which the scheduler finds (evicting) once it exists.
        return HiRadixCache(self.allocator.free, lambda n: self.scheduler.alloc_slots(n), host,
                            args.hicache_write_policy, storage, agree_min)

    def _load_drafter(self, model: LlamaForCausalLM, max_positions: int,
                      full_head: torch.Tensor) -> Optional[DsparkDrafter]:
        if self.args.speculative_algorithm != "DSPARK":
            return None
        drafter = load_drafter(self.args.speculative_draft_model_path, self.model_config, self.dtype,
                               self.args.device, max_positions, self.args.speculative_dspark_block_size)
        head = model.lm_head
        if drafter.reduced_vocab and self.args.tp_size > 1:  # this rank's head holds only its vocab shard
            head = DraftVocabHead(full_head.to(device=self.args.device, dtype=self.dtype))
        drafter.attach_target(model.embed_tokens, head)
        return drafter

    def _block_size(self, drafter: Optional[DsparkDrafter]) -> int:
        """gamma: 0 without speculation; the flag, else the drafter checkpoint's, else 5."""
        if not self.args.speculating:
            return 0
        if drafter is not None:
            return drafter.block_size
        return self.args.speculative_dspark_block_size or DEFAULT_BLOCK_SIZE

    def _planner(self) -> Optional[VerifyPlanner]:
        if self.args.verify_mode() == "static":
            return None
        path = self.args.speculative_dspark_sps_table_path
        return VerifyPlanner(SpsTable.load(path) if path else None)

    # ------------------------------------------------------------ API

    def generate(self, prompt: Prompt = None, input_ids: Optional[list] = None,
                 sampling_params: Union[dict, list[dict], None] = None) -> Union[dict, list[dict]]:
        """Generate for one prompt (returns a dict) or a batch (returns a list of dicts)."""
        single, token_lists = self._normalize_inputs(prompt, input_ids)
        params = self._normalize_params(sampling_params, len(token_lists))
        reqs = [self._make_req(ids, sp) for ids, sp in zip(token_lists, params)]
        for req in reqs:  # validate everything before queueing anything
            self.scheduler.validate_request(req)
        self._pending += [("add", req) for req in reqs]
        done: set[str] = set()
        with self._sanitized():
            while len(done) < len(reqs):
                result = self.step()
                done.update(req.rid for req in result.finished)
                if not self.has_work() and len(done) < len(reqs):
                    raise RuntimeError("engine: scheduler idle with unfinished requests")
            self._pending.append(("drain", None))  # the overlap loop's last step, on every rank
            self.step()
        outputs = [self._output(r) for r in reqs]
        return outputs[0] if single else outputs

    # ------------------------------------------------------------ serving: one step at a time

    def submit(self, input_ids: list[int], sampling_params: Optional[dict], rid: Optional[str] = None) -> Req:
        """Validate and queue one request for the next step (ValueError names the bad field)."""
        _, [ids] = self._normalize_inputs(None, input_ids)
        req = self._make_req(ids, self._normalize_params(sampling_params, 1)[0])
        if rid is not None:
            req.rid = rid
        self.scheduler.validate_request(req)
        self._pending.append(("add", req))
        return req

    def abort(self, rid: str) -> None:
        """Stop a request at the next step; it then comes back in that step's `finished`."""
        self._pending.append(("abort", rid))

    def step(self) -> StepResult:
        """Apply the pending commands (on every rank), then run one loop step if there is work."""
        with self._step_lock:
            result = StepResult()
            commands, self._pending = self._pending, []
            if self.dist is not None:
                commands = self.dist.broadcast_object(commands, "engine.commands")
            for command in commands:
                self._apply(command, result)
            if self.loop.has_work():
                try:
                    more = self.loop.step()
                except Exception:
                    if self.consensus is not None:  # name the first divergent site, not the broken collective
                        self.consensus.flush()
                    raise
                result.tokens += more.tokens
                result.finished += more.finished
            self._last_step = time.monotonic()
        self._maybe_log_stats()
        return result

    def _agree_on_batch_shape(self, batch) -> None:
        """TP: one small all-reduce before each step's forward. Divergent ranks would otherwise
        reach the model's collectives with different shapes, which gloo answers by aborting the
        process; here they stop with the checker's report (or a named error without it)."""
        rows, tokens = len(batch.reqs), sum(batch.extend_lens)
        shape = torch.tensor([rows, tokens, -rows, -tokens])
        self.dist.all_reduce_(shape, "engine.batch_shape", op="min")
        if int(shape[0]) != -int(shape[2]) or int(shape[1]) != -int(shape[3]):
            if self.consensus is not None:
                self.consensus.flush()  # reports the divergent events and exits
            raise RankDivergence(f"rank divergence at site 'engine.batch_shape' on rank {self.tp_rank}: this rank "
                                 f"scheduled {rows} requests / {tokens} tokens, the ranks range over requests "
                                 f"{int(shape[0])}..{-int(shape[2])} and tokens {int(shape[1])}..{-int(shape[3])}")

    def _apply(self, command: tuple, result: StepResult) -> None:
        kind, arg = command
        if kind == "add":
            early = self.scheduler.add_request(arg)
            if early is not None:
                result.finished.append(early)
        elif kind == "abort":
            req = self.scheduler.abort(arg)
            if req is not None:
                result.finished.append(req)
        elif kind == "drain":
            self.loop.drain()
        elif kind == "shutdown":
            self._closed = True
            if self.consensus is not None:  # a last comparison of everything recorded, then stop
                self.consensus.flush()
                self.consensus.stop()

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
                if self.loop.has_work() or self._pending or self._closed:
                    continue
                try:
                    self.step()
                except Exception:  # the engine is failing; the caller's own step reports it
                    return

    def has_work(self) -> bool:
        return bool(self._pending) or self.loop.has_work()

    def sanitized(self):
        """The stream sanitizer's scope when STREAM_SANITIZER is set, else a no-op context."""
        return self._sanitized()

    def load(self) -> dict[str, int]:
        """Queue, batch and KV occupancy: slots held by requests vs by the prefix cache."""
        sched = self.scheduler
        cached = self.tree.total_size
        free = self.allocator.available
        return {"waiting": len(sched.waiting), "running": len(sched.running) + (sched.chunked_req is not None),
                "kv_total_tokens": self.allocator.size, "kv_free_tokens": free, "kv_cached_tokens": cached,
                "kv_request_tokens": self.allocator.size - free - cached}

    def output(self, req: Req) -> dict[str, Any]:
        """The output dict of a (finished) request, as `generate` returns it."""
        return self._output(req)

    def _make_streams(self) -> None:
        """Forward and copy streams. On CPU they run inline (no worker threads, no cost) unless a
        fault delay needs real concurrency; see specserve/runtime/stream.py."""
        self.faults = FaultConfig.from_env(rank=self.tp_rank)
        self.sanitizer = StreamSanitizer() if envs.env_flag(envs.STREAM_SANITIZER) else None
        threaded = self.faults.needs_threads
        self.forward_stream = Stream("forward", self.args.device, threaded, self.faults.delay_for("forward"),
                                     self.sanitizer)
        self.copy_stream = Stream("copy", self.args.device, threaded, self.faults.delay_for("copy"), self.sanitizer)

    def _sanitized(self):
        return self.sanitizer.active() if self.sanitizer is not None else contextlib.nullcontext()

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_log >= STATS_LOG_INTERVAL_S and logger.isEnabledFor(logging.INFO):
            self._last_log = now
            sched = self.scheduler
            logger.info("%s", sched.stats.log_line(len(sched.running), len(sched.waiting)))

    def shutdown(self) -> None:
        """Stop this engine; rank 0 also tells the other ranks to stop and waits for them."""
        if getattr(self, "runner", None) is None:
            self._stop_workers(timeout_s=5)
            return
        if self.dist is not None and self.tp_rank == 0 and not self._closed:
            try:
                self._pending.append(("shutdown", None))
                self.step()
            except Exception as exc:  # a rank is already gone: nothing to tell it
                logger.warning("tensor-parallel shutdown: %s", exc)
        self._closed = True
        self.runner.close()
        self._stop_workers(timeout_s=30)
        if self.dist is not None:
            self.dist.close()
        self.scheduler = None
        self.runner = None
        self.kv = None

    def _stop_workers(self, timeout_s: float) -> None:
        for proc in self._workers:
            proc.join(timeout_s)
            if proc.is_alive():
                logger.error("tensor-parallel rank process %s did not exit; killing it", proc.pid)
                proc.kill()
                proc.join(5)
        self._workers = []

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------ helpers

    def _normalize_inputs(self, prompt: Prompt, input_ids: Optional[list]) -> tuple[bool, list[list[int]]]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("prompt/input_ids: give exactly one of them")
        if prompt is not None:
            single = isinstance(prompt, str)
            texts = [prompt] if single else prompt
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt: must be a string or a non-empty list of strings")
            if any(t == "" for t in texts):
                raise ValueError("prompt: must not be empty")
            return single, [self.tokenizer.encode(t) for t in texts]
        single = bool(input_ids) and all(isinstance(t, int) for t in input_ids)
        lists = [input_ids] if single else input_ids
        if not isinstance(lists, list) or not lists:
            raise ValueError("input_ids: must be a list of token ids or a non-empty list of such lists")
        vocab = self.model_config.vocab_size
        for ids in lists:
            if not isinstance(ids, list) or not ids:
                raise ValueError("input_ids: every prompt must be a non-empty list of token ids")
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
                raise ValueError(f"input_ids: token ids must be integers in [0, {vocab})")
        return single, [list(ids) for ids in lists]

    def _normalize_params(self, sampling_params, n: int) -> list[SamplingParams]:
        if isinstance(sampling_params, list):
            if len(sampling_params) != n:
                raise ValueError(f"sampling_params: list of {len(sampling_params)} for {n} prompts")
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params) for _ in range(n)]
        for p in params:
            p.validate(self.model_config.vocab_size)
        return params

    def _make_req(self, ids: list[int], params: SamplingParams) -> Req:
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        return Req(rid=uuid.uuid4().hex, input_ids=ids, params=params, seed=seed)

    def _output(self, req: Req) -> dict[str, Any]:
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=req.params.skip_special_tokens)
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
            },
        }


def _finish_reason(req: Req) -> dict[str, Any]:
    out: dict[str, Any] = {"type": req.finish_reason.value if req.finish_reason else None}
    if req.matched_stop is not None:
        out["matched"] = req.matched_stop
    return out


def _spec_info(req: Req) -> dict[str, Any]:
    if req.spec_verify_ct == 0:
        return {}
    return {
        "spec_verify_ct": req.spec_verify_ct,
        "spec_num_correct_drafts": req.spec_num_correct_drafts,
        "spec_accept_length": len(req.output_ids) / req.spec_verify_ct,
        "spec_correct_drafts_histogram": dict(sorted(req.spec_correct_hist.items())),
        "spec_cap_trim_histogram": dict(sorted(req.spec_cap_trim_hist.items())),
    }
