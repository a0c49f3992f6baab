"""Helpers shared by the tests (fixtures live in conftest.py): chat prompts, logits of the real
model over a private KV pool, and live `specserve serve` processes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import torch

from specserve.kv.pool import KVPool, ReqToTokenPool
from specserve.models.forward_batch import ForwardBatch

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a long story about a dragon who learns to bake bread.",
    "Explain in detail how photosynthesis works.",
    "List ten fun facts about octopuses.",
]


def chat_prompts(engine, contents: list[str]) -> list[list[int]]:
    return [engine.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in contents]


def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    """float32 logits of every position of one prompt, computed in a single extend pass."""
    cfg = model.config
    n = len(ids)
    kv = KVPool(n, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype)
    table = ReqToTokenPool(1, n)
    slots = list(range(1, n + 1))
    table.write(0, 0, slots)
    meta = model.ops.attention_metadata(table.table, [0], [n], [n], "cpu")
    fb = ForwardBatch(torch.tensor(ids), torch.arange(n), torch.tensor(slots), meta, torch.arange(n))
    return model(fb, kv)


@contextlib.contextmanager
def int8_activations(model):
    """The model's quantized linears with integer activations (as --cpu-activations int8 sets them)
    while inside; yields how many linears switched. Native layers (which read the setting when
    built) are rebuilt on the way in and out."""
    from specserve.kernels.linear import PackedLinear
    from specserve.models.native_layer import NativeLayers

    kernels = [m.kernel for m in model.modules() if isinstance(getattr(m, "kernel", None), PackedLinear)]

    def rebuild_native() -> None:
        if getattr(model, "native", None) is not None:
            model.native = NativeLayers.build(list(model.layers))

    try:
        switched = sum(k.quantize_activations() for k in kernels)
        rebuild_native()
        yield switched
    finally:
        for k in kernels:
            k.quantize_activations(False)
        rebuild_native()


def windowed_logits(model, prompts: list[list[int]], window: int) -> list[torch.Tensor]:
    """Prefill all but the last `window` tokens of each prompt, then run every request's last
    `window` tokens as one batched multi-token step (the shape of a speculative verify) and
    return the logits of all window rows per request."""
    cfg = model.config
    total = sum(len(p) for p in prompts)
    kv = KVPool(total, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype)
    table = ReqToTokenPool(len(prompts), max(len(p) for p in prompts))
    next_slot, slots = 1, []
    for r, p in enumerate(prompts):
        own = list(range(next_slot, next_slot + len(p)))
        next_slot += len(p)
        table.write(r, 0, own)
        slots.append(own)
    rows = list(range(len(prompts)))

    def run(starts: list[int], ends: list[int], all_rows: bool) -> torch.Tensor:
        ids = [t for p, s, e in zip(prompts, starts, ends) for t in p[s:e]]
        pos = [i for s, e in zip(starts, ends) for i in range(s, e)]
        loc = [x for sl, s, e in zip(slots, starts, ends) for x in sl[s:e]]
        ext = [e - s for s, e in zip(starts, ends)]
        meta = model.ops.attention_metadata(table.table, rows, ends, ext, "cpu")
        logit_rows = torch.arange(len(ids)) if all_rows else torch.tensor([sum(ext[:i + 1]) - 1 for i in range(len(ext))])
        fb = ForwardBatch(torch.tensor(ids), torch.tensor(pos), torch.tensor(loc), meta, logit_rows)
        return model(fb, kv)

    cut = [len(p) - window for p in prompts]
    run([0] * len(prompts), cut, all_rows=False)
    logits = run(cut, [len(p) for p in prompts], all_rows=True)
    return list(logits.split(window))

def _staged_passes(model, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """Every prompt in stages over one private KV pool, all requests batched in each pass: a
    prefill chunk (the first half), an extend to two tokens short, those two as a verify-shaped
    window, then one decode row each. Returns every pass's logits (all rows), the captured layer
    outputs of the first pass, and the K/V pools."""
    cfg = model.config
    kv = KVPool(sum(len(p) + 1 for p in prompts), cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype)
    seqs = [p + [p[0]] for p in prompts]  # the decode row feeds the prompt's first token again
    table = ReqToTokenPool(len(seqs), max(len(s) for s in seqs))
    slots, next_slot = [], 1
    for r, seq in enumerate(seqs):
        slots.append(list(range(next_slot, next_slot + len(seq))))
        next_slot += len(seq)
        table.write(r, 0, slots[-1])
    out: dict[str, torch.Tensor] = {}
    stages = [[len(p) // 2 for p in prompts], [len(p) - 2 for p in prompts], [len(p) for p in prompts],
              [len(s) for s in seqs]]
    starts = [0] * len(seqs)
    for n, ends in enumerate(stages):
        ids = [t for s, a, b in zip(seqs, starts, ends) for t in s[a:b]]
        ext = [b - a for a, b in zip(starts, ends)]
        meta = model.ops.attention_metadata(table.table, list(range(len(seqs))), ends, ext, "cpu")
        fb = ForwardBatch(torch.tensor(ids), torch.tensor([i for a, b in zip(starts, ends) for i in range(a, b)]),
                          torch.tensor([x for sl, a, b in zip(slots, starts, ends) for x in sl[a:b]]), meta,
                          torch.arange(len(ids)), capture_layer_ids=(0, cfg.num_layers - 1) if n == 0 else ())
        out[f"logits{n}"] = model(fb, kv)
        if n == 0:
            out["captured"] = fb.captured_hidden
        starts = ends
    for i in range(cfg.num_layers):
        out[f"k{i}"], out[f"v{i}"] = kv.k[i], kv.v[i]
    return out


def layer_path_mismatches(model, prompts: list[list[int]]) -> list[str]:
    """The tensors of `_staged_passes` whose bits differ between the model's native decoder layers
    (models/native_layer.py) and its layers run op by op; [] when every one is bitwise equal."""
    native = model.native
    assert native is not None, "the model has native layers (CPU kernels, TP size 1)"
    try:
        with_native = _staged_passes(model, prompts)
        model.native = None
        per_op = _staged_passes(model, prompts)
    finally:
        model.native = native
    assert with_native.keys() == per_op.keys()
    return [name for name, t in with_native.items() if not torch.equal(_bits(t), _bits(per_op[name]))]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}[t.dtype])


STARTUP_TIMEOUT_S = 300
MODEL = "SmolLM2-135M-Instruct"
API_KEY = "sk-specserve-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A live server: `.url`, `.stop()` returns its exit code."""

    def __init__(self, *args: str, log_path: str, log_level: str | None = "info"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        level = ["--log-level", log_level] if log_level else []  # None: serve's own default
        cmd = [sys.executable, "-m", "specserve.cli", "serve", "--port", str(self.port), *level, *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=dict(os.environ))
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    def engine_pid(self) -> int:
        """The engine process's pid, from the start-up block's "engine  pid N" line."""
        import re

        with open(self.log_path) as f:
            found = re.search(r"  engine +pid (\d+),", f.read())
        assert found, self.log()
        return int(found.group(1))

    def log(self, whole: bool = False) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path) as f:
            text = f.read()
        return text if whole else text[-4000:]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        from specserve.server.replicas import stop_process

        code = stop_process(self.proc, sig, timeout_s)
        self._log.close()
        return code


