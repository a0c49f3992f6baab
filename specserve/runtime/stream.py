"""Streams and events on CPU and CUDA, and the copies between host and device that never wait:
`async_d2h` (device to host, behind an event) and `staged` (host values onto the device).

On CUDA a Stream wraps `torch.cuda.Stream`: work submitted to it is enqueued under that stream and
runs asynchronously on the device. On CPU PyTorch has no streams, so a Stream is an ordered
executor: `submit(fn)` runs fn after everything submitted before it. Two arrangements:

- threaded: a worker thread runs the stream's queue, so work really runs concurrently with the
  caller and with other streams, and a missing event wait is a real race. Fault injection (random
  delays per operation) needs this.
- inline: `submit` runs fn at once in the caller's thread. Ordering is then trivially kept, and it
  costs nothing: on these 2-core machines PyTorch's two compute threads already use both cores,
  and a second Python thread only competes with them and with op dispatch for the GIL (a threaded
  pipeline measured 20-25% slower than the plain loop). Inline is the default on CPU.

Happens-before is tracked with vector clocks in both arrangements, in program (submission) order,
not wall-clock order: a submitted task inherits its submitter's clock, a recorded event snapshots
its stream's clock and a wait merges it. The stream sanitizer reads these clocks, so an unordered
access is reported whatever the timing, inline or threaded.
"""

from __future__ import annotations

import itertools
import queue
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

# How long a stream or the host waits for an event before declaring a hang (no silent hang).
EVENT_TIMEOUT_S = 600.0

_ids = itertools.count(1)
_tls = threading.local()  # per thread: the current stream (like torch.cuda.current_stream)


class StreamError(RuntimeError):
    """Work submitted to a stream raised; re-raised in the caller at its next sync point."""


@dataclass
class VectorClock:
    """Logical time per stream id; a <= b on every entry means a happened before b."""

    ticks: dict[int, int] = field(default_factory=dict)

    def tick(self, sid: int) -> int:
        self.ticks[sid] = self.ticks.get(sid, 0) + 1
        return self.ticks[sid]

    def merge(self, other: dict[int, int]) -> None:
        for sid, t in other.items():
            if t > self.ticks.get(sid, 0):
                self.ticks[sid] = t

    def snapshot(self) -> dict[int, int]:
        return dict(self.ticks)

    def covers(self, sid: int, tick: int) -> bool:
        return self.ticks.get(sid, 0) >= tick


class Stream:
    """An ordered queue of work on one device. See the module docstring for the CPU arrangements."""

    def __init__(
        self,
        name: str,
        device: str = "cpu",
        threaded: bool = False,
        delay: Optional[Callable[[], None]] = None,
        sanitizer: Any = None,
    ):
        self.id = next(_ids)
        self.name = name
        self.device = torch.device(device)
        self.clock = VectorClock()
        self.delay = delay
        self.sanitizer = sanitizer
        self._error: Optional[BaseException] = None
        self._cuda = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._queue: Optional[queue.SimpleQueue] = None
        if threaded and self._cuda is None:
            self._queue = queue.SimpleQueue()
            threading.Thread(target=self._worker, args=(self._queue,), name=f"stream-{name}", daemon=True).start()

    def __repr__(self) -> str:
        return f"Stream({self.name!r}#{self.id})"

    @property
    def threaded(self) -> bool:
        return self._queue is not None

    # ------------------------------------------------------------ submitting work

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Run fn(*args, **kwargs) on this stream after all earlier work on it."""
        self.raise_pending()
        parent = current_stream().clock.snapshot()  # launch order: the submitter's past comes first
        self.submit_site = self.sanitizer.call_site() if self.sanitizer is not None else None
        task = (fn, args, kwargs, parent, False, self.submit_site)
        if self._queue is not None:
            self._queue.put(task)
        else:
            self._run(task)

    def _submit_marker(self, fn: Callable[[], None]) -> None:
        """Bookkeeping work (event record / wait): runs even after an error, so nobody hangs."""
        parent = current_stream().clock.snapshot()
        task: tuple[Any, ...] = (fn, (), {}, parent, True, None)
        if self._queue is not None:
            self._queue.put(task)
        else:
            self._run(task)

    def _worker(self, tasks: queue.SimpleQueue) -> None:
        _tls.stream = self
        while True:
            task = tasks.get()
            if task is None:
                return
            self._run(task)

    def _run(self, task) -> None:
        fn, args, kwargs, parent, marker, site = task
        previous = getattr(_tls, "stream", None)
        _tls.stream = self
        _tls.submit_site = site  # where the running task was launched from, for the sanitizer
        try:
            self.clock.merge(parent)
            self.clock.tick(self.id)
            if marker:
                fn()
                return
            if self._error is not None:
                return  # a failed stream skips later work, as a failed CUDA stream would
            if self.delay is not None:
                self.delay()
            if self._cuda is not None:
                with torch.cuda.stream(self._cuda):
                    fn(*args, **kwargs)
            elif self.sanitizer is not None:
                with self.sanitizer.active():
                    fn(*args, **kwargs)
            else:
                fn(*args, **kwargs)
        except BaseException as exc:  # surfaced in the caller at its next sync point
            self._error = exc
        finally:
            _tls.stream = previous

    # ------------------------------------------------------------ sync points

    def raise_pending(self) -> None:
        if self._error is not None:
            raise StreamError(f"work on {self} failed: {self._error!r}") from self._error

    def synchronize(self) -> None:
        """Block the caller until everything submitted so far has run; re-raise its errors."""
        event = Event()
        event.record(self)
        event.synchronize()

    def close(self) -> None:
        if self._queue is not None:
            self._queue.put(None)
            self._queue = None


class _HostStream(Stream):
    """The calling thread itself (work 'submitted' to it runs at once)."""

    def __init__(self) -> None:
        super().__init__("host")


def current_submit_site() -> Optional[str]:
    """Where the task running on this thread was submitted (set only under the sanitizer)."""
    return getattr(_tls, "submit_site", None)


def current_stream() -> Stream:
    """The stream the calling code runs on: a worker's stream, or this thread's host stream."""
    stream = getattr(_tls, "stream", None)
    if stream is None:
        stream = _tls.stream = _HostStream()
    return stream


class stream_context:
    """`with stream_context(s):` runs the block as if it were work on s (inline only)."""

    def __init__(self, stream: Stream):
        self.stream = stream

    def __enter__(self) -> Stream:
        self._previous = current_stream()
        self.stream.clock.merge(self._previous.clock.snapshot())
        _tls.stream = self.stream
        return self.stream

    def __exit__(self, *exc) -> None:
        self._previous.clock.merge(self.stream.clock.snapshot())
        _tls.stream = self._previous


@dataclass
class _Record:
    flag: threading.Event
    stream: Stream
    clock: dict[int, int] = field(default_factory=dict)
    cuda_event: Any = None


class Event:
    """A point in a stream's work. `wait(s)` orders s after it; `synchronize()` blocks the host."""

    def __init__(self) -> None:
        self._record: Optional[_Record] = None

    def record(self, stream: Optional[Stream] = None) -> "Event":
        stream = stream or current_stream()
        rec = _Record(threading.Event(), stream)
        if stream._cuda is not None:
            rec.cuda_event = torch.cuda.Event()
            rec.cuda_event.record(stream._cuda)

        def mark() -> None:
            rec.clock = stream.clock.snapshot()
            rec.flag.set()

        self._record = rec
        stream._submit_marker(mark)
        return self

    def wait(self, stream: Optional[Stream] = None) -> None:
        """Work submitted to `stream` from now on runs after this event (no-op if never recorded)."""
        rec, stream = self._record, stream or current_stream()
        if rec is None:
            return
        if rec.cuda_event is not None and stream._cuda is not None:
            stream._cuda.wait_event(rec.cuda_event)

        def merge() -> None:
            _wait_flag(rec, stream)
            stream.clock.merge(rec.clock)

        stream._submit_marker(merge)

    def synchronize(self) -> None:
        """Block the calling thread until the event has happened; re-raise its stream's errors."""
        rec = self._record
        if rec is None:
            return
        host = current_stream()
        for observe in getattr(_tls, "wait_observers", ()):
            observe(f"Event.synchronize() on {rec.stream.name}")
        _wait_flag(rec, host)
        if rec.cuda_event is not None:
            rec.cuda_event.synchronize()
        host.clock.merge(rec.clock)
        rec.stream.raise_pending()

    def query(self) -> bool:
        rec = self._record
        return rec is None or (rec.flag.is_set() and (rec.cuda_event is None or rec.cuda_event.query()))


