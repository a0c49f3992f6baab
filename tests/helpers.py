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
    while inside; yields how many linears switched."""
    from specserve.kernels.linear import PackedLinear

    kernels = [m.kernel for m in model.modules() if isinstance(getattr(m, "kernel", None), PackedLinear)]
    try:
        yield sum(k.quantize_activations() for k in kernels)
    finally:
        for k in kernels:
            k.quantize_activations(False)


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
                                          "dspark_step": 0.0002, "dspark_rows": 0.00001,
                                          "ngram_requests": 0.00001, "verify_step": 0.0}}, f)
        _CHEAP_TABLE.append(path)
    return _CHEAP_TABLE[0]


def policy_args() -> dict:
    """Engine kwargs: the adaptive policy on the cheap table, frozen."""
    return {"speculative_cost_table_path": cheap_drafting_table(), "speculative_freeze_cost_table": True}