_CHEAP_TABLE: list[str] = []


def cheap_drafting_table() -> str:
    """A step-cost table (speculative/cost_model.py) on which drafting pays at the drafters' prior
    acceptance, so the adaptive policy drafts from the first step: 10 ms a step, 1 ms a request,
    0.1 ms a verified draft row, the drafters almost free (a draft pays from a 1% chance at batch
    1, 4% at batch 8). Tests freeze it for identical decisions."""
    if not _CHEAP_TABLE:
        import json
        import tempfile

        path = os.path.join(tempfile.mkdtemp(prefix="specserve-cost-"), "cheap_drafting.json")
        with open(path, "w") as f:
            json.dump({"coefficients_s": {"fixed": 0.01, "requests": 0.001, "verify_rows": 0.0001,
                                          "model_draft_step": 0.0002, "model_draft_rows": 0.00001,
                                          "lookup_requests": 0.00001, "verify_step": 0.0}}, f)
        _CHEAP_TABLE.append(path)
    return _CHEAP_TABLE[0]


def policy_args() -> dict:
    """Engine kwargs: the adaptive policy on the cheap table, frozen, pricing drafts as when serving
    (the tests' closed batches would otherwise draft only where a draft saves its row's cost)."""
    return {"speculative_cost_table_path": cheap_drafting_table(), "speculative_freeze_cost_table": True,
            "speculative_disable_closed_batch_pricing": True}
