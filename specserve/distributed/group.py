"""Tensor-parallel process groups with named, time-bounded collectives.

Each rank builds its groups from one TCPStore rendezvous (no torch.distributed default group, so
one process can build, tear down and rebuild engines): the model group (gloo on CPU, NCCL on
CUDA) for the forward pass, a gloo control group for scheduler broadcasts and agreements, and a
dedicated gloo group for the rank consensus checker's background thread.

On one node (`DistConfig.loopback`) the store and every gloo group listen on 127.0.0.1 only.
Before any group is built every rank joins a barrier on the store; rank 0 polls it while
watching the rank processes it spawned, so a rank that dies while starting fails rank 0 within
a second (RankStartupError) instead of after the connect timeout. Objects cross ranks as JSON
(distributed/wire.py), never pickled.

Every control collective names its site. A collective that does not complete within
`--collective-timeout` raises CollectiveTimeout naming the site, the rank and what it waited for:
the process fails loudly instead of hanging.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from specserve import envs
from specserve.args import ServerArgs
from specserve.distributed import wire
from specserve.distributed.launch import RankStartupError

logger = logging.getLogger(__name__)

DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 300.0
JOIN_POLL_S = 0.1  # how often rank 0 looks at the join count and its spawned ranks while starting
LOOPBACK = "127.0.0.1"


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time: some rank diverged, died or skipped it."""


@dataclass(frozen=True)
class DistConfig:
    """Where this rank sits: `addr` is host:port of the rendezvous store (hosted by rank 0).
    `loopback`: every rank on this node, so the store and gloo listen on 127.0.0.1 only. `watch`:
    polled while joining, a reason to give up or None (rank 0: a spawned rank exited; the others:
    the process that spawned them exited)."""

    rank: int
    world_size: int
    addr: str
    timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    device: str = "cpu"
    loopback: bool = True
    watch: Optional[Callable[[], Optional[str]]] = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, args: ServerArgs, rank: int, addr: str, watch: Optional[Callable[[], Optional[str]]] = None) -> "DistConfig":
        """This rank's place in the group; on one node everything listens on loopback only."""
        return cls(rank, args.tp_size, addr, args.collective_timeout, args.device, loopback=args.nnodes == 1, watch=watch)


