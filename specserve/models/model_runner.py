"""ModelRunner: runs a ScheduleBatch as one step on the forward stream and copies its results back.

A step is split the way the overlap loop needs it:
- `launch(batch)` (host): snapshots what the step needs from the host into a StepSpec, submits the
  step to the forward stream, orders the copy stream after it and submits the device-to-host copy
  of the step's results; returns a StepHandle at once.
- the step itself (forward stream): decode and verify steps take their anchors and prefix lengths
  from the FutureMap (written by the previous step), run drafting, the target forward and the
  folded accept, take owned results with `read_accept`, inject the committed rows into the draft
  KV and write the FutureMap for the next step.
- `resolve(handle)` (host): waits for the copy's event and turns the host copies into tokens.
`run_batch` is launch + resolve: the synchronous loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from specserve.kv.pool import KVPool, ReqToTokenPool
from specserve.models.attention import AttentionMetadata
from specserve.models.captured_step import CapturedStep
from specserve.models.dspark import DraftOut, DsparkDrafter
from specserve.models.forward_batch import ForwardBatch
from specserve.models.llama import LlamaForCausalLM
from specserve.runtime.stream import Event, Stream
from specserve.sampler import counter_uniform, filtered_probs, sample
from specserve.sampling_params import SamplingParams
from specserve.scheduler.batch import ScheduleBatch, VerifyOutcome
from specserve.scheduler.future_map import FutureMap
from specserve.speculative.accept import AcceptOuts, DsparkVerifyEpilogue
from specserve.speculative.ngram import NgramDrafter
from specserve.speculative.planner import VerifyPlanner


@dataclass
class DsparkParts:
    """What DSPARK adds to a runner: the drafter, its paged K/V (same token slots as the target's)
    and, in compact mode, the verify planner."""

    drafter: DsparkDrafter
    kv: KVPool
    planner: Optional[VerifyPlanner] = None  # None: static verify


@dataclass
class CaptureConfig:
    """Which decode and static-verify steps run as captured steps (CUDA graphs on CUDA)."""

    enabled: bool = True  # --disable-cuda-graph turns it off: every step runs eagerly
    max_bs: int = 32  # --cuda-graph-max-bs: larger batches run eagerly
    compile: bool = False  # --enable-torch-compile: torch.compile the step on CPU
    pad_batches: Optional[bool] = None  # pad to batch buckets (default: only for CUDA graphs; tests set it on CPU)

    def covers(self, bs: int) -> bool:
        return self.enabled and bs <= self.max_bs


@dataclass
class StepSpec:
    """A host snapshot of one batch: the forward stream never reads scheduler objects, which the
    host keeps changing while the step runs."""

    mode: str
    rows: list[int]  # request slots
    params: list[SamplingParams]
    seeds: list[int]
    sample: list[bool]
    width: int  # rows per request for decode (1) and verify (gamma + 1)
    prefix_lens: list[int] = field(default_factory=list)  # extend only (decode/verify: FutureMap)
    extend_lens: list[int] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    out_cache_loc: list[int] = field(default_factory=list)
    out_lens: list[int] = field(default_factory=list)
    fills: list[Optional[list[int]]] = field(default_factory=list)  # extend: tokens, for NGRAM histories
    kv_bound: int = 0  # decode/verify: K/V slots the longest request holds, >= its prefix + window

    @classmethod
    def from_batch(cls, batch: ScheduleBatch) -> "StepSpec":
        reqs = batch.reqs
        spec = cls(batch.mode, [r.req_pool_idx for r in reqs], [r.params for r in reqs], [r.seed for r in reqs],
                   list(batch.sample), batch.extend_lens[0] if batch.mode != "extend" else 0)
        if batch.mode == "extend":
            spec.prefix_lens, spec.extend_lens = list(batch.prefix_lens), list(batch.extend_lens)
            spec.input_ids, spec.out_cache_loc = list(batch.input_ids), list(batch.out_cache_loc)
            spec.out_lens = [len(r.output_ids) for r in reqs]
            spec.fills = [list(r.fill_ids) if s else None for r, s in zip(reqs, batch.sample)]
        else:
            spec.kv_bound = max(len(r.kv_slots) for r in reqs)
        return spec


@dataclass
class StepHandle:
    """One launched step: its results on the device, their host copies, and the copy's event."""

    spec: StepSpec
    device_out: list[torch.Tensor] = field(default_factory=list)  # set on the forward stream
    host_out: list[torch.Tensor] = field(default_factory=list)  # set on the copy stream
    done: Optional[Event] = None


class ModelRunner:
    """Owns the model, its K/V tensors and the streams; the scheduler owns which slots mean what."""

    def __init__(self, model: LlamaForCausalLM, kv: KVPool, req_to_token: ReqToTokenPool, device: str = "cpu",
                 max_bs: int = 64, dspark: Optional[DsparkParts] = None, ngram: Optional[NgramDrafter] = None,
                 forward_stream: Optional[Stream] = None, copy_stream: Optional[Stream] = None,
                 alias_accept_buffers: bool = False, capture: Optional[CaptureConfig] = None, tp_group=None):
        self.model = model
        self.kv = kv
        self.req_to_token = req_to_token
        self.device = device
        self.max_bs = max_bs
        self.dspark = dspark
        self.ngram = ngram
        self.forward = forward_stream or Stream("forward", device)
        self.copy = copy_stream or Stream("copy", device)
        self.future = FutureMap(req_to_token.table.shape[0], device)
        self.alias_accept_buffers = alias_accept_buffers  # fault injection: the seed's bug
        self.epilogue: Optional[DsparkVerifyEpilogue] = None  # made at the first verify step
        self.last_draft: Optional[DraftOut] = None  # for tests; owned tensors
        self.capture = capture or CaptureConfig(max_bs=max_bs)
        self.capture.max_bs = min(self.capture.max_bs, max_bs)
        self._captured: dict[int, CapturedStep] = {}  # by window width: 1 (decode) or gamma + 1 (verify)
        # Tensor parallelism: decisions that floating-point noise or timing could make differ by
        # rank (sampled tokens, drafts, verify lengths, accept results) are broadcast from rank 0,
        # on the forward stream, out of one persistent contiguous buffer.
        self.tp = tp_group
        self._decisions: Optional[torch.Tensor] = None
        self.before_launch: Optional[Callable[[ScheduleBatch], None]] = None  # TP: ranks agree on the batch

    @property
    def capture_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.dspark.drafter.config.target_layer_ids) if self.dspark else ()

    # ------------------------------------------------------------ host side

    def run_batch(self, batch: ScheduleBatch) -> list[Optional[int] | VerifyOutcome]:
        """The synchronous loop's step: launch, then wait for its results."""
        return self.resolve(self.launch(batch))

    def launch(self, batch: ScheduleBatch) -> StepHandle:
        if self.before_launch is not None:
            self.before_launch(batch)
        handle = StepHandle(StepSpec.from_batch(batch))
        self.forward.submit(self._step, handle)
        Event().record(self.forward).wait(self.copy)  # the copy reads what the step produced
        self.copy.submit(self._copy_to_host, handle)
        handle.done = Event().record(self.copy)
        return handle

    def resolve(self, handle: StepHandle) -> list[Optional[int] | VerifyOutcome]:
        handle.done.synchronize()
        self.forward.raise_pending()  # a failed step surfaces here, not as a missing result
        spec = handle.spec
        if spec.mode == "verify":
            out = AcceptOuts(*handle.host_out)
            commit, tokens, trimmed = out.commit_lens.tolist(), out.out_tokens.tolist(), out.cap_trim_lens.tolist()
            return [VerifyOutcome(row[:n], cap) for row, n, cap in zip(tokens, commit, trimmed)]
        tokens = handle.host_out[0].tolist()
        return [t if s else None for t, s in zip(tokens, spec.sample)]

    def _copy_to_host(self, handle: StepHandle) -> None:
        """Copy stream: the device-to-host copy (pinned and non-blocking on CUDA)."""
        pinned = self.copy.device.type == "cuda"
        for src in handle.device_out:
            host = torch.empty(src.shape, dtype=src.dtype, pin_memory=pinned)
            host.copy_(src, non_blocking=pinned)
            handle.host_out.append(host)

    # ------------------------------------------------------------ forward stream

    @torch.inference_mode()
    def _step(self, handle: StepHandle) -> None:
        spec = handle.spec
        if spec.mode == "extend":
            handle.device_out = [self._extend(spec)]
        elif spec.mode == "decode":
            handle.device_out = [self._decode(spec)]
        else:
            handle.device_out = self._verify(spec).tensors()

    def _extend(self, spec: StepSpec) -> torch.Tensor:
        fb = self._forward_batch(spec.rows, spec.prefix_lens, spec.extend_lens,
                                 torch.tensor(spec.input_ids, dtype=torch.int64, device=self.device),
                                 spec.out_cache_loc, every_row=False, sample=spec.sample)
        logits = self._forward(fb, inject=True)
        tokens = torch.zeros(len(spec.rows), dtype=torch.int64)
        wanted = [i for i, s in enumerate(spec.sample) if s]
        if wanted:
            picked = sample(logits.cpu(), [spec.params[i] for i in wanted], [spec.seeds[i] for i in wanted],
                            [spec.out_lens[i] for i in wanted])
            picked = self._agree([torch.tensor(picked, dtype=torch.int64)], "runner.extend_tokens")[0].tolist()
            tokens[wanted] = torch.tensor(picked)
            rows = torch.tensor([spec.rows[i] for i in wanted], device=self.device)
            seq = torch.tensor([spec.prefix_lens[i] + spec.extend_lens[i] for i in wanted], device=self.device)
            outs = torch.tensor([spec.out_lens[i] + 1 for i in wanted], device=self.device)
            self.future.write(rows, tokens[wanted].to(self.device), seq, outs)
            if self.ngram is not None:
                for i, tok in zip(wanted, picked):
                    self.future.histories[spec.rows[i]] = spec.fills[i] + [tok]
        return tokens

    def _decode(self, spec: StepSpec) -> torch.Tensor:
        rows = torch.tensor(spec.rows, dtype=torch.int64, device=self.device)
        anchors, prefix, out_lens = self.future.read(rows)
        if self.capture.covers(len(spec.rows)):
            out = self._captured_step(1).run(rows, prefix, anchors.view(-1, 1), spec.kv_bound)
            if self.dspark is not None:
                self.dspark.drafter.inject(out.hidden, out.positions, out.slots, self.dspark.kv)
            logits = out.logits  # a persistent buffer: sampled right here, before the next replay
        else:
            logits = self._decode_eager(spec, rows, anchors, prefix)
        picked = sample(logits.cpu(), spec.params, spec.seeds, out_lens.tolist())
        tokens = self._agree([torch.tensor(picked, dtype=torch.int64)], "runner.decode_tokens")[0]
        self.future.write(rows, tokens.to(self.device), prefix + 1, out_lens + 1)
        if self.ngram is not None:  # a plain decode step of a speculating engine (a large batch)
            for r, tok in zip(spec.rows, tokens.tolist()):
                self.future.histories[r].append(tok)
        return tokens

    def _decode_eager(self, spec: StepSpec, rows: torch.Tensor, anchors: torch.Tensor,
                      prefix: torch.Tensor) -> torch.Tensor:
        prefix_list = prefix.tolist()
        slots = self.req_to_token.table[rows, prefix].tolist()
        fb = self._forward_batch(spec.rows, prefix_list, [1] * len(spec.rows), anchors, slots, every_row=False,
                                 sample=spec.sample)
        return self._forward(fb, inject=True)

    def _captured_step(self, width: int) -> CapturedStep:
        """The captured step for this window width, made (and registered as persistent) on first use."""
        epilogue = self.epilogue if width > 1 else None
        step = self._captured.get(width)
        if step is None or step.epilogue is not epilogue:
            step = CapturedStep(self.model, self.kv, self.req_to_token.table, width, self.capture.max_bs,
                                self.capture_layer_ids, epilogue, use_cuda_graph=self.forward.device.type == "cuda",
                                compile=self.capture.compile, pad_batches=self.capture.pad_batches)
            if self.forward.sanitizer is not None:
                self.forward.sanitizer.register_persistent(step.buffers(), self.forward)
            self._captured[width] = step
        return step

    def _forward(self, fb: ForwardBatch, inject: bool) -> torch.Tensor:
        logits = self.model(fb, self.kv)
        if inject and self.dspark is not None:  # every computed row of a prefill or decode is committed
            self.dspark.drafter.inject(fb.captured_hidden, fb.positions, fb.out_cache_loc, self.dspark.kv)
        return logits

    def _forward_batch(self, rows: list[int], prefix_lens: list[int], extend_lens: list[int],
                       input_ids: torch.Tensor, slots: list[int], every_row: bool,
                       sample: Optional[list[bool]] = None) -> ForwardBatch:
        """Tensors for one pass; logits for every row (verify) or each sampling request's last row."""
        dev = self.device
        logit_rows, offset = [], 0
        for i, n in enumerate(extend_lens):
            offset += n
            if every_row:
                logit_rows.extend(range(offset - n, offset))
            elif sample is None or sample[i]:
                logit_rows.append(offset - 1)
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
        positions = [p + i for p, n in zip(prefix_lens, extend_lens) for i in range(n)]
        meta = AttentionMetadata.build(self.req_to_token.table, rows, seq_lens, extend_lens, dev, self.model.dtype)
        return ForwardBatch(input_ids=input_ids, positions=torch.tensor(positions, dtype=torch.int64, device=dev),
                            out_cache_loc=torch.tensor(slots, dtype=torch.int64, device=dev), attn=meta,
                            logit_rows=torch.tensor(logit_rows, dtype=torch.int64, device=dev),
                            capture_layer_ids=self.capture_layer_ids)

    # ------------------------------------------------------------ speculative verify (forward stream)

    def _verify(self, spec: StepSpec) -> AcceptOuts:
        """Draft, verify the windows, accept into the epilogue's buffers, then read owned copies,
        inject the committed rows into the draft KV and leave anchors and lengths for the next step."""
        bs, width = len(spec.rows), spec.width
        if self.epilogue is None or self.epilogue.num_verify_tokens != width:
            self.epilogue = DsparkVerifyEpilogue(self.max_bs, width, self.device)
            if self.forward.sanitizer is not None:
                self.forward.sanitizer.register_persistent(self.epilogue.buffers(), self.forward)
        rows = torch.tensor(spec.rows, dtype=torch.int64, device=self.device)
        anchors, prefix, out_lens = self.future.read(rows)
        ids = torch.empty(bs, width, dtype=torch.int64, device=self.device)
        ids[:, 0] = anchors
        draft = self._draft(spec, rows, ids, prefix, out_lens)
        verify_lens = self._plan(draft)
        if self.tp is not None:
            lens = torch.tensor(verify_lens if verify_lens is not None else [width] * bs, dtype=torch.int64)
            ids_agreed, lens = self._agree([ids.cpu(), lens], "runner.drafts")
            ids.copy_(ids_agreed)
            verify_lens = lens.tolist() if verify_lens is not None else None
        window_slots = self.req_to_token.table[rows.unsqueeze(1), prefix.unsqueeze(1) + torch.arange(width)]
        greedy = all(p.is_greedy for p in spec.params)
        if verify_lens is None and self.capture.covers(bs):  # the captured verify, greedy accept folded in
            captured = self._captured_step(width).run(rows, prefix, ids, spec.kv_bound, accept=greedy)
            logits, hidden = captured.logits, captured.hidden
            if not greedy:
                self._accept(spec, ids, logits, prefix, out_lens, draft, None)
        else:
            logits, fb = self._verify_forward(spec, ids, prefix, window_slots, verify_lens)
            hidden = fb.captured_hidden
            self._accept(spec, ids, logits, prefix, out_lens, draft, verify_lens)
        if self.tp is not None:  # rank 0's accept results, into every rank's accept buffers
            bufs = self.epilogue.accept_buffers(bs).tensors()
            for buf, agreed in zip(bufs, self._agree([b.cpu() for b in bufs], "runner.accept")):
                buf.copy_(agreed)
        out = self.read_accept(bs)  # owned: nothing below reads the *_buf tensors
        if self.dspark is not None:
            self._inject_committed(hidden, out, prefix, window_slots, verify_lens)
        self.future.write(rows, out.bonus, out.new_seq_lens, out_lens + out.commit_lens)
        if self.ngram is not None:
            for r, toks, n in zip(spec.rows, out.out_tokens.tolist(), out.commit_lens.tolist()):
                self.future.histories[r].extend(toks[:n])
        return out

    def _agree(self, tensors: list[torch.Tensor], site: str) -> list[torch.Tensor]:
        """Rank 0's values of these int64 CPU tensors on every rank (identity without TP)."""
        if self.tp is None:
            return tensors
        n = sum(t.numel() for t in tensors)
        if self._decisions is None or self._decisions.numel() < n:
            self._decisions = torch.zeros(max(n, self.max_bs * 32), dtype=torch.int64)
        buf = self._decisions[:n]
        torch.cat([t.reshape(-1) for t in tensors], out=buf)
        self.tp.broadcast_(buf, site, on_model_group=True)
        out, offset = [], 0
        for t in tensors:
            out.append(buf[offset:offset + t.numel()].view(t.shape).clone())
            offset += t.numel()
        return out

    def read_accept(self, bs: int) -> AcceptOuts:
        if self.alias_accept_buffers:  # SPECSERVE_FAULT_ALIAS_ACCEPT_BUFFERS: the seed's bug, on purpose
            return self.epilogue.accept_buffers(bs)
        return self.epilogue.read_accept(bs)

    def _draft(self, spec: StepSpec, rows: torch.Tensor, ids: torch.Tensor, prefix: torch.Tensor,
               out_lens: torch.Tensor) -> Optional[DraftOut]:
        """Fill ids[:, 1:]: the DSpark drafter's block, or NGRAM's prompt lookup."""
        if self.dspark is None:
            self.last_draft = None
            gamma = ids.shape[1] - 1
            drafts = [self.ngram.propose(self.future.histories[r])[:gamma] if self.ngram else [] for r in spec.rows]
            # Without a drafter the window repeats the anchor (a verify still emits its bonus).
            for i, d in enumerate(drafts):
                ids[i, 1:] = torch.tensor((d + [int(ids[i, 0])] * gamma)[:gamma])
            return None
        ctx_slots = self.req_to_token.table[rows, :int(prefix.max())]
        draft = self.dspark.drafter.propose(ids[:, 0], prefix, ctx_slots, self.dspark.kv, spec.params, spec.seeds,
                                            out_lens.tolist())
        ids[:, 1:] = draft.tokens
        self.last_draft = draft
        return draft

    def _plan(self, draft: Optional[DraftOut]) -> Optional[list[int]]:
        if draft is None or self.dspark.planner is None:
            return None
        return self.dspark.planner.verify_lens(draft.confidence)

    def _verify_forward(self, spec: StepSpec, ids: torch.Tensor, prefix: torch.Tensor, window_slots: torch.Tensor,
                        verify_lens: Optional[list[int]]) -> tuple[torch.Tensor, ForwardBatch]:
        """Target logits in the strided [bs * W, V] layout. Compact mode packs the verified rows
        for the forward and scatters them back; uncomputed rows are zero (the cap never reads them)."""
        bs, width = ids.shape
        lens = verify_lens or [width] * bs
        keep = torch.arange(width, device=self.device).unsqueeze(0) < torch.tensor(lens, device=self.device).unsqueeze(1)
        fb = self._forward_batch(spec.rows, prefix.tolist(), lens, ids[keep], window_slots[keep].tolist(), every_row=True)
        packed = self.model(fb, self.kv)
        if verify_lens is None:
            return packed, fb
        logits = packed.new_zeros(bs * width, packed.shape[-1])
        logits[keep.reshape(-1)] = packed
        return logits, fb

    def _accept(self, spec: StepSpec, ids: torch.Tensor, logits: torch.Tensor, prefix: torch.Tensor,
                out_lens: torch.Tensor, draft: Optional[DraftOut], verify_lens: Optional[list[int]]) -> None:
        bs, width = ids.shape
        lens = None if verify_lens is None else torch.tensor(verify_lens, dtype=torch.int64, device=self.device)
        if all(p.is_greedy for p in spec.params):
            self.epilogue.accept_greedy(bs, ids, logits, prefix, lens)
            return
        target = verify_target_probs(logits.view(bs, width, -1), spec.params)
        if draft is not None and draft.probs is not None:
            q = draft.probs
        else:  # a deterministic drafter (NGRAM): q is one-hot on its proposal
            q = torch.nn.functional.one_hot(ids[:, 1:], target.shape[-1]).float()
        uniforms = torch.tensor([[counter_uniform(seed, (n << 6) + j) for j in range(width)]
                                 for seed, n in zip(spec.seeds, out_lens.tolist())], dtype=torch.float64)
        self.epilogue.accept_sampling(bs, ids, target, q, uniforms, prefix, lens)

    def _inject_committed(self, hidden: torch.Tensor, out: AcceptOuts, prefix: torch.Tensor,
                          window_slots: torch.Tensor, verify_lens: Optional[list[int]]) -> None:
        """Draft K/V for exactly the committed rows: positions S..S+commit_len-1 of each window.

        Reads the owned `out.commit_lens` and this step's own `prefix`, never an accept buffer:
        the seed's synchronous-loop bug was an injection reading a view the next step rewrote."""
        bs, width = window_slots.shape
        col = torch.arange(width, device=self.device).unsqueeze(0)
        committed = col < out.commit_lens.unsqueeze(1)  # [bs, W]
        lens = verify_lens or [width] * bs
        packed_row = torch.tensor(_starts(lens), device=self.device).unsqueeze(1) + col
        self.dspark.drafter.inject(hidden[packed_row[committed]], (prefix.unsqueeze(1) + col)[committed],
                                   window_slots[committed], self.dspark.kv)

    def close(self) -> None:
        self.forward.close()
        self.copy.close()


def _starts(lens: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for n in lens:
        out.append(acc)
        acc += n
    return out


def verify_target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[bs, W, V] target distribution per window row: one-hot argmax for greedy requests."""
    bs, width, vocab = logits.shape
    probs = torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    if sampled:
        rows = logits[sampled].reshape(-1, vocab)
        repeated = [params[i] for i in sampled for _ in range(width)]
        probs[sampled] = filtered_probs(rows, repeated).view(len(sampled), width, vocab)
    return probs

