"""The SPMD command stream: what rank 0 tells every rank to apply before a step.

Every rank runs its own scheduler over the same commands in the same order, so all ranks
schedule identical batches. Under tensor parallelism the commands of a step are broadcast from
rank 0 on the control group as JSON (a request as the fields that rebuild it: `ReqCodec`, given by
the engine); on one rank they pass through unchanged. A payload that does not decode to commands
raises MalformedPayload; nothing a peer sends is ever executed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from specserve.distributed.group import TPGroup
from specserve.distributed.wire import MalformedPayload, expect
from specserve.errors import InternalError

SITE = "engine.commands"


@dataclass(frozen=True)
class AddRequest:
    """Queue a validated request (the scheduler's Req, seed included, so every rank samples alike)."""

    req: Any


@dataclass(frozen=True)
class AbortRequest:
    rid: str


@dataclass(frozen=True)
class Drain:
    """Process the step still in flight (the overlap loop's last step of a generate call)."""


@dataclass(frozen=True)
class Shutdown:
    """Stop: a last consensus comparison, then every rank leaves its loop."""


@dataclass(frozen=True)
class FlushCache:
    """Drop every cached prefix no request holds, on every rank (`token` names the reply)."""

    token: str


Command = Union[AddRequest, AbortRequest, Drain, Shutdown, FlushCache]


@dataclass(frozen=True)
class ReqCodec:
    """How a request crosses ranks: `encode(req)` gives a JSON-safe dict, `decode(dict)` rebuilds
    the request (raising MalformedPayload on anything unexpected)."""

    encode: Callable[[Any], dict]
    decode: Callable[[dict], Any]


def encode_commands(commands: list[Command], codec: ReqCodec) -> list[dict]:
    out: list[dict] = []
    for c in commands:
        if isinstance(c, AddRequest):
            out.append({"kind": "add", "req": codec.encode(c.req)})
        elif isinstance(c, AbortRequest):
            out.append({"kind": "abort", "rid": c.rid})
        elif isinstance(c, FlushCache):
            out.append({"kind": "flush", "token": c.token})
        elif isinstance(c, (Drain, Shutdown)):
            out.append({"kind": type(c).__name__.lower()})
        else:
            raise TypeError(f"not a command: {c!r}")
    return out


def decode_commands(payload: Any, codec: ReqCodec) -> list[Command]:
    """Rank 0's commands from their JSON form; MalformedPayload for anything else."""
    expect(isinstance(payload, list), SITE, f"expected a list of commands, got {type(payload).__name__}")
    commands: list[Command] = []
    for item in payload:
        expect(isinstance(item, dict) and isinstance(item.get("kind"), str), SITE, f"not a command: {item!r:.200}")
        kind = item["kind"]
        if kind == "add":
            expect(isinstance(item.get("req"), dict), SITE, "an add command without its request")
            commands.append(AddRequest(codec.decode(item["req"])))
        elif kind == "abort":
            expect(isinstance(item.get("rid"), str), SITE, "an abort command without a string rid")
            commands.append(AbortRequest(item["rid"]))
        elif kind == "flush":
            expect(isinstance(item.get("token"), str), SITE, "a flush command without a string token")
            commands.append(FlushCache(item["token"]))
        elif kind in ("drain", "shutdown"):
            commands.append(Drain() if kind == "drain" else Shutdown())
        else:
            raise MalformedPayload(f"malformed payload at site '{SITE}': unknown command kind {kind!r:.100}")
    return commands


class CommandBroadcast:
    """Collects commands between steps and hands every rank rank 0's list at the start of a step."""

    def __init__(self, group: Optional[TPGroup] = None, codec: Optional[ReqCodec] = None):
        if group is not None and codec is None:
            raise InternalError("CommandBroadcast: a tensor-parallel group needs a ReqCodec")
        self.group, self.codec = group, codec
        self.pending: list[Command] = []
        self._lock = threading.Lock()  # submit/abort threads put while the step thread takes

    def put(self, command: Command) -> None:
        with self._lock:
            self.pending.append(command)

    def take(self) -> list[Command]:
        """This step's commands, identical on every rank (a collective under TP: every rank calls it)."""
        with self._lock:  # a put racing the swap must land in this step's list or the next, never after encoding
            commands, self.pending = self.pending, []
        if self.group is None:
            return commands
        assert self.codec is not None, "__init__: a group comes with a codec"
        if self.group.rank == 0:  # rank 0 keeps its own objects (callers hold its requests)
            self.group.broadcast_json(encode_commands(commands, self.codec), SITE)
            return commands
        return decode_commands(self.group.broadcast_json(None, SITE), self.codec)

    def __bool__(self) -> bool:
        return bool(self.pending)
