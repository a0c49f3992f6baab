"""Row-parallel layers under TP run their K shards as one chain (TPContext.chain): each rank's
kernel continues the previous rank's float32 sums (`PackedLinear.continue_sums`), so TP N gives the
unsplit layer's result bit for bit on every kernel path and weight format. Adding the shards'
partial sums (what an all-reduce does) rounds differently: the planted version of that is caught."""

from __future__ import annotations

import pytest
import torch

from specserve.kernels import dispatch
from specserve.kernels.linear import pack_bf16
from specserve.models.layers import TPContext, round_to_bf16_like_kernels
from specserve.models.quant import Q4Weight, Q8Weight

PATHS = ["generic", *(p for p in dispatch.available_paths() if p != "generic")]
N, K = 40, 192  # a partial column block; 6 groups of 32


def weight(kind: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    scale = (torch.rand(N, K // 32, generator=g) * 0.02 + 1e-3).half().float()
    if kind == "q4":
        offset = (-8 * scale + torch.randn(N, K // 32, generator=g) * 1e-3).half().float()
        return Q4Weight(torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=g), scale, offset)
    if kind == "q8":
        return Q8Weight(torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g), scale)
    if kind == "q6_k":  # 6-bit codes, float32 scales per 16 columns (GGUF Q6_K)
        scale16 = scale.repeat_interleave(2, dim=1) * torch.randint(1, 64, (N, K // 16), generator=g).float()
        return Q4Weight(torch.randint(0, 64, (N, K), dtype=torch.uint8, generator=g), scale16, -32 * scale16, 16, 6)
    return torch.randn(N, K, generator=g).bfloat16()


def shard(w, start: int, count: int, int8: bool = False):
    """One rank's input columns, packed as RowParallelLinear packs them (int8: with integer activations)."""
    if isinstance(w, torch.Tensor):
        return pack_bf16(w[:, start:start + count].contiguous())
    packed = w.cols(start, count).packed()
    assert packed.quantize_activations(int8) == int8
    return packed


def whole(w, int8: bool = False):
    if isinstance(w, torch.Tensor):
        return pack_bf16(w)
    packed = w.packed()
    assert packed.quantize_activations(int8) == int8
    return packed


class _Broadcasts:
    """An in-process stand-in for the model group: the ranks run one after another in this
    process, each broadcast hands the source rank's tensor to the others."""

    def __init__(self):
        self.last = None

    def broadcast_(self, tensor, site, src, on_model_group):
        assert site == "model.row_parallel_chain" and on_model_group
        self.last = tensor.clone()


def chained(w, x: torch.Tensor, cuts: list[int], int8: bool = False) -> torch.Tensor:
    """What every rank of len(cuts) - 1 ranks ends with, the ranks' shards being [cuts[r], cuts[r+1])."""
    carried = None
    for r in range(len(cuts) - 1):
        kernel, cols = shard(w, cuts[r], cuts[r + 1] - cuts[r], int8), x[:, cuts[r]:cuts[r + 1]].contiguous()
        carried = kernel(cols, torch.float32) if carried is None else kernel.continue_sums(cols, carried)
    return carried


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["q4", "q6_k", "q8", "bf16", "q4-int8", "q6_k-int8", "q8-int8"])
@pytest.mark.parametrize("cuts", [[0, 128, K], [0, 64, 128, K], [0, 32, 64, 160, K]], ids=["tp2", "tp3", "tp4-uneven"])
def test_a_chain_of_shards_is_the_unsplit_layer_bit_for_bit(monkeypatch, kind, path, cuts):
    """Also with integer activations: each 32-column block of a row is quantized alone, so a shard
    quantizes its columns as the unsplit layer does."""
    monkeypatch.setenv("SPECSERVE_CPU_KERNEL_PATH", path)
    kind, _, activations = kind.partition("-")
    w, int8 = weight(kind), activations == "int8"
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(1)).bfloat16()
    full = whole(w, int8)(x, torch.float32)
    assert torch.equal(chained(w, x, cuts, int8), full)
    assert torch.equal(round_to_bf16_like_kernels(full), whole(w, int8)(x, torch.bfloat16))


@pytest.mark.parametrize("kind", ["q4", "q8", "bf16"])
def test_planted_all_reduce_of_partial_sums_is_not_the_unsplit_layer(kind):
    """The detector's mutation: partial sums added after the fact (the old all-reduce) differ from
    the unsplit layer in some bits, so the equality above is a real check."""
    w = weight(kind)
    x = torch.randn(64, K, generator=torch.Generator().manual_seed(1)).bfloat16()
    added = shard(w, 0, 128)(x[:, :128].contiguous(), torch.float32) + shard(w, 128, K - 128)(x[:, 128:].contiguous(),
                                                                                                 torch.float32)
    assert not torch.equal(added, whole(w)(x, torch.float32))


def test_tp_context_chain_runs_the_ranks_in_order_and_every_rank_ends_with_the_last_sums():
    w = weight("q4")
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(3)).bfloat16()
    cuts = [0, 128, K]
    group = _Broadcasts()
    # Rank 1's view: rank 0's broadcast arrives first (simulated by filling the buffer), then its own.
    rank0 = shard(w, 0, 128)(x[:, :128].contiguous(), torch.float32)

    class _Rank1Group(_Broadcasts):
        def broadcast_(self, tensor, site, src, on_model_group):
            if src == 0:
                tensor.copy_(rank0)
            super().broadcast_(tensor, site, src, on_model_group)

    group = _Rank1Group()
    kernel1 = shard(w, 128, K - 128)
    tp = TPContext(rank=1, size=2, group=group)
    out = tp.chain(lambda init: kernel1.continue_sums(x[:, 128:].contiguous(), init), (5, N))
    assert torch.equal(out, chained(w, x, cuts)) and torch.equal(out, whole(w)(x, torch.float32))