@contextmanager
def observe_host_waits(observer: Callable[[str], None]) -> Iterator[None]:
    """Tell `observer` of every host wait for an event on this thread inside the block (the
    host-wait detector, runtime/host_waits.py)."""
    previous = getattr(_tls, "wait_observers", ())
    _tls.wait_observers = (*previous, observer)
    try:
        yield
    finally:
        _tls.wait_observers = previous


def _wait_flag(rec: _Record, waiter: Stream) -> None:
    if not rec.flag.wait(EVENT_TIMEOUT_S):
        raise TimeoutError(f"{waiter} waited {EVENT_TIMEOUT_S:.0f} s for an event on {rec.stream}: stuck stream")


def async_d2h(tensor: torch.Tensor, stream: Stream) -> tuple[torch.Tensor, Event]:
    """Copy `tensor` to a new host tensor on `stream`; returns (host tensor, done event).

    The source stays alive until the copy has run: on CPU the queued closure holds it, on CUDA
    `record_stream` tells the allocator. Read the host tensor only after `done.synchronize()`
    (or after waiting on it from another stream). The caller orders the copy after the source's
    producer first (`Event().record(producer).wait(stream)`).
    """
    hosts, done = async_d2h_all([tensor], stream)
    return hosts[0], done


def async_d2h_all(tensors: list[torch.Tensor], stream: Stream) -> tuple[list[torch.Tensor], Event]:
    """async_d2h for several tensors with one done event."""
    cuda = stream._cuda
    pinned = cuda is not None
    hosts = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned) for t in tensors]

    def copy(sources: list[torch.Tensor] = list(tensors)) -> None:  # noqa: B006  (the default keeps them alive)
        for host, src in zip(hosts, sources):
            host.copy_(src, non_blocking=pinned)
            if cuda is not None:  # pinned
                src.record_stream(cuda)

    stream.submit(copy)
    done = Event().record(stream)
    return hosts, done


def staged(values: Any, dtype: torch.dtype, device: "str | torch.device") -> torch.Tensor:
    """`values` (numbers, nested lists) as a `dtype` tensor on `device`, queued without a wait.

    `torch.tensor(values, device=cuda)` copies from pageable memory with a blocking copy, which
    synchronises the current stream: inside a step's launch that waits for the previous step
    (pytorch/pytorch#120996). Here the tensor is built on the host, pinned on CUDA and copied
    non-blocking, so the copy is queued behind the stream's work instead (the pinned block is kept
    by PyTorch's host allocator until the copy has run). On CPU it is the host tensor itself."""
    host = torch.tensor(values, dtype=dtype)
    target = torch.device(device)
    if target.type == "cuda":
        host = host.pin_memory()
    return host.to(target, non_blocking=True)
