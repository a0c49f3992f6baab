"""Starting tensor-parallel ranks: the rendezvous address and this node's rank processes.

Ranks are spread over `nnodes` nodes, `tp_size / nnodes` each; node 0 hosts rank 0 (the engine
that takes requests). What a rank process runs is the caller's (see engine.rank_main). Rank 0
watches the processes it spawned while the engine starts: one that exits fails the start-up at
once, with its rank, its exit code and the likely cause.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import signal
import socket
from typing import Any, Callable, Optional

from specserve.args import ServerArgs

GUARD_HINT = (
    'the likely cause: the script that builds Engine(tp_size > 1) has no `if __name__ == "__main__":` '
    "guard; each rank process is spawned and re-imports the main module, which must not build an "
    "engine at import time"
)


class RankStartupError(RuntimeError):
    """A tensor-parallel rank did not start: its process exited, or it never joined the rendezvous."""


@dataclasses.dataclass
class RankProcess:
    """A spawned rank process and a flag its target sets first (so an exit before it ran is told apart)."""

    rank: int
    proc: Any  # multiprocessing's spawn Process
    started: Any  # a multiprocessing Event

    def failure(self) -> Optional[str]:
        """Why this rank stopped while the engine starts, or None while it runs."""
        code = self.proc.exitcode
        if code is None:
            return None
        what = f"tensor-parallel rank {self.rank} (pid {self.proc.pid})"
        if code < 0:
            return f"{what} was killed by signal {_signal_name(-code)} while the engine started (out of memory?)"
        if not self.started.is_set():
            return (
                f"{what} exited with code {code} during spawn start-up, before its rank code ran "
                f"(its traceback is above); {GUARD_HINT}"
            )
        return f"{what} exited with code {code} while the engine started (its log is above)"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def first_failure(procs: list[RankProcess]) -> Optional[str]:
    """The first rank process that has exited, described; None while all run."""
    for rp in procs:
        failure = rp.failure()
        if failure is not None:
            return failure
    return None


def rendezvous_addr(args: ServerArgs) -> str:
    """--dist-init-addr, else 127.0.0.1 and a port the OS reports free now. On one node the store
    listens on 127.0.0.1 whatever the address names (see distributed/group.py)."""
    if args.dist_init_addr:
        if args.nnodes == 1:
            return f"127.0.0.1:{args.dist_init_addr.rsplit(':', 1)[1]}"
        return args.dist_init_addr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def node_ranks(args: ServerArgs) -> list[int]:
    per_node = args.tp_size // args.nnodes
    return list(range(args.node_rank * per_node, (args.node_rank + 1) * per_node))


def spawn_ranks(
    args: ServerArgs, addr: str, skip_rank0: bool, target: Callable[[dict, int, str, Any], None]
) -> list[RankProcess]:
    """Start this node's ranks (but rank 0 with skip_rank0, which the caller runs) as spawned
    processes running `target(args_dict, rank, addr, started)`; the target sets `started` first."""
    ctx = mp.get_context("spawn")
    procs = []
    for rank in node_ranks(args):
        if rank == 0 and skip_rank0:
            continue
        started = ctx.Event()
        proc = ctx.Process(
            target=target, args=(dataclasses.asdict(args), rank, addr, started), name=f"specserve-tp{rank}", daemon=False
        )
        proc.start()
        procs.append(RankProcess(rank, proc, started))
    return procs
