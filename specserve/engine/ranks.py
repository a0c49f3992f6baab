"""Tensor-parallel rank processes: every rank but 0 builds its shard of the engine and steps as
rank 0 commands until it says shutdown. A rank that fails exits non-zero; the others then fail
their next collective within the timeout instead of hanging."""

from __future__ import annotations

import logging
import sys
import traceback

from specserve.args import ServerArgs
from specserve.distributed.group import DistConfig
from specserve.distributed.launch import rendezvous_addr, spawn_ranks

logger = logging.getLogger(__name__)


def spawn_rank_workers(args: ServerArgs, addr: str, skip_rank0: bool) -> list:
    """This node's rank processes (but rank 0 with skip_rank0, which the caller runs)."""
    return spawn_ranks(args, addr, skip_rank0, rank_main)


def rank_main(args_dict: dict, rank: int, addr: str) -> None:
    """A non-zero rank: build the engine shard, follow rank 0's steps, exit non-zero on failure."""
    from specserve.engine.engine import Engine

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
    procs = spawn_rank_workers(args, rendezvous_addr(args), skip_rank0=False)
    codes = []
    for proc in procs:
        proc.join()
        codes.append(proc.exitcode)
    return max(codes, default=0)
