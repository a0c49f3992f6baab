"""Tensor-parallel rank processes: every rank but 0 builds its shard of the engine and steps as
rank 0 commands until it says shutdown. A rank that fails exits non-zero; the others then fail
their next collective within the timeout instead of hanging, and rank 0, while it starts, at once
(it watches the processes it spawned: see distributed/launch.py)."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import traceback
from typing import Any, Optional

from specserve.args import ServerArgs
from specserve.distributed.commands import ReqCodec
from specserve.distributed.group import DistConfig
from specserve.distributed.launch import RankProcess, rendezvous_addr, spawn_ranks
from specserve.distributed.wire import MalformedPayload
from specserve.errors import InvalidRequestError
from specserve.sampling_params import SamplingParams
from specserve.scheduler.req import Req

logger = logging.getLogger(__name__)


def spawn_rank_workers(args: ServerArgs, addr: str, skip_rank0: bool) -> list[RankProcess]:
    """This node's rank processes (but rank 0 with skip_rank0, which the caller runs)."""
    return spawn_ranks(args, addr, skip_rank0, rank_main)


def dist_config(args: ServerArgs, rank: int, addr: str, watch=None) -> DistConfig:
    """This rank's place in the group; on one node everything listens on loopback only."""
    return DistConfig(rank, args.tp_size, addr, args.collective_timeout, args.device, loopback=args.nnodes == 1, watch=watch)


def rank_main(args_dict: dict, rank: int, addr: str, started) -> None:
    """A non-zero rank: build the engine shard, follow rank 0's steps, exit non-zero on failure."""
    started.set()  # the spawn bootstrap (re-importing the main module) is behind us
    from specserve.engine.engine import Engine

    parent = os.getppid()

    args = ServerArgs.from_kwargs(**args_dict)
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    engine = None
    try:
        engine = Engine.for_rank(args, dist_config(args, rank, addr, watch=lambda: _orphaned(parent)))
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


def _orphaned(parent: int) -> Optional[str]:
    """While joining: the process that spawned this rank is gone (rank 0 will never come)."""
    return None if os.getppid() == parent else f"the process that spawned this rank (pid {parent}) exited"


def run_node_workers(args: ServerArgs) -> int:
    """`specserve serve --node-rank K` (K > 0): run this node's ranks until they exit."""
    procs = spawn_rank_workers(args, rendezvous_addr(args), skip_rank0=False)
    codes = []
    for rp in procs:
        rp.proc.join()
        codes.append(rp.proc.exitcode)
    return max(codes, default=0)


# ------------------------------------------------------------ a request on the wire (the command stream)

REQ_FIELDS: dict[str, type | tuple[type, ...]] = {
    "rid": str,
    "input_ids": list,
    "params": dict,
    "seed": int,
    "drafter": (str, type(None)),
}
PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def encode_req(req: Req) -> dict[str, Any]:
    """What rebuilds a queued request on another rank: the fields Engine._make_req sets."""
    return {
        "rid": req.rid,
        "input_ids": list(req.input_ids),
        "params": dataclasses.asdict(req.params),
        "seed": req.seed,
        "drafter": req.drafter,
    }


def decode_req(data: dict) -> Req:
    """The request rank 0 queued; MalformedPayload if any field is missing, extra or of a wrong type."""
    where = "malformed payload at site 'engine.commands': request"
    if set(data) != set(REQ_FIELDS):
        raise MalformedPayload(f"{where} fields {sorted(data)!r:.200}, expected {sorted(REQ_FIELDS)}")
    for name, kind in REQ_FIELDS.items():
        if not isinstance(data[name], kind) or isinstance(data[name], bool):
            raise MalformedPayload(f"{where} field {name!r}: {type(data[name]).__name__}")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in data["input_ids"]):
        raise MalformedPayload(f"{where} field 'input_ids': not a list of integers")
    if set(data["params"]) != PARAM_FIELDS:
        raise MalformedPayload(f"{where} sampling params {sorted(data['params'])!r:.200}")
    params = SamplingParams(**data["params"])
    try:
        params.validate()
    except InvalidRequestError as exc:
        raise MalformedPayload(f"{where} sampling params: {exc}") from None
    return Req(rid=data["rid"], input_ids=data["input_ids"], params=params, seed=data["seed"], drafter=data["drafter"])


REQ_CODEC = ReqCodec(encode_req, decode_req)
