"""Host values onto the device without waiting for it.

`torch.tensor(values, device=cuda)` copies from pageable memory with a blocking copy, which
synchronises the current stream: inside a step's launch that waits for the previous step
(pytorch/pytorch#120996). `staged` builds the tensor on the host, pins it on CUDA and copies it
non-blocking, so the copy is queued behind the stream's work instead (the pinned block is kept
by PyTorch's host allocator until the copy has run). On CPU it is the host tensor itself.
"""

from __future__ import annotations

from typing import Any

import torch


def staged(values: Any, dtype: torch.dtype, device: "str | torch.device") -> torch.Tensor:
    """`values` (numbers, nested lists) as a `dtype` tensor on `device`, queued without a wait."""
    host = torch.tensor(values, dtype=dtype)
    target = torch.device(device)
    if target.type == "cuda":
        host = host.pin_memory()
    return host.to(target, non_blocking=True)
