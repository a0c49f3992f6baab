"""DSpark drafter checkpoints: a directory with config.json (DsparkConfig) and model.safetensors."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Callable, Optional

import torch

from specserve.errors import ConfigError
from specserve.models.backend import select_backend
from specserve.models.config import ModelConfig
from specserve.models.dspark import DsparkConfig, DsparkDrafter

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def init_drafter(cfg: DsparkConfig, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Randomly initialised weights (normal(0, std), norms at 1), as a state dict."""
    gen = torch.Generator().manual_seed(seed)
    model = DsparkDrafter(cfg, max_positions=1)
    state = {}
    for name, tensor in model.state_dict().items():
        if not tensor.is_floating_point():  # the draft-to-target map: set by whoever picks the vocabulary
            state[name] = tensor.clone()
        elif name.endswith("norm.weight") or "layernorm" in name:
            state[name] = torch.ones_like(tensor)
        elif name.endswith(".bias"):
            state[name] = torch.zeros_like(tensor)
        else:
            state[name] = torch.randn(tensor.shape, generator=gen) * std
    return state


def save_drafter(
    out_dir: str, cfg: DsparkConfig, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> None:
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(asdict(cfg), f, indent=2)
    tensors = {
        k: v.detach().contiguous().to(dtype) if v.is_floating_point() else v.detach().contiguous() for k, v in state.items()
    }
    save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE))


def read_drafter_config(path: str) -> DsparkConfig:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise ConfigError(f"speculative_draft_model_path: no {CONFIG_FILE} in {path!r}")
    with open(file) as f:
        raw = json.load(f)
    if raw.get("architecture") != "dspark":
        raise ConfigError(f"speculative_draft_model_path: {file} is not a DSpark drafter config")
    known = DsparkConfig.__dataclass_fields__
    return DsparkConfig(**{k: v for k, v in raw.items() if k in known})


def load_drafter(
    path: str,
    target: ModelConfig,
    dtype: torch.dtype,
    device: str,
    max_positions: int,
    block_size: Optional[int] = None,
    embed: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    lm_head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    q8_weights: bool = False,
    per_op_layers: bool = False,
) -> DsparkDrafter:
    """Read config.json + model.safetensors; `block_size` overrides the checkpoint's gamma. Given
    the target's `embed` and `lm_head`, the drafter comes back attached to them, ready to draft.
    `q8_weights`: its linears and reduced head computed from Q8_0 codes (CPU kernels);
    `per_op_layers`: draft op by op on the CPU kernels, not through the native block."""
    from safetensors.torch import load_file

    cfg = read_drafter_config(path)
    cfg.validate_for(target)
    if block_size is not None:
        cfg.block_size = block_size
    model = DsparkDrafter(cfg, max_positions)
    state = load_file(os.path.join(path, WEIGHTS_FILE))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(
            f"speculative_draft_model_path: weights do not match the config: missing {missing}, unexpected {unexpected}"
        )
    model.to(device)
    for p in model.parameters():  # parameters only: the RoPE tables stay float32, as the target's do
        p.requires_grad_(False)
        p.data = p.data.to(dtype)
    if q8_weights:
        model.quantize_weights()
    model.use_backend(select_backend(device, dtype, per_op_layers=per_op_layers))
    if embed is not None and lm_head is not None:
        model.attach_target(embed, lm_head)
    return model.eval()
