"""ForwardBatch: the tensors one model forward pass reads (no scheduler state)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.models.attention import AttentionMetadata


@dataclass
class ForwardBatch:
    """Flat new tokens of every request in the batch, and where their K/V go."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T] token slots receiving this step's K/V
    attn: AttentionMetadata
    logit_rows: torch.Tensor  # rows of the flat batch whose logits are wanted
    capture_layer_ids: tuple[int, ...] = ()  # decoder layers whose outputs the drafter reads
    captured_hidden: torch.Tensor | None = None  # [T, len(capture_layer_ids) * H], filled by the model
    rope_cos: torch.Tensor | None = None  # [T, 1, D/2], filled by the model once per pass
    rope_sin: torch.Tensor | None = None
