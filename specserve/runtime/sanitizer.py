"""Stream sanitizer (SPECSERVE_STREAM_SANITIZER=1): reports unordered cross-stream tensor accesses.

A TorchDispatchMode sees every aten op and records, per tensor storage, the last write and the
reads since it: which stream, at which logical time (the stream's vector clock, see stream.py) and
from which call site. A new access conflicts with an earlier one from another stream unless the
earlier one happened before it (through stream order, a submitted task's launch order, or an
event record/wait). Reads never conflict with reads. Because the clocks follow program order,
a hazard is reported even when the timing of this run happened to be benign, inline or threaded.

It raises StreamHazardError at the second access of the pair. Persistent buffers (those a replayed
step rewrites every time, such as the accept buffers) are registered with their owner stream, and
any access from another stream is a hazard at once: a device-to-host copy on the copy stream
reading a view of an accept buffer is reported at the first verify step's copy, even before the
next step could rewrite the buffer.
"""

from __future__ import annotations

import threading
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from specserve.runtime.stream import Stream, current_stream, current_submit_site

_SKIP_FRAMES = ("torch/", "specserve/runtime/sanitizer.py", "specserve/runtime/stream.py", "contextlib.py", "threading.py")


_LIFT_OPS = ("lift_fresh", "lift_fresh_copy", "lift")


class StreamHazardError(RuntimeError):
    """Two accesses to one storage from different streams, at least one a write, with no ordering."""


@dataclass
class _Access:
    stream_id: int
    stream_name: str
    tick: int
    site: str
    op: str


@dataclass
class _StorageState:
    write: Optional[_Access] = None
    reads: list[_Access] = field(default_factory=list)


class StreamSanitizer:
    """Records accesses while active in a thread; shared by all streams of one engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._storages: dict[int, _StorageState] = {}
        self._persistent: dict[int, Stream] = {}  # storage -> owner stream
        self._tls = threading.local()
        self.accesses = 0

    @contextmanager
    def active(self) -> Iterator[None]:
        """Record this thread's tensor ops inside the block (re-entrant)."""
        if getattr(self._tls, "depth", 0):
            self._tls.depth += 1
            try:
                yield
            finally:
                self._tls.depth -= 1
            return
        self._tls.depth = 1
        try:
            with _Mode(self):
                yield
        finally:
            self._tls.depth = 0

    @staticmethod
    def call_site() -> str:
        """The innermost frame outside torch and the runtime; on a worker thread whose stack has
        none (a bare op was submitted), the site that submitted the task."""
        return _user_frame() or current_submit_site() or "<unknown>"

    def forget(self, tensor: torch.Tensor) -> None:
        """Drop history for a storage about to be reused for unrelated data (e.g. freed)."""
        with self._lock:
            self._storages.pop(_key(tensor), None)

    def record(self, op: str, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> None:
        stream = current_stream()
        tick = stream.clock.ticks.get(stream.id, 0)
        site = None
        with self._lock:
            for tensors, is_write in ((reads, False), (writes, True)):
                for t in tensors:
                    if not t.numel():
                        continue
                    site = site or self.call_site()
                    self._access(_key(t), _Access(stream.id, stream.name, tick, site, op), is_write, stream.clock)
            self.accesses += len(reads) + len(writes)

    def register_persistent(self, tensors: list[torch.Tensor], owner: Stream) -> None:
        """Buffers a replayed step rewrites every time (the accept buffers): only their owner
        stream may touch them; anyone else must read the owned copies made on that stream."""
        with self._lock:
            for t in tensors:
                self._persistent[_key(t)] = owner

    def unregister_persistent(self, tensors: list[torch.Tensor]) -> None:
        """Buffers about to be freed: their storage may come back as any other tensor."""
        with self._lock:
            for t in tensors:
                self._persistent.pop(_key(t), None)

    def fresh(self, op: str, tensors: list[torch.Tensor]) -> None:
        stream = current_stream()
        access = _Access(stream.id, stream.name, stream.clock.ticks.get(stream.id, 0), "<allocation>", op)
        with self._lock:
            for t in tensors:
                if t.numel():
                    self._storages[_key(t)] = _StorageState(write=access)

    def _access(self, key: int, access: _Access, is_write: bool, clock) -> None:
        state = self._storages.setdefault(key, _StorageState())
        owner = self._persistent.get(key)
        if owner is not None and owner.id != access.stream_id:
            last = state.write
            raise StreamHazardError(
                f"stream hazard on storage 0x{key:x}: {'write' if is_write else 'read'} ({access.op}) on stream "
                f"{access.stream_name!r} at {access.site} touches a persistent buffer that stream {owner.name!r} "
                f"rewrites at every replay (last written there at {last.site if last else '?'}); read the owned "
                "copies made on that stream right after the step instead"
            )
        earlier = ([state.write] if state.write else []) + (state.reads if is_write else [])
        for prev in earlier:
            if prev.stream_id != access.stream_id and not clock.covers(prev.stream_id, prev.tick):
                kind = "write" if is_write else "read"
                prev_kind = "write" if prev is state.write else "read"
                raise StreamHazardError(
                    f"stream hazard on storage 0x{key:x}: {kind} ({access.op}) on stream {access.stream_name!r} at "
                    f"{access.site} is not ordered after the {prev_kind} ({prev.op}) on stream {prev.stream_name!r} "
                    f"at {prev.site}; order them with an event (record on one stream, wait on the other)"
                )
        if is_write:
            state.write, state.reads = access, []
        else:
            state.reads = [r for r in state.reads if r.stream_id != access.stream_id] + [access]


class _Mode(TorchDispatchMode):
    def __init__(self, sanitizer: StreamSanitizer):
        super().__init__()
        self.sanitizer = sanitizer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket.__name__)
        if name in _LIFT_OPS:  # torch.tensor(data) & co: new storage made outside the dispatcher
            out = func(*args, **kwargs)
            self.sanitizer.fresh(name, [t for t in tree_flatten((args, out))[0] if isinstance(t, torch.Tensor)])
            return out
        reads, writes = _classify(func, args, kwargs)
        if not writes and any(r.alias_info is not None for r in func._schema.returns):
            return func(*args, **kwargs)  # a view (slice, view, t, ...): no data is touched
        self.sanitizer.record(name, reads, writes)
        out = func(*args, **kwargs)
        # Fresh outputs (not aliases of an input) are new storage: whatever ran at that address
        # before belonged to a freed tensor, so their history starts with this write.
        if not any(r.alias_info is not None for r in func._schema.returns):
            fresh = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            if fresh:
                self.sanitizer.fresh(str(func.overloadpacket.__name__), fresh)
        return out


def _classify(func, args, kwargs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Tensors an op reads and writes, from its schema's alias annotations (`Tensor(a!)`)."""
    reads: list[torch.Tensor] = []
    writes: list[torch.Tensor] = []
    schema = func._schema
    for i, arg in enumerate(schema.arguments):
        value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
        if value is None:
            continue
        tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        is_write = arg.alias_info is not None and arg.alias_info.is_write
        (writes if is_write else reads).extend(tensors)
    return reads, writes


def _key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return id(t)


def _user_frame() -> Optional[str]:
    for frame in reversed(traceback.extract_stack(limit=40)):
        if not any(s in frame.filename for s in _SKIP_FRAMES):
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}"
    return None
