"""HostKVPool: host copies of device token slots, the host tier under the radix prefix cache.

Host slots come from their own free list (1..size; row 0 is unused, like the device's scratch
slot). Backups (device -> host) run on the copy stream after the forward stream's work that wrote
the KV, and return an event the caller waits on before relying on the copy. Loads (host -> device)
run on the forward stream and are waited for, so a host slot is never reused under a pending copy.
"""

from __future__ import annotations

from typing import Optional

import torch

from specserve.kv.pool import KVPool, TokenSlotAllocator
from specserve.runtime.stream import Event, Stream


class HostKVPool:
    """Host copies of token slots for every device pool (the target's and the drafter's)."""

    def __init__(self, device_pools: list[KVPool], size: int, forward: Stream, copy: Stream):
        self.device_pools = device_pools
        self.size = size
        self.forward, self.copy = forward, copy
        pin = any(p.k[0].device.type == "cuda" for p in device_pools)

        def host_like(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros((size + 1,) + tuple(t.shape[1:]), dtype=t.dtype, pin_memory=pin)

        self.k = [[host_like(t) for t in p.k] for p in device_pools]
        self.v = [[host_like(t) for t in p.v] for p in device_pools]
        self.slots = TokenSlotAllocator(size)  # host slots 1..size, the same free list as the device's

    @property
    def available(self) -> int:
        return self.slots.available

    def alloc(self, n: int) -> Optional[list[int]]:
        return self.slots.alloc(n)

    def release(self, slots: list[int]) -> None:
        self.slots.free(slots)

    def backup(self, device_slots: list[int], host_slots: list[int]) -> Event:
        """Device -> host on the copy stream, after the forward work that wrote these slots."""
        src, dst = torch.tensor(device_slots), torch.tensor(host_slots)
        Event().record(self.forward).wait(self.copy)

        def run() -> None:
            for pool, hk, hv in zip(self.device_pools, self.k, self.v):
                for layer in range(len(pool.k)):
                    hk[layer][dst] = pool.k[layer][src.to(pool.k[layer].device)].to("cpu", non_blocking=True)
                    hv[layer][dst] = pool.v[layer][src.to(pool.v[layer].device)].to("cpu", non_blocking=True)

        self.copy.submit(run)
        return Event().record(self.copy)

    def load(self, host_slots: list[int], device_slots: list[int]) -> None:
        """Host -> device on the forward stream (before the step that reads them); waited for."""
        src, dst = torch.tensor(host_slots), torch.tensor(device_slots)

        def run() -> None:
            for pool, hk, hv in zip(self.device_pools, self.k, self.v):
                for layer in range(len(pool.k)):
                    dev = pool.k[layer].device
                    pool.k[layer][dst.to(dev)] = hk[layer][src].to(dev, non_blocking=True)
                    pool.v[layer][dst.to(dev)] = hv[layer][src].to(dev, non_blocking=True)

        self.forward.submit(run)
        Event().record(self.forward).synchronize()

    def rows(self, device_slots: list[int]) -> dict[str, list[torch.Tensor]]:
        """These slots' K and V of every layer of every pool (for the file tier)."""
        idx = torch.tensor(device_slots)
        return {
            "k": [p.k[i][idx.to(p.k[i].device)].cpu() for p in self.device_pools for i in range(len(p.k))],
            "v": [p.v[i][idx.to(p.v[i].device)].cpu() for p in self.device_pools for i in range(len(p.v))],
        }

    def write_rows(self, device_slots: list[int], rows: dict[str, list[torch.Tensor]]) -> None:
        """Write rows (as returned by `rows`) into these device slots on the forward stream; waited for."""
        idx = torch.tensor(device_slots)

        def run() -> None:
            flat = [(p, i) for p in self.device_pools for i in range(len(p.k))]
            for (pool, i), k, v in zip(flat, rows["k"], rows["v"]):
                pool.k[i][idx.to(pool.k[i].device)] = k.to(pool.k[i].device)
                pool.v[i][idx.to(pool.v[i].device)] = v.to(pool.v[i].device)

        self.forward.submit(run)
        Event().record(self.forward).synchronize()
