"""The prefix cache of one rank: the radix tree, or with --enable-hierarchical-cache the HiRadixCache
over a host pool (and the file tier)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from specserve import drafters
from specserve.args import ServerArgs
from specserve.distributed.consensus import RankConsensusChecker
from specserve.distributed.group import TPGroup
from specserve.kv.pool import KVPool, TokenSlotAllocator
from specserve.kv.radix_cache import RadixCache
from specserve.models.loader import resolve_model_path
from specserve.runtime.stream import Stream

if TYPE_CHECKING:
    from specserve.kv.file_storage import FileKVStorage


def build_prefix_cache(
    args: ServerArgs,
    size: int,
    allocator: TokenSlotAllocator,
    device_pools: list[KVPool],
    streams: tuple[Stream, Stream],
    dist: Optional[TPGroup],
    tp_rank: int,
    consensus: Optional[RankConsensusChecker],
) -> RadixCache:
    """The radix cache, or with --enable-hierarchical-cache a HiRadixCache over a host pool (and
    with --hicache-storage-backend, the file tier)."""
    if not args.enable_hierarchical_cache:
        return RadixCache(allocator.free, disabled=args.disable_radix_cache, consensus=consensus)
    from specserve.kv.hiradix_cache import HiRadixCache
    from specserve.kv.host_pool import HostKVPool

    host = HostKVPool(device_pools, args.hicache_size or max(16, int(size * args.hicache_ratio)), *streams)

    def agree_min(value: int, site: str) -> int:
        if dist is None:
            return value
        return int(dist.all_reduce_(torch.tensor([value]), site, op="min")[0])

    storage = _file_tier(args, device_pools, tp_rank) if args.hicache_storage_backend else None
    return HiRadixCache(allocator, host, args.hicache_write_policy, storage, agree_min, consensus)


def _file_tier(args: ServerArgs, device_pools: list[KVPool], tp_rank: int) -> "FileKVStorage":
    """This rank's file tier (its share of --hicache-storage-max-bytes), keyed by everything that
    decides the bytes of a page: a page made under any other setting is a miss."""
    from specserve.kv.file_storage import KV_FORMAT_VERSION, FileKVStorage, PageLayout, StorageFingerprint, path_identity

    declared = drafters.of(args.speculative_algorithm)
    drafter = args.speculative_draft_model_path if declared is not None and declared.kv_in_prefix_cache else None
    fingerprint = StorageFingerprint(
        model=path_identity(resolve_model_path(args.model_path)),
        drafter=path_identity(drafter),
        kv_dtype=str(device_pools[0].k[0].dtype),
        tp_size=args.tp_size,
        tp_rank=tp_rank,
        kernel=f"v{KV_FORMAT_VERSION}:{torch.device(args.device).type}:{args.quantization}:{args.cpu_activations}"
        + (f":drafter-{args.speculative_draft_weights}" if drafter else ""),
    )
    assert args.hicache_storage_dir is not None, "args validation: the file tier needs its directory"
    budget = max(1, args.hicache_storage_max_bytes // args.tp_size)
    return FileKVStorage(args.hicache_storage_dir, fingerprint, PageLayout.of_pools(device_pools), budget)
