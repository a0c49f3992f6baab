"""ForwardBatch: the tensors one model forward pass reads (no scheduler state)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from specserve.models.attention import AttentionMetadata
from specserve.models.backend import OpBackend
from specserve.runtime.stream import staged


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
    position_bound: int | None = None  # known on the host: every position is below it (None: unknown)

    @classmethod
    def for_requests(
        cls,
        table: torch.Tensor,
        rows: Sequence[int],
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        input_ids: torch.Tensor,
        slots: Sequence[int],
        every_row: "bool | Sequence[bool]",
        sample: Optional[Sequence[bool]],
        ops: OpBackend,
        capture_layer_ids: tuple[int, ...],
    ) -> "ForwardBatch":
        """One pass over requests (slots `rows` of the request-to-token `table`) that each add
        `extend_lens` tokens after `prefix_lens`: logits for every row (of all requests, or of those
        `every_row` marks), else each sampling request's last."""
        dev = input_ids.device
        logit_rows: list[int] = []
        offset = 0
        for i, n in enumerate(extend_lens):
            offset += n
            if every_row if isinstance(every_row, bool) else every_row[i]:
                logit_rows.extend(range(offset - n, offset))
            elif sample is None or sample[i]:
                logit_rows.append(offset - 1)
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
        positions = [p + i for p, n in zip(prefix_lens, extend_lens) for i in range(n)]
        meta = ops.attention_metadata(table, list(rows), seq_lens, list(extend_lens), dev)
        return cls(
            input_ids=input_ids,
            positions=staged(positions, torch.int64, dev),
            out_cache_loc=staged(list(slots), torch.int64, dev),
            attn=meta,
            logit_rows=staged(logit_rows, torch.int64, dev),
            capture_layer_ids=capture_layer_ids,
            position_bound=max(seq_lens, default=0),
        )
