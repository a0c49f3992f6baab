"""Starting tensor-parallel ranks: the rendezvous address and this node's rank processes.

Ranks are spread over `nnodes` nodes, `tp_size / nnodes` each; node 0 hosts rank 0 (the engine
that takes requests). What a rank process runs is the caller's (see engine/ranks.py).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import socket
from typing import Callable

from specserve.args import ServerArgs


def rendezvous_addr(args: ServerArgs) -> str:
    """--dist-init-addr, else 127.0.0.1 and a port the OS reports free now."""
    if args.dist_init_addr:
        return args.dist_init_addr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def node_ranks(args: ServerArgs) -> list[int]:
    per_node = args.tp_size // args.nnodes
    return list(range(args.node_rank * per_node, (args.node_rank + 1) * per_node))


def spawn_ranks(args: ServerArgs, addr: str, skip_rank0: bool, target: Callable[[dict, int, str], None]) -> list:
    """Start this node's ranks (but rank 0 with skip_rank0, which the caller runs) as spawned
    processes running `target(args_dict, rank, addr)`."""
    ctx = mp.get_context("spawn")
    procs = []
    for rank in node_ranks(args):
        if rank == 0 and skip_rank0:
            continue
        proc = ctx.Process(target=target, args=(dataclasses.asdict(args), rank, addr),
                           name=f"specserve-tp{rank}", daemon=False)
        proc.start()
        procs.append(proc)
    return procs
