"""What `specserve serve` says when it starts: one short block (model, compute, KV cache, weight
cache, speculation, address) once the engine is up, then one "ready" line once the server answers, as
SGLang's and llama.cpp's servers do. Logged at INFO (the default for `serve`; `--log-level
warning` quiets them)."""

from __future__ import annotations

import logging
import os
import threading
import time
import urllib.request
from typing import Any

from specserve import drafters as registry
from specserve.models.packed_cache_cap import describe_bytes
from specserve.models.summary import describe_parameters

logger = logging.getLogger("specserve.startup")

READY_PROBE_TIMEOUT_S = 5.0


def startup_block(name: str, info: dict[str, Any], url: str, seconds: float) -> str:
    """The block's text, from the engine's ready info (engine_process._ready_info)."""
    model = info["model"]
    weights = ", ".join(f"{kind} x{count}" for kind, count in model["weights"].items())
    kernels = f"{info['kernel_path']} kernels" if info["kernel_path"] else "torch ops"
    lines = [
        f"serving {name}",
        f"  model        {os.path.basename(info['model_path'])}: {model['architecture']}, "
        f"{describe_parameters(model['parameters'])} parameters; weights {weights}",
        f"  compute      {info['dtype']} on {info['device']}, {kernels}, {info['threads']} threads, TP {info['tp_size']}",
        *_activations(info),
        f"  KV cache     {info['kv_total_tokens']:,} tokens; context {info['context_length']:,}; "
        f"up to {info['max_running_requests']} running requests",
        f"  weight cache {_weight_cache(info['weight_cache'], info['tp_size'])}",
        f"  speculation  {_speculation(info)}",
        f"  engine       pid {info['pid']}, up after {seconds:.1f} s",
        f"  address      {url} (OpenAI API under /v1; /health, /metrics)",
    ]
    return "\n".join(lines)


def _activations(info: dict[str, Any]) -> list[str]:
    """The quantized linears' activations and why (models/activations.py); no line where the flag
    sets nothing (torch ops, or no quantized weights)."""
    if not (info["kernel_path"] and info.get("quantized_linears")):
        return []
    return [f"  activations  {info['cpu_activations']} for the quantized linears ({info['cpu_activations_reason']})"]


def _weight_cache(cache: dict[str, Any], tp_size: int) -> str:
    """Off, reused (mapped), writing (where and how much), or not kept and why (engine/start_cache.py)."""
    if cache["state"] == "off":
        return f"off ({cache['reason']})"
    if cache["state"] == "not kept":
        return f"not kept: {cache['reason']}"
    ranks = f"; each of the {tp_size} TP ranks keeps its own" if tp_size > 1 else ""
    size = describe_bytes(cache["bytes"])
    if cache["state"] == "mapped":
        return f"reused: {cache['path']} ({size}) mapped, nothing written{ranks}"
    cap = describe_bytes(cache["max_bytes"])
    return f"writing {size} to {cache['path']} (cap {cap} over all models, least recently used evicted first){ranks}"


def _speculation(info: dict[str, Any]) -> str:
    if not info["speculative_policy"]:
        return "off"
    drafters = []
    for drafter in info["speculative_drafters"]:
        if drafter in registry.MODELS and info["speculative_draft_model_path"]:
            drafter += f" ({os.path.basename(os.path.normpath(info['speculative_draft_model_path']))})"
        drafters.append(drafter)
    return f"{info['speculative_policy']} policy over {', '.join(drafters)}, up to {info['num_draft_tokens']} drafts a step"


class ReadyAnnouncer:
    """Logs the "ready" line once the HTTP server has started and answers /health; joined at exit."""

    def __init__(self, server, url: str, started_at: float):
        self._server, self._url, self._started_at = server, url, started_at
        self._thread = threading.Thread(target=self._run, name="ready-announcer")

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self._thread.join()

    def _run(self) -> None:
        while not self._server.started:
            if self._server.should_exit:
                return
            time.sleep(0.05)
        try:
            with urllib.request.urlopen(self._url + "/health", timeout=READY_PROBE_TIMEOUT_S) as r:
                status = r.status
        except OSError as exc:  # an unhealthy engine answers 503: say so instead of "ready"
            logger.warning("the server started but /health failed: %s", exc)
            return
        logger.info(
            "ready: %s answers (/health %d), %.1f s after start", self._url, status, time.monotonic() - self._started_at
        )
