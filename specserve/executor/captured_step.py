"""Captured steps: decode and static verify (with the folded greedy accept) over static buffers.

A captured step owns static input buffers (request slots, prefix lengths, window token ids, a
row-valid mask) and static output buffers (logits, the drafter's captured hidden states, the K/V
positions and slots). `run()` copies a batch's inputs into the first rows of the inputs and
replays the step, which overwrites the outputs (and, for a greedy verify, the verify epilogue's
six accept buffers) in place. Every output is therefore a persistent buffer, owned by the
forward stream: the caller reads it on the forward stream before the next replay and keeps
only owned copies (`read_accept`, `sample` on the logits).

- CUDA: one CUDA graph per (batch-size bucket, K/V-length bucket), captured on first use;
  batches are padded to the bucket (padded rows write K/V to the scratch slot 0 and read nothing
  else). Attention metadata is built inside the step from device tensors only, so a replay needs
  no host synchronisation: the K/V length bucket comes from a host-side bound.
- CPU: the same object and the same buffers, "replayed" by calling the step function on the
  first bs rows (no padding, the exact K/V bound), optionally `torch.compile`d. The
  persistent-buffer semantics are identical on both devices, which is what lets a CPU unit test
  catch a view of an output that escapes to another stream.

Compact (ragged) verify and prefill run eagerly: their shapes change with every batch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from specserve.errors import InternalError
from specserve.executor.step_io import StepInput
from specserve.kv.pool import KVPool
from specserve.models.forward_batch import ForwardBatch
from specserve.models.llama import LlamaForCausalLM
from specserve.speculative.accept import VerifyEpilogue

MIN_KV_BUCKET = 128


class VerifyPath(str, enum.Enum):
    """How a verify step runs."""

    FOLDED = "captured, greedy accept folded in"
    CAPTURED = "captured, accept after it"
    EAGER = "eager over the verified rows, accept after it"

    @staticmethod
    def select(step: StepInput, verify_lens: Optional[list[int]], capture: "CaptureConfig") -> "VerifyPath":
        """The one selector of how a verify step runs: captured at a captured batch size when every
        row of every window is verified (or static_windows caps the accept instead), and then with
        the greedy accept folded in unless some request samples, shapes its logits (penalties, bias,
        a grammar) or has a verify length; else eagerly over the verified rows."""
        if not capture.covers(step.size) or (verify_lens is not None and not capture.static_windows):
            return VerifyPath.EAGER
        if verify_lens is None and all(p.is_greedy and not p.shapes_logits for p in step.params):
            return VerifyPath.FOLDED
        return VerifyPath.CAPTURED  # with verify lengths: every row computed, the accept capped at them


def batch_buckets(max_bs: int) -> list[int]:
    """Batch sizes with a CUDA graph: 1, 2, 4, 8, then every multiple of 8 up to max_bs."""
    out = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, max_bs + 1, 8))
    if not out or out[-1] != max_bs:
        out.append(max_bs)
    return out


def kv_bucket(bound: int, max_context: int) -> int:
    """K/V length a CUDA graph is captured for: the next power of two from 128, at most the context."""
    size = MIN_KV_BUCKET
    while size < bound:
        size *= 2
    return min(size, max_context)


@dataclass
class CaptureConfig:
    """Which decode and static-verify steps run as captured steps (CUDA graphs on CUDA)."""

    enabled: bool = True  # --disable-cuda-graph turns it off: every step runs eagerly
    max_bs: int = 32  # --cuda-graph-max-bs: larger batches run eagerly
    compile: bool = False  # --enable-torch-compile: torch.compile the step on CPU
    pad_batches: Optional[bool] = None  # pad to batch buckets (default: only for CUDA graphs; tests set it on CPU)
    # Windows verified whole in the captured step, the accept capped at planned lengths, instead of
    # packing the planned rows: packing needs the prefixes on the host (a wait), and on CUDA the
    # extra rows are nearly free. Default: on CUDA only (CPU rows cost compute); tests set it on CPU.
    static_windows: Optional[bool] = None

    def covers(self, bs: int) -> bool:
        return self.enabled and bs <= self.max_bs

    def fitted(self, max_bs: int, device: "str | torch.device") -> "CaptureConfig":
        """This config for a runner of at most max_bs requests on `device` (defaults resolved)."""
        self.max_bs = min(self.max_bs, max_bs)
        if self.static_windows is None:
            self.static_windows = torch.device(device).type == "cuda"
        return self


@dataclass
class CapturedOut:
    """Views of a captured step's persistent outputs for the first bs rows; valid until the next replay."""

    logits: torch.Tensor  # [bs * W, V] float32
    hidden: Optional[torch.Tensor]  # [bs * W, layers * H]: the drafter's context, or None
    positions: torch.Tensor  # [bs * W]
    slots: torch.Tensor  # [bs * W] token slots that received K/V


