"""Building one rank of the engine: model, drafters, KV pools, prefix cache, executor, scheduler.

Everything a component needs is passed down when it is built; no component calls back into one
that was built after it.
"""

from __future__ import annotations

import functools
import gc
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from specserve import drafters, envs
from specserve.args import DEFAULT_BLOCK_SIZE, MAX_DRAFT_TOKENS, ServerArgs
from specserve.distributed.consensus import RankConsensusChecker
from specserve.distributed.group import DistConfig, TPGroup
from specserve.drafters import DraftModel
from specserve.engine.draft_model import drafter_memory
from specserve.engine.memory import DEFAULT_KV_FRACTION, KVRequest, cpu_kv_tokens, weights_bytes
from specserve.engine.prefix_cache import build_prefix_cache
from specserve.engine.start_cache import cost_prior, weight_cache
from specserve.executor.captured_step import CaptureConfig
from specserve.executor.faulty_runner import ModelRunner, make_runner
from specserve.executor.tp_decisions import TPDecisions
from specserve.kv.pool import KVPool, ReqToTokenPool, TokenSlotAllocator
from specserve.logits.grammar import GrammarCompiler
from specserve.models.backend import select_backend
from specserve.models.config import ModelConfig
from specserve.models.dspark import DraftVocabHead, DsparkDrafter
from specserve.models.dspark_checkpoint import load_drafter, read_drafter_config
from specserve.models.heap import release_free_heap
from specserve.models.layers import TPContext
from specserve.models.llama import LlamaAttention, LlamaForCausalLM
from specserve.models.loader import head_weight, load_model, resolve_model_path
from specserve.models.summary import model_summary
from specserve.runtime.faults import FaultConfig
from specserve.runtime.host_waits import HostWaitDetector
from specserve.runtime.sanitizer import StreamSanitizer
from specserve.runtime.stream import Stream
from specserve.scheduler.batching import SchedulerConfig
from specserve.scheduler.loops import NormalLoop, OverlapLoop
from specserve.scheduler.scheduler import Scheduler
from specserve.speculative.committed import TokenTable
from specserve.speculative.cost_model import StepCostModel
from specserve.speculative.planner import SpsTable, VerifyPlanner
from specserve.speculative.policy import AdaptivePolicy
from specserve.speculative.speculation import Speculation
from specserve.speculative.worker import DraftContext, DraftWorker
from specserve.tokenizer.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFacts:
    """What the loaded target is: the request checks, the start-up block and callers read it."""

    config: ModelConfig
    context_length: int
    dtype: torch.dtype
    summary: dict[str, Any]  # architecture, parameters, weight types (the start-up block)


@dataclass(frozen=True)
class EngineParts:
    """One rank's engine in its few parts, which `Engine` keeps as they are. The KV pool, the
    streams and the speculation are the runner's; the queues, the KV bookkeeping (allocator, table,
    prefix cache) and the consensus checker are the scheduler's."""

    model: ModelFacts
    tokenizer: Tokenizer  # and detokenizer: request outputs, the scheduler's stop strings
    runner: ModelRunner
    scheduler: Scheduler
    loop: NormalLoop | OverlapLoop  # steps the scheduler's batches on the runner
    group: Optional[TPGroup]  # this rank's tensor-parallel group (None on one rank)


