"""The machine's read bandwidth as a decode step's weight stream sees it: a buffer larger than any
cache, read once by every thread (csrc/bindings.cpp stream_read), best of several passes. A
batch-1 step of a model of 1B parameters and up streams the whole file, so its speed is bound by
this figure; the benches report decode as a share of it (weights streamed per token / step time)."""

from __future__ import annotations

import time

import torch

PROBE_BYTES = 1 << 30  # 1 GiB: 30x the largest L3 of these machines
PASSES = 8


def read_bandwidth_gbs(size: int = PROBE_BYTES, passes: int = PASSES, threads: int | None = None) -> float:
    """GB/s (10^9 bytes) of the fastest of `passes` reads of a `size`-byte buffer, on `threads`
    threads (default: torch's current count, which `bench offline` sets to the engine's)."""
    from specserve.kernels.build import load

    buffer = torch.ones(size - size % 64, dtype=torch.uint8)  # written once: its pages are resident
    kernels = load()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        kernels.stream_read(buffer)  # warm: pages touched, threads started
        best = float("inf")
        for _ in range(passes):
            start = time.perf_counter()
            kernels.stream_read(buffer)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return buffer.numel() / best / 1e9


def share_of_bandwidth(bytes_per_token: float, tokens_per_s: float, bandwidth_gbs: float) -> float:
    """The fraction of the read bandwidth a decode at `tokens_per_s` uses streaming its weights."""
    return bytes_per_token * tokens_per_s / (bandwidth_gbs * 1e9)


def gguf_step_bytes(path: str) -> int:
    """Bytes of a GGUF file's tensors that a batch-1 step of llama.cpp reads: all but the token
    embedding table (one row of it is read), which is read whole only as the tied head of a file
    without `output.weight`; of a mixture's stacked experts (`*_exps`), the share a token routes
    to (expert_used_count of expert_count)."""
    from specserve.bench.synth_payload import tensor_bytes
    from specserve.models.gguf_file import GGUFFile

    reader = GGUFFile(path, header_only=True)
    arch = reader.fields.get("general.architecture")
    experts = reader.fields.get(f"{arch}.expert_count", 0)
    used = reader.fields.get(f"{arch}.expert_used_count", 0) / experts if experts else 1.0
    tied = not any(i.name == "output.weight" for i in reader.infos)

    def read(info) -> float:
        return tensor_bytes(info) * (used if info.name.endswith("_exps.weight") else 1.0)

    return int(sum(read(i) for i in reader.infos if tied or i.name != "token_embd.weight"))