class CapturedStep:
    """A decode (W = 1) or static verify (W = gamma + 1) step over static buffers, replayed per bucket.

    With `epilogue`, the greedy accept runs inside the step (the folded accept) and writes the
    epilogue's buffers; `run(..., accept=False)` leaves acceptance to the caller (sampling)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv: KVPool,
        req_to_token: torch.Tensor,
        width: int,
        max_bs: int,
        capture_layer_ids: tuple[int, ...] = (),
        epilogue: Optional[VerifyEpilogue] = None,
        use_cuda_graph: bool = False,
        compile: bool = False,
        pad_batches: Optional[bool] = None,
    ):
        self.model, self.kv, self.table = model, kv, req_to_token
        self.width, self.max_bs = width, max_bs
        self.capture_layer_ids = capture_layer_ids
        self.epilogue = epilogue
        self.use_cuda_graph = use_cuda_graph
        # Graphs need fixed shapes: pad to a bucket. On CPU that would only add rows (tests turn it on).
        self.pad_batches = use_cuda_graph if pad_batches is None else pad_batches
        dev = req_to_token.device
        i64: dict[str, Any] = dict(dtype=torch.int64, device=dev)
        rows = max_bs * width
        self.rows_in = torch.zeros(max_bs, **i64)
        self.prefix_in = torch.zeros(max_bs, **i64)
        self.ids_in = torch.zeros(max_bs, width, **i64)
        self.valid_in = torch.zeros(max_bs, dtype=torch.bool, device=dev)
        # Outputs are written before they are read, so left unfilled: on CPU a page of them becomes
        # resident only when a batch that large first runs (max_bs rows of a 262k vocabulary: 32 MiB).
        self.logits_out = torch.empty(rows, model.config.vocab_size, dtype=torch.float32, device=dev)
        hidden = len(capture_layer_ids) * model.config.hidden_size
        self.hidden_out = torch.empty(rows, hidden, dtype=model.dtype, device=dev) if hidden else None
        self.positions_out = torch.zeros(rows, **i64)
        self.slots_out = torch.zeros(rows, **i64)
        self._graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self._graph_pool: Optional[torch.cuda._POOL_HANDLE] = None
        self._body: Callable[[int, int, bool], None] = self._step
        if compile:
            self._body = torch.compile(self._step, dynamic=True)

    @property
    def buckets(self) -> list[int]:
        return batch_buckets(self.max_bs)

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor a replay writes (the epilogue's buffers are registered by their owner)."""
        out = [self.rows_in, self.prefix_in, self.ids_in, self.valid_in, self.logits_out, self.positions_out, self.slots_out]
        return out + ([self.hidden_out] if self.hidden_out is not None else [])

    @torch.inference_mode()
    def run(
        self, rows: torch.Tensor, prefix: torch.Tensor, ids: torch.Tensor, kv_bound: int, accept: bool = True
    ) -> CapturedOut:
        """Replay for a batch: rows/prefix `[bs]`, ids `[bs, W]`; `kv_bound` >= every prefix + W."""
        bs = rows.shape[0]
        if not 1 <= bs <= self.max_bs:
            raise InternalError(f"captured step: batch size {bs} outside 1..{self.max_bs}")
        padded = next(b for b in self.buckets if b >= bs) if self.pad_batches else bs
        max_context = self.table.shape[1]
        kv_len = kv_bucket(kv_bound, max_context) if self.pad_batches else min(kv_bound, max_context)
        self._load_inputs(bs, padded, rows, prefix, ids)
        fold = accept and self.epilogue is not None
        if self.use_cuda_graph:
            self._replay_graph(padded, kv_len, fold)
        else:
            self._body(padded, kv_len, fold)
        n = bs * self.width
        hidden = self.hidden_out[:n] if self.hidden_out is not None else None
        return CapturedOut(self.logits_out[:n], hidden, self.positions_out[:n], self.slots_out[:n])

    def _load_inputs(self, bs: int, padded: int, rows: torch.Tensor, prefix: torch.Tensor, ids: torch.Tensor) -> None:
        self.rows_in[:bs].copy_(rows)
        self.prefix_in[:bs].copy_(prefix)
        self.ids_in[:bs].copy_(ids.view(bs, self.width))
        self.valid_in[:bs] = True
        if padded > bs:  # padding rows: request slot 0, position 0, K/V to the scratch slot
            self.rows_in[bs:padded] = 0
            self.prefix_in[bs:padded] = 0
            self.ids_in[bs:padded] = 0
            self.valid_in[bs:padded] = False

    def _replay_graph(self, padded: int, kv_len: int, fold: bool) -> None:
        key = (padded, kv_len, fold)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(padded, kv_len, fold)
            self._graphs[key] = graph
        graph.replay()

    def _capture(self, padded: int, kv_len: int, fold: bool) -> torch.cuda.CUDAGraph:
        """Warm up on a side stream (allocator and kernels), then capture one replayable graph."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._step(padded, kv_len, fold)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            self._step(padded, kv_len, fold)
        self._graph_pool = graph.pool()
        return graph

    def _step(self, bs: int, kv_len: int, fold: bool) -> None:
        """The captured body: fixed shapes, device tensors only, results written in place."""
        width = self.width
        rows, prefix, ids, valid = self.rows_in[:bs], self.prefix_in[:bs], self.ids_in[:bs], self.valid_in[:bs]
        positions = prefix.unsqueeze(1) + torch.arange(width, device=prefix.device)
        slots = self.table[rows.unsqueeze(1), positions].masked_fill(~valid.unsqueeze(1), 0)
        meta = self.model.ops.window_metadata(self.table, rows, prefix, valid, width, kv_len)
        n = bs * width
        fb = ForwardBatch(
            input_ids=ids.reshape(-1),
            positions=positions.reshape(-1),
            out_cache_loc=slots.reshape(-1),
            attn=meta,
            logit_rows=torch.arange(n, device=prefix.device),
            capture_layer_ids=self.capture_layer_ids,
            position_bound=kv_len,  # >= every prefix + W (the caller's kv_bound)
        )
        logits = self.model(fb, self.kv)
        self.logits_out[:n].copy_(logits)
        self.positions_out[:n].copy_(fb.positions)
        self.slots_out[:n].copy_(fb.out_cache_loc)
        if self.hidden_out is not None:
            assert fb.captured_hidden is not None, "the model fills it: capture_layer_ids is not empty"
            self.hidden_out[:n].copy_(fb.captured_hidden)
        if fold:
            assert self.epilogue is not None, "run() folds only with an epilogue"
            self.epilogue.accept_greedy(bs, ids, logits, prefix)
