"""`specserve serve --node-rank K` (K > 0): a node that hosts tensor-parallel ranks but not rank 0.

Each rank process runs `engine.rank_main`: it builds its shard of the engine and steps as rank 0
commands until it says shutdown (see distributed/launch.py for how ranks are spawned and watched).
"""

from __future__ import annotations

from specserve.args import ServerArgs
from specserve.distributed.launch import rendezvous_addr, spawn_ranks
from specserve.engine.engine import rank_main


def run_node_workers(args: ServerArgs) -> int:
    """Run this node's ranks until they exit; the worst exit code."""
    procs = spawn_ranks(args, rendezvous_addr(args), False, rank_main)
    codes = []
    for rp in procs:
        rp.proc.join()
        codes.append(rp.proc.exitcode)
    return max(codes, default=0)
