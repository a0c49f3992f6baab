"""What the start-up block says of a loaded model: architecture, parameter count, weight types."""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import TYPE_CHECKING, Any, Optional

from specserve.models.loader import LoadedModel

if TYPE_CHECKING:
    import torch


def model_summary(loaded: LoadedModel) -> dict[str, Any]:
    """{"architecture", "parameters", "weights": {type: tensor count}} from the file as loaded:
    a GGUF's tensor types (Q4_1, Q8_0, F32, ...), a Hugging Face directory's torch_dtype."""
    if loaded.gguf_reader is not None:
        tensors = loaded.gguf_reader.tensors
        weights = Counter(t.tensor_type.name for t in tensors)
        parameters = sum(int(t.n_elements) for t in tensors)
    else:
        dtype = "unknown dtype"
        config = os.path.join(loaded.path, "config.json")
        if os.path.exists(config):
            with open(config) as f:
                dtype = json.load(f).get("torch_dtype") or dtype
        weights = Counter({dtype: len(loaded.weights)})
        parameters = sum(w.numel() for w in loaded.weights.values())
    return {"architecture": loaded.config.architecture, "parameters": parameters, "weights": dict(weights.most_common())}


def quantized_linears(summary: dict[str, Any]) -> bool:
    """Whether the file holds quantized weights (GGUF Q*/IQ* types): the linears --cpu-activations sets."""
    return any(kind.startswith(("Q", "IQ")) for kind in summary["weights"])


def describe_parameters(count: int) -> str:
    """134515008 -> '134.5M'."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)


def cpu_kernel_path(device: str, dtype: "torch.dtype") -> Optional[str]:
    """The kernel path a bf16 model on CPU runs (avx512_bf16, avx2_fma, generic); None elsewhere
    (fp32 and CUDA run stock torch ops)."""
    from specserve.kernels import dispatch
    from specserve.models.backend import cpu_kernels_apply

    return dispatch.path_name() if cpu_kernels_apply(device, dtype) else None
