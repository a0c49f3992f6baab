"""The machine's read bandwidth as a decode step's weight stream sees it: a buffer larger than any
cache, read once by every thread (csrc/bindings.cpp stream_read), best of several passes. A
batch-1 step of a model of 1B parameters and up streams the whole file, so its speed is bound by
this figure; the benches report decode as a share of it (weights streamed per token / step time)."""

from __future__ import annotations

import time

import torch

PROBE_BYTES = 1 << 30  # 1 GiB: 30x the largest L3 of these machines
PASSES = 8


def read_bandwidth_gbs(size: int = PROBE_BYTES, passes: int = PASSES) -> float:
    """GB/s (10^9 bytes) of the fastest of `passes` reads of a `size`-byte buffer."""
    from specserve.kernels.build import load

    buffer = torch.ones(size - size % 64, dtype=torch.uint8)  # written once: its pages are resident
    kernels = load()
    kernels.stream_read(buffer)  # warm: pages touched, threads started
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        kernels.stream_read(buffer)
        best = min(best, time.perf_counter() - start)
    return buffer.numel() / best / 1e9


def share_of_bandwidth(bytes_per_token: float, tokens_per_s: float, bandwidth_gbs: float) -> float:
    """The fraction of the read bandwidth a decode at `tokens_per_s` uses streaming its weights."""
    return bytes_per_token * tokens_per_s / (bandwidth_gbs * 1e9)


def gguf_step_bytes(path: str) -> int:
    """Bytes of a GGUF file's tensors that a batch-1 step of llama.cpp reads: all but the token
    embedding table (one row of it is read), which is read whole only as the tied head of a file
    without `output.weight`."""
    from specserve.bench.synth_model import tensor_bytes
    from specserve.models.gguf_file import GGUFFile

    infos = GGUFFile(path, header_only=True).infos
    tied = not any(i.name == "output.weight" for i in infos)
    return sum(tensor_bytes(i) for i in infos if tied or i.name != "token_embd.weight")
