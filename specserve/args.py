"""ServerArgs: the single source of CLI flags, Engine keywords and their defaults."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from specserve import drafters, envs
from specserve.args_checks import (
    CPU_ACTIVATIONS,
    DTYPES,
    SCHEDULE_POLICIES,
    SPEC_ALGORITHMS,
    SPEC_POLICIES,
    SUFFIX_SCOPES,
    VERIFY_MODES,
    validate_server_args,
)
from specserve.args_checks import DEFAULT_BLOCK_SIZE as DEFAULT_BLOCK_SIZE  # re-exported: engine/builder.py
from specserve.args_checks import MAX_DRAFT_TOKENS as MAX_DRAFT_TOKENS
from specserve.errors import ConfigError
from specserve.names import Algorithm, SuffixScope

logger = logging.getLogger(__name__)

# Flags renamed by purpose (issue 71), old -> new: the old one still works and logs a deprecation line.
# (The draft length's old spelling, --speculative-dspark-block-size, is one of DRAFT_LENGTH_FLAGS.)
RENAMED_FLAGS = {
    "speculative_dspark_verify_mode": "speculative_verify_mode",
    "speculative_dspark_sps_table_path": "speculative_sps_table_path",
}

VERIFY_MODE_ENV = "SPECSERVE_VERIFY_MODE"
VERIFY_CHOICES = (None,) + VERIFY_MODES  # the verify-mode flags' choices (None: the environment's, else static)
OLD_VERIFY_MODE_ENV = "SPECSERVE_RAGGED_VERIFY_MODE"  # its name before issue 71: still read, with a deprecation line
DEFAULT_STORAGE_MAX_BYTES = 4 << 30
DEFAULT_WEIGHT_CACHE_MAX_GIB = 64.0  # fixed, not a disk share: one cap on every machine; a 70B at Q4 or several 7-8B


def flag(default: Any, help: str, **metadata: Any) -> Any:
    """A ServerArgs field: its default, the CLI help and the rest of its argparse metadata (choices)."""
    return field(default=default, metadata={"help": help, **metadata})


@dataclass(frozen=True)
class ServerArgs:
    """Every engine setting. CLI flag `--foo-bar` is field `foo_bar`; Engine keywords use the same names."""

    model_path: Optional[str] = flag(None, "GGUF file or HF llama/qwen2 directory (default: the embedded SmolLM2-135M)")
    tokenizer_path: Optional[str] = flag(None, "tokenizer.json directory or GGUF file (default: from the model)")
    chat_template: Optional[str] = flag(None, "Jinja chat template file, in place of the model's own (or for one without)")
    dtype: str = flag("auto", "float32 | bfloat16 | auto (bfloat16 on CPU)", choices=DTYPES)
    quantization: str = flag(
        "auto",
        "auto: serve GGUF Q4_0/Q4_1 weights as 4-bit on CPU in bfloat16; none: dequantize to --dtype",
        choices=("auto", "none"),
    )
    weight_cache: str = flag("auto", "packed weights (and the cost prior) kept for the next start: auto, off or a folder")
    weight_cache_max_gib: Optional[float] = flag(
        None,
        "GiB the weight cache keeps over all models and TP ranks, least recently used evicted first (default: "
        f"${envs.WEIGHT_CACHE_MAX_GIB}, else {DEFAULT_WEIGHT_CACHE_MAX_GIB:g}: a fixed size, alike on every disk)",
    )
    cpu_activations: str = flag(
        "auto",
        "activations of the CPU kernels' quantized linears: int8 (rows quantized per 32 columns, integer dot products, "
        "as llama.cpp computes), bf16 (exact: within bf16 rounding of fp32), or auto: int8 for quantized weights on "
        "CPU, bf16 for float weights and off the CPU (models/activations.py)",
        choices=CPU_ACTIVATIONS,
    )
    device: str = flag("cpu", "cpu or cuda")
    context_length: Optional[int] = flag(None, "override the model's context window")
    mem_fraction_static: Optional[float] = flag(None, "KV pool's share of RAM (default: what the model leaves, at most 0.1)")
    max_total_tokens: Optional[int] = flag(None, "KV pool size in tokens (overrides --mem-fraction-static)")
    max_running_requests: int = flag(64, "most requests decoding at once")
    chunked_prefill_size: int = flag(2048, "most prompt tokens in one prefill step; <=0 disables chunking")
    max_prefill_tokens: int = flag(8192, "most new tokens admitted into one prefill batch")
    schedule_policy: str = flag("fcfs", "order of the waiting queue", choices=SCHEDULE_POLICIES)
    disable_radix_cache: bool = flag(False, "turn prefix sharing off")
    speculative_algorithm: Optional[str] = flag(
        None,
        "DSPARK (block drafter; the embedded model's default, with its shipped drafter), NGRAM (prompt "
        "lookup; the default for any other model, beside SUFFIX), SUFFIX (suffix matches over the request and "
        "past outputs), STANDALONE (a draft model) or NONE (no speculation)",
        choices=SPEC_ALGORITHMS,
    )
    speculative_num_steps: Optional[int] = flag(
        None,
        "drafts per window, every drafter's (gamma); the verify window is gamma + 1 tokens (default: the DSpark "
        "drafter checkpoint's, else 5)",
    )
    speculative_num_draft_tokens: Optional[int] = flag(
        None, "SGLang's count of a window's tokens, the anchor included: --speculative-num-steps + 1 (give either)"
    )
    speculative_dspark_block_size: Optional[int] = flag(None, "deprecated: --speculative-num-steps (the same count)")
    speculative_draft_model_path: Optional[str] = flag(
        None,
        "DSPARK: the drafter directory (config.json + model.safetensors, from `specserve train-drafter`; default "
        "for the embedded model: the shipped one); STANDALONE: a model (GGUF) with the target's vocabulary",
    )
    speculative_draft_weights: str = flag(
        "q8", "the DSpark drafter's linears and reduced head on CPU: q8 (ggml Q8_0 codes), or bf16", choices=("bf16", "q8")
    )
    speculative_verify_mode: Optional[str] = flag(
        None,
        "with --speculative-policy fixed: static verifies every window row; compact: per-request verify "
        "lengths from the budget planner, for a drafter that estimates its drafts' survival (DSPARK) "
        f"(default: ${VERIFY_MODE_ENV}, else static)",
        choices=VERIFY_CHOICES,
    )
    speculative_dspark_verify_mode: Optional[str] = flag(
        None, "deprecated: --speculative-verify-mode", choices=VERIFY_CHOICES
    )
    speculative_sps_table_path: Optional[str] = flag(
        None,
        "JSON table of verify steps/s against batch verify tokens (`specserve profile-sps`): the compact "
        "planner's, or the adaptive policy's starting cost of the target's rows (any drafter)",
    )
    speculative_dspark_sps_table_path: Optional[str] = flag(None, "deprecated: --speculative-sps-table-path")
    speculative_policy: str = flag(
        "adaptive",
        "adaptive: each step, every request gets the drafter and the number of drafts (0..gamma) that "
        "maximise the batch's expected tokens per second under a step-cost model the engine measures itself; "
        "fixed: every request drafts gamma tokens with --speculative-algorithm's drafter",
        choices=SPEC_POLICIES,
    )
    speculative_policy_drafters: Optional[str] = flag(
        None, "drafters the adaptive policy chooses from (default: DSPARK,NGRAM,SUFFIX with DSPARK; else NGRAM,SUFFIX)"
    )
    speculative_suffix_max_tree_depth: int = flag(24, "SUFFIX: the longest suffix of the context matched (>= 2)")
    speculative_suffix_max_spec_factor: float = flag(1.0, "SUFFIX: at most this many drafts per matched token")
    speculative_suffix_min_token_prob: float = flag(0.1, "SUFFIX: a draft's least share of the matched occurrences")
    speculative_suffix_cache_tokens: int = flag(1 << 20, "SUFFIX: finished outputs' tokens kept, oldest evicted first")
    speculative_suffix_scope: str = flag(
        SuffixScope.GLOBAL.value,
        "SUFFIX: global: a greedy request also drafts from earlier requests' outputs (one operator's server); "
        "request: from its own prompt and output only, no outputs kept (tenants whose timing must not leak)",
        choices=SUFFIX_SCOPES,
    )
    speculative_cost_table_path: Optional[str] = flag(
        None, "JSON step-cost table to start the adaptive policy from instead of the start-up warm-up (StepCostModel.save)"
    )
    speculative_freeze_cost_table: bool = flag(
        False, "never update the step-cost table after start-up, so that runs, loop modes and ranks make identical decisions"
    )
    speculative_min_gain: float = flag(
        0.05, "draft only where the policy predicts this fraction more tokens/s than plain decoding (its error margin)"
    )
    speculative_disable_closed_batch_pricing: bool = flag(
        False, "price drafts in Engine.generate's closed batches as when serving (default: by the row a draft saves)"
    )
    speculative_explore_interval: int = flag(64, "a request tries a drafter unused for this many of its steps (0: never)")
    speculative_disable_batch_size: Optional[int] = flag(
        None,
        "override: decode steps with more running requests than this run without drafts; 0: never speculate "
        "in decode; empty (default): the policy decides",
    )
    speculative_lagged_plans: bool = flag(
        False,
        "the adaptive policy plans each launch from the commits two launches back, so a launch never waits for the "
        "last step's tokens (meant for CUDA; off where a drafter drafts from host state: SUFFIX on the host, STANDALONE)",
    )
    disable_overlap_schedule: bool = flag(
        False, "run the normal loop (schedule, run, process) instead of overlapping step N with processing step N-1"
    )
    disable_cuda_graph: bool = flag(
        False, "run decode and verify eagerly instead of as captured steps (CUDA graphs on CUDA, static-buffer steps on CPU)"
    )
    cuda_graph_max_bs: int = flag(32, "largest batch run as a captured step; larger batches run eagerly")
    enable_torch_compile: bool = flag(
        False,
        "torch.compile the captured steps on CPU with stock PyTorch matmuls instead of specserve's kernels: "
        "slower here, and bf16 output is then NOT batch-invariant (opt-in, off by default)",
    )
    random_seed: int = flag(0, "seed for requests that give none")
    num_threads: Optional[int] = flag(None, "torch intra-op threads (default: torch's choice)")
    log_level: str = flag("warning", "logging level")
    enable_hierarchical_cache: bool = flag(
        False, "HiCache: keep evicted prefix-cache KV in a host-memory pool and load it back on a hit"
    )
    hicache_ratio: float = flag(2.0, "host pool size as a multiple of the device KV pool")
    hicache_size: Optional[int] = flag(None, "host pool size in tokens (overrides --hicache-ratio)")
    hicache_write_policy: str = flag(
        "write_through",
        "when nodes are copied to the host",
        choices=("write_through", "write_through_selective", "write_back"),
    )
    hicache_storage_backend: Optional[str] = flag(
        None,
        "file: also keep full 64-token pages in --hicache-storage-dir (survives restarts; a corrupt file is a miss)",
        choices=(None, "file"),
    )
    hicache_storage_dir: Optional[str] = flag(None, "directory of the file tier (created 0700, pages 0600)")
    hicache_storage_max_bytes: int = flag(
        DEFAULT_STORAGE_MAX_BYTES,
        "cap on the file tier's pages in bytes (split between TP ranks); least recently used pages are deleted past it",
    )
    tp_size: int = flag(1, "tensor-parallel ranks (one scheduler process per rank, SPMD)")
    dist_init_addr: Optional[str] = flag(
        None, "host:port of the rank-0 rendezvous (default: 127.0.0.1 and a free port; required with --nnodes > 1)"
    )
    nnodes: int = flag(1, "nodes sharing the tensor-parallel ranks (tp_size / nnodes ranks per node)")
    node_rank: int = flag(0, "this node's index; node 0 hosts rank 0 and the front end")
    collective_timeout: float = flag(60.0, "seconds any cross-rank collective may wait before the rank fails loudly")

    def __post_init__(self) -> None:
        self._renamed_flags()
        self._default_speculation()
        validate_server_args(self)
        self._draft_length()

    def _renamed_flags(self) -> None:
        """Each old flag of RENAMED_FLAGS (named when DSPARK was the only drafter) read as its new
        name, with a deprecation line; both given must agree."""
        for old, new in RENAMED_FLAGS.items():
            value = getattr(self, old)
            if value is None:
                continue
            old_flag, new_flag = (f"--{name.replace('_', '-')}" for name in (old, new))
            logger.warning("%s is deprecated: use %s (the same setting)", old_flag, new_flag)
            if getattr(self, new) not in (None, value):
                raise ConfigError(f"{new}={getattr(self, new)!r} and its old name {old}={value!r} disagree")
            object.__setattr__(self, new, value)  # frozen: set once, here
            object.__setattr__(self, old, None)

    def _draft_length(self) -> None:
        """Every spelling of the draft length as --speculative-num-steps (args_checks made sure they
        agree): SGLang's --speculative-num-draft-tokens counts the anchor too (a chain's window), and
        the old --speculative-dspark-block-size, named when DSPARK was the only drafter, is an alias."""
        steps = self.speculative_num_steps
        if self.speculative_dspark_block_size is not None:
            logger.warning("--speculative-dspark-block-size is deprecated: use --speculative-num-steps (the same count)")
            steps = self.speculative_dspark_block_size
        if self.speculative_num_draft_tokens is not None:
            steps = self.speculative_num_draft_tokens - 1
        object.__setattr__(self, "speculative_num_steps", steps)  # frozen: set once, here
        object.__setattr__(self, "speculative_dspark_block_size", None)
        object.__setattr__(self, "speculative_num_draft_tokens", None if steps is None else steps + 1)

    def _default_speculation(self) -> None:
        """Unless told otherwise, speculate under the adaptive policy (which drafts only where it
        pays): the embedded model with its shipped DSpark drafter (and NGRAM), any other model
        with NGRAM, since no drafter ships for it."""
        if self.speculative_algorithm not in (None, Algorithm.DSPARK):
            return
        if self.model_path is not None:
            if self.speculative_algorithm is None and self.speculative_draft_model_path is None:
                object.__setattr__(self, "speculative_algorithm", Algorithm.NGRAM)  # frozen: set once, here
                if self.speculative_policy_drafters is None:  # both lookups, the policy choosing per request
                    object.__setattr__(self, "speculative_policy_drafters", ",".join(drafters.lookup_names()))
            return
        from specserve.assets import default_drafter_path

        path = self.speculative_draft_model_path or default_drafter_path()
        if path is not None:
            object.__setattr__(self, "speculative_algorithm", Algorithm.DSPARK)
            object.__setattr__(self, "speculative_draft_model_path", path)

    @property
    def speculating(self) -> bool:
        return self.speculative_algorithm not in (None, Algorithm.NONE)

    def policy_drafters(self) -> tuple[str, ...]:
        """The drafters the adaptive policy chooses from."""
        if self.speculative_policy_drafters:
            return tuple(d.strip().upper() for d in self.speculative_policy_drafters.split(",") if d.strip())
        assert self.speculative_algorithm is not None, "asked only while speculating"
        if self.speculative_algorithm in drafters.MODELS:  # the model drafter, and the lookups beside it
            return (self.speculative_algorithm, *drafters.lookup_names())
        return (self.speculative_algorithm,)

    def verify_mode(self) -> str:
        """The flag, else $SPECSERVE_VERIFY_MODE, else its old name $SPECSERVE_RAGGED_VERIFY_MODE (with
        a deprecation line), else static."""
        if self.speculative_verify_mode is not None:
            return self.speculative_verify_mode  # checked with the other flags
        name = VERIFY_MODE_ENV
        if not os.environ.get(VERIFY_MODE_ENV) and os.environ.get(OLD_VERIFY_MODE_ENV):
            logger.warning("%s is deprecated: use %s (the same setting)", OLD_VERIFY_MODE_ENV, VERIFY_MODE_ENV)
            name = OLD_VERIFY_MODE_ENV
        mode = os.environ.get(name) or "static"
        if mode not in VERIFY_MODES:
            raise ConfigError(f"{name} must be one of {VERIFY_MODES}, got {mode!r}")
        return mode

    def replace(self, **changes: Any) -> "ServerArgs":
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "ServerArgs":
        unknown = sorted(set(kwargs) - cls.field_names())
        if unknown:
            raise ConfigError(f"unknown engine argument(s) {unknown}; known: {sorted(cls.field_names())}")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            meta = dict(f.metadata)
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", default=f.default, help=meta.get("help"))
                continue
            kind = _cli_type(f.type)
            parser.add_argument(flag, type=kind, default=f.default, help=meta.get("help"), choices=meta.get("choices"))

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "ServerArgs":
        return cls(**{name: getattr(ns, name) for name in cls.field_names()})


def _cli_type(annotation: Any) -> type:
    text = str(annotation)
    return int if "int" in text else float if "float" in text else str


def number_list(flag: str, text: str, kind: type = int) -> list:
    """A comma-separated flag value as numbers (empty parts skipped); a ConfigError naming the flag otherwise."""
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated {kind.__name__} values, got {text!r}") from None
