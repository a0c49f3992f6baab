"""Engine: offline generation on one process (scheduler, model runner and KV cache together)."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
import uuid
from typing import Any, Optional, Union

import torch

from specserve import envs
from specserve.args import DEFAULT_BLOCK_SIZE, MAX_DRAFT_TOKENS, ServerArgs
from specserve.io.tokenizer import Tokenizer, load_tokenizer
from specserve.kv.pool import KVPool, ReqToTokenPool, TokenSlotAllocator
from specserve.kv.radix_cache import RadixCache
from specserve.models.llama import LlamaForCausalLM
from specserve.models.loader import load_model, resolve_model_path
from specserve.models.dspark import DsparkDrafter, load_drafter
from specserve.models.model_runner import CaptureConfig, DsparkParts, ModelRunner
from specserve.sampling_params import SamplingParams
from specserve.runtime.faults import FaultConfig
from specserve.runtime.sanitizer import StreamSanitizer
from specserve.runtime.stream import Stream
from specserve.scheduler.loops import NormalLoop, OverlapLoop
from specserve.scheduler.req import Req
from specserve.scheduler.scheduler import Scheduler, SchedulerConfig
from specserve.spec.ngram import NgramDrafter
from specserve.spec.planner import SpsTable, VerifyPlanner

logger = logging.getLogger(__name__)

Prompt = Union[str, list[str], None]
STATS_LOG_INTERVAL_S = 5.0  # the periodic engine log line (at INFO)


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
    """Offline engine: `Engine(model_path=None, **server_args).generate(prompt, sampling_params=...)`."""

    def __init__(self, model_path: Optional[str] = None, **kwargs: Any):
        self.args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        logging.basicConfig(level=self.args.log_level.upper())
        if self.args.num_threads:
            torch.set_num_threads(self.args.num_threads)
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
        model = LlamaForCausalLM(cfg, self.dtype, max_positions=max_positions).to(device)
        model.load_weights(loaded.weights, loaded.q4 if self.args.quantization == "auto" else None)
        if not self.args.enable_torch_compile:  # inductor packs weights itself and cannot trace ours
            model.pack_for_cpu()
        model.eval()
        del loaded
        drafter = self._load_drafter(model, max_positions)
        gamma = self._block_size(drafter)
        draft_layers = drafter.config.num_layers if drafter is not None else 0
        per_token = KVPool.bytes_per_token(cfg.num_layers + draft_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        size = kv_pool_tokens(self.args, per_token)
        self.kv = KVPool(size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype, device)
        self.allocator = TokenSlotAllocator(size)
        self._make_streams()
        self.req_to_token = ReqToTokenPool(self.args.max_running_requests + 1, max_positions, device,
                                           stream=self.forward_stream)
        self.tree = RadixCache(self.allocator.free, disabled=self.args.disable_radix_cache)
        dspark = None
        if drafter is not None:  # the draft K/V share the target's token slots, so one allocator serves both
            draft_kv = KVPool(size, draft_layers, drafter.config.num_kv_heads, drafter.config.head_dim, self.dtype, device)
            dspark = DsparkParts(drafter, draft_kv, self._planner())
        ngram = NgramDrafter(gamma) if self.args.speculative_algorithm == "NGRAM" else None
        self.runner = ModelRunner(model, self.kv, self.req_to_token, device, max_bs=self.args.max_running_requests,
                                  dspark=dspark, ngram=ngram, forward_stream=self.forward_stream,
                                  copy_stream=self.copy_stream, alias_accept_buffers=self.faults.alias_accept_buffers,
                                  capture=CaptureConfig(not self.args.disable_cuda_graph, self.args.cuda_graph_max_bs,
                                                        self.args.enable_torch_compile))
        sched_cfg = SchedulerConfig(
            context_length=self.context_length,
            eos_token_ids=self.tokenizer.eos_token_ids,
            max_running_requests=self.args.max_running_requests,
            max_prefill_tokens=self.args.max_prefill_tokens,
            chunked_prefill_size=self.args.chunked_prefill_size,
            schedule_policy=self.args.schedule_policy,
            num_draft_tokens=gamma,
        )
        self.scheduler = Scheduler(sched_cfg, self.runner, self.allocator, self.req_to_token, self.tree,
                                   decode_text=self.tokenizer.decode)
        loop = NormalLoop if self.args.disable_overlap_schedule else OverlapLoop
        self.loop = loop(self.scheduler, self.runner)
        self._seed_rng = random.Random(self.args.random_seed)
        self._last_log = time.monotonic()
        logger.info("engine ready: %s, %s, KV pool %d tokens", path, self.dtype, size)

    def _load_drafter(self, model: LlamaForCausalLM, max_positions: int) -> Optional[DsparkDrafter]:
        if self.args.speculative_algorithm != "DSPARK":
            return None
        drafter = load_drafter(self.args.speculative_draft_model_path, self.model_config, self.dtype,
                               self.args.device, max_positions, self.args.speculative_dspark_block_size)
        drafter.attach_target(model.embed_tokens, model.lm_head)
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
        done: dict[str, Req] = {}
        for req in reqs:
            early = self.scheduler.add_request(req)
            if early is not None:
                done[req.rid] = early
        with self._sanitized():
            while len(done) < len(reqs):
                result = self.loop.step()
                self._maybe_log_stats()
                for req in result.finished:
                    done[req.rid] = req
                if not self.loop.has_work() and len(done) < len(reqs):
                    raise RuntimeError("engine: scheduler idle with unfinished requests")
            self.loop.drain()  # the overlap loop's last step (for already finished requests)
        outputs = [self._output(r) for r in reqs]
        return outputs[0] if single else outputs

    # ------------------------------------------------------------ serving: one step at a time

    def submit(self, input_ids: list[int], sampling_params: Optional[dict], rid: Optional[str] = None) -> Req:
        """Validate and queue one request (ValueError names the bad field). The returned request
        is already finished when it needs no step (max_new_tokens 0)."""
        _, [ids] = self._normalize_inputs(None, input_ids)
        req = self._make_req(ids, self._normalize_params(sampling_params, 1)[0])
        if rid is not None:
            req.rid = rid
        self.scheduler.validate_request(req)
        self.scheduler.add_request(req)
        return req

    def abort(self, rid: str) -> Optional[Req]:
        return self.scheduler.abort(rid)

    def step(self):
        """One loop step (a StepResult); the caller runs it inside `sanitized()`."""
        result = self.loop.step()
        self._maybe_log_stats()
        return result

    def has_work(self) -> bool:
        return self.loop.has_work()

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
        self.faults = FaultConfig.from_env(rank=0)
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
        if self.runner is not None:
            self.runner.close()
        self.scheduler = None
        self.runner = None
        self.kv = None

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