class TPGroup:
    """This rank's groups and the collectives the engine uses, each with a site name and a timeout."""

    def __init__(self, cfg: DistConfig):
        self.cfg = cfg
        self.rank, self.size = cfg.rank, cfg.world_size
        self.timeout = timedelta(seconds=cfg.timeout_s)  # per collective, enforced by each wait
        # Connecting waits for every rank to start (model loading included): a separate, longer bound.
        self.connect_timeout = timedelta(seconds=max(cfg.timeout_s, CONNECT_TIMEOUT_S))
        self.timeouts = 0  # collectives that failed or timed out on this rank (the soak's "hangs")
        self._starting = True  # see started()
        self.store = self._open_store()
        self._join()
        self.control = self._gloo("control")
        self.monitor = self._gloo("consensus")
        # One group per thread that issues collectives, so their orders can never interleave:
        # control (the scheduler thread), model (the forward stream), consensus (the checker).
        self.model = self._gloo("model") if not cfg.device.startswith("cuda") else self._nccl()
        self._bcast_len = torch.zeros(1, dtype=torch.int64)
        self._skip = os.environ.get(envs.FAULT_SKIP_COLLECTIVE) or None  # test hook "SITE:RANK"
        self.failed: Optional[CollectiveTimeout] = None  # the first collective that failed

    def _open_store(self):
        host, port = self.cfg.addr.rsplit(":", 1)
        listen_fd = None
        if self.rank == 0 and self.cfg.loopback:  # TCPStore given a host still listens on every interface
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((LOOPBACK, int(port)))
            sock.listen(128)
            listen_fd, host = sock.detach(), LOOPBACK  # the store owns (and closes) the socket
        return dist.TCPStore(
            host,
            int(port),
            self.size,
            is_master=self.rank == 0,
            timeout=self.connect_timeout,
            wait_for_workers=False,
            master_listen_fd=listen_fd,
        )

    def _join(self) -> None:
        """Every rank counts itself in; wait (polling, and consulting `watch`: on rank 0, the spawned ranks)
        until all have, so that building the groups below cannot block on a dead rank."""
        self.store.add("joined", 1)
        deadline = time.monotonic() + self.connect_timeout.total_seconds()
        while int(self.store.add("joined", 0)) < self.size:
            failure = self.cfg.watch() if self.cfg.watch is not None else None
            if failure is not None:
                raise RankStartupError(failure)
            if time.monotonic() > deadline:
                raise RankStartupError(
                    f"tensor-parallel rendezvous at {self.cfg.addr}: only "
                    f"{int(self.store.add('joined', 0))} of {self.size} ranks joined within "
                    f"{self.connect_timeout.total_seconds():.0f} s"
                )
            time.sleep(JOIN_POLL_S)

    def _gloo(self, name: str):
        store = dist.PrefixStore(name, self.store)
        if not self.cfg.loopback:  # several nodes: gloo picks the interface the hostname resolves to
            return dist.ProcessGroupGloo(store, self.rank, self.size, self.connect_timeout)
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # in torch, missing from its stubs
        opts._timeout = self.connect_timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
        return dist.ProcessGroupGloo(store, self.rank, self.size, opts)

    def _nccl(self):  # imported lazily: no GPU-only code at module load
        if self.cfg.loopback:  # NCCL's bootstrap sockets too (a user's own setting wins)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        opts = dist.ProcessGroupNCCL.Options()
        return dist.ProcessGroupNCCL(dist.PrefixStore("model", self.store), self.rank, self.size, opts)

    # ------------------------------------------------------------ collectives with sites

    def _arrive(self, site: str, pg=None) -> None:
        """Before a collective: the engine's groups, once one failed, fail again at once with the
        first error (the one worth reporting; the consensus group keeps working for a last check);
        test hook: the named rank never arrives at the named site."""
        if self.failed is not None and pg is not self.monitor:
            raise CollectiveTimeout(str(self.failed)) from self.failed
        if self._skip is not None and self._skip == f"{site}:{self.rank}":
            logger.critical("fault injection: rank %d skips the collective at site '%s'", self.rank, site)
            time.sleep(3 * self.cfg.timeout_s)
            os._exit(4)

    def started(self) -> None:
        """The engine is built: from now on every collective waits at most the collective timeout
        (while ranks load their models, whose times differ, the connect timeout bounds them)."""
        self._starting = False

    def _wait(self, work, site: str, what: str, group_name: str = "control") -> None:
        timeout = self.connect_timeout if self._starting else self.timeout
        try:
            work.wait(timeout)
        except Exception as exc:  # gloo reports a timeout (or a dead peer) as a RuntimeError
            msg = (
                f"collective timeout at site '{site}' on rank {self.rank}/{self.size}: waited up to "
                f"{timeout.total_seconds():.0f} s for {what} on the {group_name} group ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''})"
            )
            logger.critical(msg)
            self.timeouts += 1
            error = CollectiveTimeout(msg)
            if group_name != "consensus":
                self.failed = self.failed or error
            raise error from exc

    def broadcast_(self, tensor: torch.Tensor, site: str, src: int = 0, on_model_group: bool = False) -> torch.Tensor:
        """In place: every rank gets rank `src`'s contents of a tensor (control group: CPU tensors;
        model group: the forward stream's tensors, from that stream's thread)."""
        self._arrive(site)
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        pg, name = (self.model, "model") if on_model_group else (self.control, "control")
        self._wait(pg.broadcast([tensor], opts), site, f"broadcast of {tuple(tensor.shape)} from rank {src}", name)
        return tensor

    def all_reduce_(self, tensor: torch.Tensor, site: str, op: str = "sum", group: Optional[Any] = None) -> torch.Tensor:
        self._arrive(site, group)
        opts = dist.AllreduceOptions()
        reduce_op = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
        opts.reduceOp = reduce_op  # type: ignore[assignment]  # torch's stubs: RedOpType converts to ReduceOp
        pg = group or self.control
        name = "consensus" if pg is self.monitor else "control"
        self._wait(pg.allreduce([tensor], opts), site, f"all-reduce {op.upper()} of {tuple(tensor.shape)}", name)
        return tensor

    def all_gather_json(self, obj: Any, site: str, group: Optional[Any] = None) -> list[Any]:
        """Every rank's `obj` as JSON decodes it (tuples become lists), in rank order."""
        self._arrive(site, group)
        pg = group or self.control
        name = "consensus" if pg is self.monitor else "control"
        data = torch.frombuffer(bytearray(wire.encode(obj)), dtype=torch.uint8)
        length = torch.tensor([data.numel()], dtype=torch.int64)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._wait(pg.allgather([lengths], [length]), site, "all-gather of lengths", name)
        longest = int(max(int(n) for n in lengths))
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        outs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.size)]
        self._wait(pg.allgather([outs], [padded]), site, "all-gather of payloads", name)
        return [wire.decode(o[: int(n)].numpy().tobytes(), site, self.rank) for o, n in zip(outs, lengths)]

    def broadcast_json(self, obj: Any, site: str) -> Any:
        """Rank 0's `obj` on every rank, as JSON decodes it (others pass None; rank 0 keeps its own)."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(wire.encode(obj)), dtype=torch.uint8)
            self._bcast_len[0] = data.numel()
        self.broadcast_(self._bcast_len, site)
        if self.rank != 0:
            data = torch.empty(int(self._bcast_len[0]), dtype=torch.uint8)
        self.broadcast_(data, site)
        return obj if self.rank == 0 else wire.decode(data.numpy().tobytes(), site, self.rank)

    # ------------------------------------------------------------ the model's collectives (forward stream)

    def model_all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        self._arrive("model.all_reduce")
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]  # torch's stubs: RedOpType converts to ReduceOp
        self._wait(self.model.allreduce([tensor], opts), "model.all_reduce", f"all-reduce of {tuple(tensor.shape)}", "model")
        return tensor

    def model_all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self._arrive("model.all_gather")
        outs = [torch.empty_like(tensor) for _ in range(self.size)]
        self._wait(
            self.model.allgather([outs], [tensor.contiguous()]),
            "model.all_gather",
            f"all-gather of {tuple(tensor.shape)}",
            "model",
        )
        return outs

    def close(self) -> None:
        for pg in {id(g): g for g in (self.control, self.monitor, self.model)}.values():
            shutdown = getattr(pg, "shutdown", None)
            if shutdown is not None:
                try:
                    shutdown()
                except Exception:  # best effort at teardown
                    pass
