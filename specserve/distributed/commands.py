"""The SPMD command stream: what rank 0 tells every rank to apply before a step.

Every rank runs its own scheduler over the same commands in the same order, so all ranks
schedule identical batches. Under tensor parallelism the commands of a step are broadcast from
rank 0 on the control group; on one rank they pass through unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from specserve.distributed.group import TPGroup


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


Command = Union[AddRequest, AbortRequest, Drain, Shutdown]


class CommandBroadcast:
    """Collects commands between steps and hands every rank rank 0's list at the start of a step."""

    def __init__(self, group: Optional[TPGroup] = None):
        self.group = group
        self.pending: list[Command] = []

    def put(self, command: Command) -> None:
        self.pending.append(command)

    def take(self) -> list[Command]:
        """This step's commands, identical on every rank (a collective under TP: every rank calls it)."""
        commands, self.pending = self.pending, []
        if self.group is not None:
            commands = self.group.broadcast_object(commands, "engine.commands")
        return commands

    def __bool__(self) -> bool:
        return bool(self.pending)
