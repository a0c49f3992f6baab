"""The SPMD command stream: rank 0 republishes the engine's commands (engine/messages.py) to every rank.

Every rank runs its own scheduler over the same commands in the same order, so all ranks
schedule identical batches. Under tensor parallelism the commands of a step are broadcast from
rank 0 on the control group as JSON; on one rank they pass through unchanged. A payload that does
not decode to commands raises MalformedPayload; nothing a peer sends is ever executed.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Optional

from specserve.distributed.group import TPGroup
from specserve.distributed.wire import MalformedPayload, expect
from specserve.engine.messages import AbortRequest, AddRequest, Command, Drain, FlushCache, Shutdown
from specserve.errors import InvalidRequestError
from specserve.sampling_params import SamplingParams

SITE = "engine.commands"
ADD_FIELDS: dict[str, type] = {"rid": str, "input_ids": list, "params": dict, "seed": int}
PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def encode_commands(commands: list[Command]) -> list[dict]:
    """The JSON form of rank 0's commands (an AddRequest with its seed drawn: see Engine._put)."""
    out: list[dict] = []
    for c in commands:
        if isinstance(c, AddRequest):
            out.append({"kind": "add", "req": encode_add(c)})
        elif isinstance(c, AbortRequest):
            out.append({"kind": "abort", "rid": c.rid})
        elif isinstance(c, FlushCache):
            out.append({"kind": "flush", "token": c.token})
        elif isinstance(c, (Drain, Shutdown)):
            out.append({"kind": type(c).__name__.lower()})
        else:
            raise TypeError(f"not a command: {c!r}")
    return out


def decode_commands(payload: Any) -> list[Command]:
    """Rank 0's commands from their JSON form; MalformedPayload for anything else."""
    expect(isinstance(payload, list), SITE, f"expected a list of commands, got {type(payload).__name__}")
    commands: list[Command] = []
    for item in payload:
        expect(isinstance(item, dict) and isinstance(item.get("kind"), str), SITE, f"not a command: {item!r:.200}")
        kind = item["kind"]
        if kind == "add":
            expect(isinstance(item.get("req"), dict), SITE, "an add command without its request")
            commands.append(decode_add(item["req"]))
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


def encode_add(cmd: AddRequest) -> dict[str, Any]:
    """A request as JSON: its id, tokens, sampling params and the seed rank 0 drew."""
    assert cmd.seed is not None, "rank 0 draws the seed before it republishes a request"
    return {"rid": cmd.rid, "input_ids": list(cmd.input_ids), "params": dataclasses.asdict(cmd.params), "seed": cmd.seed}


def decode_add(data: dict) -> AddRequest:
    """The request rank 0 queued; MalformedPayload if any field is missing, extra or of a wrong type."""
    where = f"malformed payload at site '{SITE}': request"
    if set(data) != set(ADD_FIELDS):
        raise MalformedPayload(f"{where} fields {sorted(data)!r:.200}, expected {sorted(ADD_FIELDS)}")
    for name, kind in ADD_FIELDS.items():
        if not isinstance(data[name], kind) or isinstance(data[name], bool):
            raise MalformedPayload(f"{where} field {name!r}: {type(data[name]).__name__}")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in data["input_ids"]):
        raise MalformedPayload(f"{where} field 'input_ids': not a list of integers")
    if set(data["params"]) != PARAM_FIELDS:
        raise MalformedPayload(f"{where} sampling params {sorted(data['params'])!r:.200}")
    params = SamplingParams(**data["params"])
    try:  # a peer's bytes are not trusted: the types JSON gave back are checked, not the request again
        params.validate()
    except InvalidRequestError as exc:
        raise MalformedPayload(f"{where} sampling params: {exc}") from None
    return AddRequest(data["rid"], data["input_ids"], params, data["seed"])


class CommandBroadcast:
    """Collects commands between steps and hands every rank rank 0's list at the start of a step."""

    def __init__(self, group: Optional[TPGroup] = None):
        self.group = group
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
        if self.group.rank == 0:  # rank 0 keeps its own objects
            self.group.broadcast_json(encode_commands(commands), SITE)
            return commands
        return decode_commands(self.group.broadcast_json(None, SITE))

    def __bool__(self) -> bool:
        return bool(self.pending)
