"""How much memory a rank may take: the KV pool's size and the check, before any weight is packed,
that the model and its KV pool fit in the memory the host has free (docs/models.md "Loading").

A GGUF's packed weights take about the file's size (every format keeps the file's bits per weight,
kernels/linear.py), so the file size stands for the model; a Hugging Face directory's is the sum of
its .safetensors files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from specserve.errors import ConfigError

DEFAULT_KV_FRACTION = 0.1  # of total RAM: the most a default KV pool takes (of free GPU memory on CUDA)
HEADROOM_BYTES = 1 << 30  # left free by a default KV pool: torch's runtime, step buffers, the server process
MIN_DEFAULT_KV_TOKENS = 4096  # a default pool below this (or one full context, if shorter) does not start
GIB = 1 << 30


@dataclass(frozen=True)
class KVRequest:
    """What sizes one rank's KV pool: its bytes per token slot, the most slots the engine can use
    (every running request at its full context) and the rank's share of the host."""

    bytes_per_token: int
    max_useful_tokens: int
    context_tokens: int  # one request at the full context length
    model_bytes: int  # this rank's weights (its share of the files)
    ranks_on_host: int = 1


def available_memory() -> int:
    """Bytes the host can still hand out without swapping: MemAvailable from /proc/meminfo (free
    pages plus the page cache it can drop), else the free pages (os.sysconf)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def weights_bytes(path: str) -> int:
    """A weights file's size, or the sum of a checkpoint folder's `.safetensors` files."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def cpu_kv_tokens(req: KVRequest, fraction: Optional[float], max_total_tokens: Optional[int]) -> int:
    """Token slots of a CPU rank's KV pool, after checking that they and the model fit.

    `max_total_tokens`, else `fraction` of total RAM, are taken as given. The default is what the
    model leaves: at most DEFAULT_KV_FRACTION of RAM, never more than the available memory less the
    model and HEADROOM_BYTES, nor more slots than every running request at full context can use,
    and at least MIN_DEFAULT_KV_TOKENS (or one full context, if shorter)."""
    available = available_memory() // req.ranks_on_host
    if max_total_tokens is not None:
        tokens = max_total_tokens
    elif fraction is not None:
        tokens = int(total_memory() * fraction // req.ranks_on_host // req.bytes_per_token)
    else:
        room = min(total_memory() * DEFAULT_KV_FRACTION // req.ranks_on_host, available - req.model_bytes - HEADROOM_BYTES)
        floor = min(MIN_DEFAULT_KV_TOKENS, req.context_tokens, req.max_useful_tokens)
        tokens = max(floor, min(int(room // req.bytes_per_token), req.max_useful_tokens))
    check_fit(req.model_bytes, max(16, tokens) * req.bytes_per_token, available)
    return max(16, tokens)


def check_fit(model_bytes: int, kv_bytes: int, available: int) -> None:
    """One line, before anything is packed, where the model and its KV pool exceed what is free."""
    if model_bytes + kv_bytes > available:
        raise ConfigError(
            f"memory: the model needs {model_bytes / GIB:.2f} GiB (file) + {kv_bytes / GIB:.2f} GiB (KV pool) "
            f"but only {available / GIB:.2f} GiB of memory is available "
            "(lower --max-total-tokens or --mem-fraction-static, or free memory)"
        )