def resolve_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def kv_pool_tokens(args: ServerArgs, req: KVRequest) -> int:
    """Token slots of this rank's KV pool; on CPU checked, with the model, against the free memory
    (engine/memory.py: a one-line ConfigError where they do not fit)."""
    if not args.device.startswith("cuda"):
        return cpu_kv_tokens(req, args.mem_fraction_static, args.max_total_tokens)
    if args.max_total_tokens is not None:
        return args.max_total_tokens
    free, _ = torch.cuda.mem_get_info()
    return max(16, int(free * (args.mem_fraction_static or DEFAULT_KV_FRACTION) // req.bytes_per_token))


@dataclass
class _Target:
    """The loaded target model (ready on its op backend) and what was read with it."""

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    dtype: torch.dtype
    context_length: int
    max_positions: int
    summary: dict[str, Any]
    drafter: Optional[DsparkDrafter]
    kv_tokens: int  # the KV pools' token slots (sized and checked before the weights were packed)
    path: str  # the model file or folder


def build_rank(args: ServerArgs, dist_cfg: Optional[DistConfig]) -> EngineParts:
    """Load the model and build every component of this rank (all ranks call this alike). Each
    component is complete when built: what it needs is built before it."""
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    dist = TPGroup(dist_cfg) if dist_cfg is not None else None
    tp_rank = dist_cfg.rank if dist_cfg is not None else 0
    target = _load_target(args, dist, tp_rank)
    return_freed_memory()  # the checkpoint's float copies are gone: give their pages back
    dtype, drafter = target.dtype, target.drafter
    gamma = _block_size(args, drafter)
    size = target.kv_tokens
    cfg, local_kv_heads = target.config, _local_kv_heads(target.model)
    kv = KVPool(size, cfg.num_layers, local_kv_heads, cfg.head_dim, dtype, args.device)
    allocator = TokenSlotAllocator(size)
    faults = FaultConfig.from_env(rank=tp_rank)
    sanitizer = StreamSanitizer() if envs.env_flag(envs.STREAM_SANITIZER) else None
    forward_stream, copy_stream = _make_streams(args, faults, sanitizer)
    req_to_token = ReqToTokenPool(args.max_running_requests + 1, target.max_positions, args.device, stream=forward_stream)
    workers = _make_workers(args, target, gamma, size, req_to_token)
    consensus = RankConsensusChecker.from_env(dist)
    pools = [kv] + [p for w in workers for p in w.kv_pools]
    tree = build_prefix_cache(args, size, allocator, pools, (forward_stream, copy_stream), dist, tp_rank, consensus)
    tokenizer = target.tokenizer
    tp = TPDecisions(dist, tp_rank, args.max_running_requests, consensus) if dist else None
    make_runner = _runner_factory(args, target, kv, req_to_token, (forward_stream, copy_stream), faults, tp)
    # The adaptive policy starts from step costs timed on a runner of the drafters alone.
    cost = _cost_model(args, target, lambda: make_runner(speculation=Speculation(workers)), gamma)
    runner = make_runner(speculation=_make_speculation(args, workers, drafter, gamma, cost, tokenizer.eos_token_ids))
    if target.model.weight_cache is not None:  # a first start's packed weights: written while it serves
        target.model.weight_cache.save_in_background()
    sched_cfg = _scheduler_config(args, target, gamma)
    scheduler = Scheduler(sched_cfg, allocator, req_to_token, tree, decode_text=tokenizer.decode, consensus=consensus)
    loop = (NormalLoop if args.disable_overlap_schedule else OverlapLoop)(scheduler, runner)
    return_freed_memory()  # and the warm-up's step buffers (the cost model timed steps of each shape)
    logger.debug("engine ready (rank %d/%d): %s, KV pool %d tokens", tp_rank, args.tp_size, dtype, size)
    facts = ModelFacts(cfg, target.context_length, dtype, target.summary)
    return EngineParts(model=facts, tokenizer=tokenizer, runner=runner, scheduler=scheduler, loop=loop, group=dist)


def _runner_factory(
    args: ServerArgs,
    target: _Target,
    kv: KVPool,
    req_to_token: ReqToTokenPool,
    streams: tuple[Stream, Stream],
    faults: FaultConfig,
    tp: Optional[TPDecisions],
) -> Callable[..., ModelRunner]:
    """ModelRunner with everything but its Speculation (the cost model's timing runner and the
    serving runner differ only there)."""
    tokenizer = target.tokenizer
    return functools.partial(
        make_runner,  # a FaultyRunner where a fault flag plants one
        target.model,
        kv,
        req_to_token,
        args.device,
        max_bs=args.max_running_requests,
        forward_stream=streams[0],
        copy_stream=streams[1],
        faults=faults,
        capture=CaptureConfig(_captures(args, target.config), args.cuda_graph_max_bs, args.enable_torch_compile),
        tp=tp,
        grammars=GrammarCompiler(tokenizer.backend.to_str, target.config.vocab_size, tokenizer.eos_token_ids),
        host_waits=HostWaitDetector.from_env(exempt=(streams[1],)),  # the copy stream's D2H is the allowed one
    )


def _captures(args: ServerArgs, cfg: ModelConfig) -> bool:
    """Whether decode and static verify run as captured steps: not with --disable-cuda-graph, and
    not a mixture of experts on CUDA (its experts are picked on the host from each step's routing,
    which a CUDA graph cannot replay; a CPU "replay" calls the step and routes anew)."""
    return not args.disable_cuda_graph and not (cfg.is_moe and args.device == "cuda")


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS. Loading frees many tensors of a few MB (each
    checkpoint tensor's float copy) that glibc keeps in its arenas once its mmap threshold has
    grown: about 0.8 GB of a 250 MB Gemma file's resident memory until trimmed (without glibc: a no-op)."""
    gc.collect()
    release_free_heap()


def _load_target(args: ServerArgs, dist: Optional[TPGroup], tp_rank: int) -> _Target:
    """The target on its op backend, its tokenizer and the drafter attached to it."""
    path = resolve_model_path(args.model_path)
    loaded = load_model(path)
    cfg = loaded.config
    reader = None if args.tokenizer_path else loaded.gguf_reader
    tokenizer = load_tokenizer(args.tokenizer_path or path, reader, args.chat_template)
    context_length = min(args.context_length or cfg.max_position_embeddings, cfg.max_position_embeddings)
    dtype = resolve_dtype(args.dtype)
    # A verify window may reach gamma positions past the last token that can be emitted.
    max_positions = context_length + MAX_DRAFT_TOKENS + 1
    tp = TPContext(tp_rank, args.tp_size, dist)
    model = LlamaForCausalLM(cfg, dtype, tp=tp, max_positions=max_positions, lazy_rope=args.device == "cpu")
    model = model.to(args.device)
    # Sized before packing: a model that cannot fit fails here, in one line, not in the OOM killer.
    kv_tokens = _kv_pool_size(args, cfg, _local_kv_heads(model), dtype, max_positions, path, dist)
    # Inductor packs weights itself and cannot trace specserve's kernels: torch.compile runs stock ops.
    int8, per_op = args.cpu_activations == "int8", envs.env_flag(envs.PER_OP_LAYERS)
    backend = select_backend(args.device, dtype, args.enable_torch_compile, int8, per_op)
    codes = loaded.quantized if args.quantization == "auto" else None
    model.load_weights(loaded.weights, codes, dense_quantized=not backend.packs_codes)
    model.use_backend(backend, weight_cache(args, path, codes, backend.packs_codes, tp, dtype))
    model.eval()
    summary = model_summary(loaded)
    # Drafters are replicated on every rank (models/dspark.py): a reduced draft vocabulary reads the whole head.
    drafter = _load_drafter(args, cfg, dtype, model, max_positions, functools.partial(head_weight, loaded.weights))
    del loaded  # the checkpoint's tensors go (the drafter read the head's, if it needed them)
    logger.debug("target loaded (rank %d/%d): %s, %s", tp_rank, args.tp_size, path, dtype)
    return _Target(model, cfg, tokenizer, dtype, context_length, max_positions, summary, drafter, kv_tokens, path)


def _kv_pool_size(
    args: ServerArgs,
    cfg: ModelConfig,
    local_kv_heads: int,
    dtype: torch.dtype,
    max_positions: int,
    path: str,
    dist: Optional[TPGroup],
) -> int:
    """Token slots of the KV pools (the target's and the drafter's share them), equal on every rank;
    the model's files and the pools checked against the free memory first."""
    draft_per_token, draft_bytes = drafter_memory(args, dtype)
    req = KVRequest(
        bytes_per_token=KVPool.bytes_per_token(cfg.num_layers, local_kv_heads, cfg.head_dim, dtype) + draft_per_token,
        max_useful_tokens=args.max_running_requests * max_positions,
        context_tokens=max_positions,
        model_bytes=weights_bytes(path) // args.tp_size + draft_bytes,  # each rank packs its shard; drafters whole
        ranks_on_host=args.tp_size // args.nnodes,
    )
    size = kv_pool_tokens(args, req)
    if dist is not None:  # every rank must schedule against the same pool size
        size = int(dist.all_reduce_(torch.tensor([size]), "engine.kv_pool_size", op="min")[0])
    return size


def _local_kv_heads(model: LlamaForCausalLM) -> int:
    """K/V heads this rank holds (its shard under tensor parallelism)."""
    attn = model.layers[0].self_attn
    assert isinstance(attn, LlamaAttention)
    return attn.num_kv_heads


def _scheduler_config(args: ServerArgs, target: _Target, gamma: int) -> SchedulerConfig:
    return SchedulerConfig(
        context_length=target.context_length,
        eos_token_ids=target.tokenizer.eos_token_ids,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
        schedule_policy=args.schedule_policy,
        num_draft_tokens=gamma,
    )


def _make_streams(args: ServerArgs, faults: FaultConfig, sanitizer: Optional[StreamSanitizer]) -> tuple[Stream, Stream]:
    """Forward and copy streams. On CPU they run inline (no worker threads, no cost) unless a
    fault delay needs real concurrency; see runtime/stream.py."""
    threaded = faults.needs_threads
    return (
        Stream("forward", args.device, threaded, faults.delay_for("forward"), sanitizer),
        Stream("copy", args.device, threaded, faults.delay_for("copy"), sanitizer),
    )


def _make_workers(
    args: ServerArgs, target: _Target, gamma: int, size: int, req_to_token: ReqToTokenPool
) -> list[DraftWorker]:
    """The drafters this engine runs, each made from its declaration (specserve/drafters/): the one
    --speculative-algorithm names, and under the adaptive policy those it chooses from. Draft K/V
    share the target's token slots, so one allocator serves all; the drafters that read the
    request tokens on the device share one table."""
    adaptive = args.speculating and args.speculative_policy == "adaptive"
    chosen = set(args.policy_drafters()) if adaptive else set()
    on = [drafters.get(name) for name in drafters.names() if name == args.speculative_algorithm or name in chosen]
    table = req_to_token.table
    tokens = TokenTable.like(table) if any(d.needs_token_table for d in on) else None
    ctx = DraftContext(args, gamma, size, target.dtype, args.device, table, tokens, target, _captures(args, target.config))
    return [d.make_worker(ctx) for d in on]


def _make_speculation(
    args: ServerArgs,
    workers: list[DraftWorker],
    drafter: Optional[DsparkDrafter],
    gamma: int,
    cost: Optional[StepCostModel],
    eos_token_ids: tuple[int, ...],
) -> Speculation:
    """What decides each request's window: the adaptive policy (with its cost model), else each
    request's drafter with every draft, verified whole or by the compact planner."""
    planner, policy = None, None
    if cost is not None:
        policy = AdaptivePolicy(
            args.policy_drafters(),
            gamma,
            cost,
            eos_token_ids,
            args.speculative_explore_interval,
            args.speculative_min_gain,
            closed_batch_pricing=not args.speculative_disable_closed_batch_pricing,
        )
    elif drafter is not None and args.verify_mode() != "static":
        planner = VerifyPlanner(SpsTable.load(p) if (p := args.speculative_sps_table_path) else None)
    # Lagged plans stay opt-in (--speculative-lagged-plans): see docs/speculative-decoding.md.
    return Speculation(workers, planner, policy, args.speculative_disable_batch_size, args.speculative_lagged_plans)


def _cost_model(
    args: ServerArgs, target: _Target, timing_runner: Callable[[], ModelRunner], gamma: int
) -> Optional[StepCostModel]:
    """The adaptive policy's step-cost model (None without the policy): from the given table, else
    the prior an earlier start with the same key recorded (engine/start_cache.py), else
    timed by a warm-up on `timing_runner()`."""
    if not (args.speculating and args.speculative_policy == "adaptive"):
        return None
    if args.speculative_cost_table_path:
        cost = StepCostModel.load(args.speculative_cost_table_path)
    else:
        prior = cost_prior(args, target.path, timing_runner, gamma)
        if args.speculative_sps_table_path:  # a recorded SPS table gives the target's part
            sps = SpsTable.load(args.speculative_sps_table_path)
            prior[:3] = StepCostModel.from_sps(sps.tokens, sps.steps_per_second).theta.tolist()[:3]
        cost = StepCostModel(prior)
    if args.speculative_freeze_cost_table:
        cost.freeze()
    logger.debug("speculation cost model (s): %s", {k: round(v, 6) for k, v in cost.coefficients().items()})
    return cost


def _load_drafter(
    args: ServerArgs,
    cfg: ModelConfig,
    dtype: torch.dtype,
    model: LlamaForCausalLM,
    max_positions: int,
    full_head: Callable[[], torch.Tensor],
) -> Optional[DsparkDrafter]:
    declared = drafters.of(args.speculative_algorithm)
    if declared is None or declared.draft_model_kind is not DraftModel.CHECKPOINT:
        return None
    path = args.speculative_draft_model_path
    assert path is not None, "args validation: DSPARK resolves its drafter's path"
    head: Callable[[torch.Tensor], torch.Tensor] = model.lm_head
    if args.tp_size > 1 and read_drafter_config(path).draft_vocab_size is not None:
        head = DraftVocabHead(full_head().to(device=args.device, dtype=dtype))  # this rank's head: only its shard
    return load_drafter(
        path,
        cfg,
        dtype,
        args.device,
        max_positions,
        args.speculative_num_steps,
        embed=model.embed_tokens,
        lm_head=head,
        q8_weights=args.speculative_draft_weights == "q8",
        per_op_layers=envs.env_flag(envs.PER_OP_LAYERS),
    )


def _block_size(args: ServerArgs, drafter: Optional[DsparkDrafter]) -> int:
    """gamma: 0 without speculation; the flag, else the drafter checkpoint's, else 5."""
    if not args.speculating:
        return 0
    if drafter is not None:
        return drafter.block_size
    return args.speculative_num_steps or DEFAULT_BLOCK_SIZE
