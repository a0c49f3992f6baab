"""The drafting models' share of a rank: STANDALONE's draft model, loaded beside the target and
checked against its vocabulary, and what either model drafter adds to the memory budget.

A draft model is replicated on every tensor-parallel rank (it is small, and every rank must draft
the same windows), runs on the target's op backend (the same kernels, its decode steps captured
where the target's are) and keeps its K/V at the target's token slots.
"""

from __future__ import annotations

import logging

import torch

from specserve import drafters, envs
from specserve.args import ServerArgs
from specserve.drafters import DraftModel
from specserve.engine.memory import weights_bytes
from specserve.errors import ConfigError
from specserve.executor.captured_step import CapturedStep
from specserve.kv.pool import KVPool
from specserve.models.backend import select_backend
from specserve.models.dspark_checkpoint import read_drafter_config
from specserve.models.llama import LlamaForCausalLM
from specserve.models.loader import load_model, load_model_config, resolve_model_path
from specserve.speculative.standalone_worker import StandaloneWorker
from specserve.speculative.worker import DraftContext
from specserve.tokenizer.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


def drafter_memory(args: ServerArgs, dtype: torch.dtype) -> tuple[int, int]:
    """(K/V bytes per token slot, weight bytes on each rank) the model drafter adds; (0, 0) without one."""
    path = args.speculative_draft_model_path
    declared = drafters.of(args.speculative_algorithm)
    kind = declared.draft_model_kind if declared is not None else None
    if not path or kind is None:
        return 0, 0
    if kind is DraftModel.CHECKPOINT:
        dc = read_drafter_config(path)
        return KVPool.bytes_per_token(dc.num_layers, dc.num_kv_heads, dc.head_dim, dtype), weights_bytes(path)
    path = resolve_model_path(path)
    cfg = load_model_config(path)
    return KVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype), weights_bytes(path)


def check_same_vocabulary(target: Tokenizer, draft: Tokenizer, path: str) -> None:
    """A draft model must spell every id the two share as the target does (its drafts are target
    ids); one line naming the first difference otherwise."""
    for token_id in range(min(target.vocab_size, draft.vocab_size)):
        theirs, ours = draft.id_to_token(token_id), target.id_to_token(token_id)
        if theirs != ours:
            raise ConfigError(
                f"speculative_draft_model_path: {path!r} has another vocabulary than the target "
                f"(token {token_id} is {theirs!r} there, {ours!r} in the target)"
            )


def load_draft_model(args: ServerArgs, target: Tokenizer, dtype: torch.dtype, max_positions: int) -> LlamaForCausalLM:
    """STANDALONE's draft model on the target's op backend, after its vocabulary check."""
    assert args.speculative_draft_model_path, "args validation: STANDALONE names its draft model"
    path = resolve_model_path(args.speculative_draft_model_path)
    loaded = load_model(path)
    check_same_vocabulary(target, load_tokenizer(path, loaded.gguf_reader), path)
    model = LlamaForCausalLM(loaded.config, dtype, max_positions=max_positions, lazy_rope=args.device == "cpu")
    model = model.to(args.device)
    int8, per_op = args.cpu_activations == "int8", envs.env_flag(envs.PER_OP_LAYERS)
    backend = select_backend(args.device, dtype, args.enable_torch_compile, int8, per_op)
    codes = loaded.quantized if args.quantization == "auto" else None
    model.load_weights(loaded.weights, codes, dense_quantized=not backend.packs_codes)
    model.use_backend(backend)  # packed at every start: a draft model is small
    model.eval()
    logger.debug("draft model loaded: %s", path)
    return model


def standalone_worker(ctx: DraftContext) -> StandaloneWorker:
    """The STANDALONE drafter: its model, its K/V pool over the target's `size` token slots and,
    where the target's decode steps are captured, its own captured decode step."""
    args, target = ctx.args, ctx.target
    model = load_draft_model(args, target.tokenizer, ctx.dtype, target.max_positions)
    cfg = model.config
    kv = KVPool(ctx.size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, ctx.dtype, args.device)
    steps = None
    if ctx.captures:
        max_bs = min(args.cuda_graph_max_bs, args.max_running_requests)
        steps = CapturedStep(model, kv, ctx.req_to_token, 1, max_bs, use_cuda_graph=args.device == "cuda")
    return StandaloneWorker(model, kv, ctx.req_to_token, target.config.vocab_size, steps)
