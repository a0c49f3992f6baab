"""Starting tensor-parallel ranks: rendezvous address, local rank processes, their main loop.

Ranks are spread over `nnodes` nodes, `tp_size / nnodes` each; node 0 hosts rank 0 (the engine
that takes requests). Every other rank runs `rank_main`: build its shard of the engine, then step
as rank 0 commands until it says shutdown. A rank that fails exits non-zero; the others then fail
their next collective within the timeout instead of hanging.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import socket
import sys
import traceback

from specserve.args import ServerArgs

logger = logging.getLogger(__name__)


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


def spawn_local_workers(args: ServerArgs, addr: str, skip_rank0: bool) -> list:
    """Start this node's ranks (but rank 0, which the caller runs) as spawned processes."""
    ctx = mp.get_context("spawn")
    procs = []
    for rank in node_ranks(args):
        if rank == 0 and skip_rank0:
            continue
        proc = ctx.Process(target=rank_main, args=(dataclasses.asdict(args), rank, addr),
                           name=f"specserve-tp{rank}", daemon=False)
        proc.start()
        procs.append(proc)
    return procs


def rank_main(args_dict: dict, rank: int, addr: str) -> None:
    """A non-zero rank: build the engine shard, follow rank 0's steps, exit non-zero on failure."""
    from specserve.distributed.group import DistConfig
    from specserve.engine import Engine

    args = ServerArgs.from_kwargs(**args_dict)
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    engine = None
    try:
        engine = Engine.for_rank(args, DistConfig(rank, args.tp_size, addr, args.collective_timeout, args.device))
        with engine.sanitized():
            while engine.follow():
                pass
    except BaseException:
        logger.critical("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        sys.stdout.flush()
        sys.exit(1)
    finally:
        if engine is not None and engine.runner is not None:
            engine.runner.close()


def run_node_workers(args: ServerArgs) -> int:
    """`specserve serve --node-rank K` (K > 0): run this node's ranks until they exit."""
    procs = spawn_local_workers(args, rendezvous_addr(args), skip_rank0=False)
    codes = []
    for proc in procs:
        proc.join()
        codes.append(proc.exitcode)
    return max(codes, default=0)
