"""The HTTP process's handle on the engine process: submit, abort, and per-request event queues.

A reader thread takes the engine's event lists off the multiprocessing queue and hands them to the
asyncio loop, which routes each request's events to its sink (an asyncio.Queue of `Delivery`) and
records latencies. Nothing here waits on model work from the event loop. Every submitted request
gets exactly one final delivery: `RequestDone`, `RequestError`, `RequestFailed`, or `EngineFatal`
when the engine process fails, exits or misses its heartbeat for `heartbeat_timeout_s`.

Engine death is final: the client fails every open request at once, refuses new ones, reports a
one-line reason (the details are in the log) and calls `on_fatal`, which stops the server so
that its supervisor can restart it. Any error of the reader thread itself is engine death too.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Union

from specserve.engine.messages import (
    AbortRequest,
    AddRequest,
    CacheFlushed,
    EngineFatal,
    EngineReady,
    Event,
    FlushCache,
    Heartbeat,
    LoadReport,
    RequestDone,
    RequestError,
    RequestFailed,
    Shutdown,
    TokensOut,
)
from specserve.errors import ConfigError
from specserve.sampling_params import SamplingParams
from specserve.server.engine_process import one_line
from specserve.server.engine_spawn import SpawnedEngine
from specserve.server.heartbeat import DEFAULT_HEARTBEAT_TIMEOUT_S, HEARTBEAT_S
from specserve.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

READER_POLL_S = 0.5
FAILED_ENGINE_EXIT_S = 1.0  # a failed engine gets this long to exit on its own before it is killed


class EngineUnavailable(RuntimeError):
    """The engine process failed or is gone; requests fail with this message."""


class Delivery(NamedTuple):
    """One event of a request, with the choice index its sink knows it by."""

    choice: int  # not `index`: that is tuple.index
    event: Union[TokensOut, RequestDone, RequestError, RequestFailed, EngineFatal]


@dataclass
class Tracked:
    """One engine request as the HTTP side follows it. `index` is its choice index (n > 1)."""

    sink: asyncio.Queue
    index: int
    submitted: float = field(default_factory=time.perf_counter)
    first_at: Optional[float] = None
    last_at: Optional[float] = None


class EngineClient:
    """Multiplexes requests over a started engine process (server/engine_spawn.py)."""

    def __init__(
        self, engine: SpawnedEngine, metrics: ServerMetrics, heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    ):
        if heartbeat_timeout_s <= HEARTBEAT_S:
            raise ConfigError(f"heartbeat timeout must exceed the heartbeat interval of {HEARTBEAT_S} s")
        self.metrics = metrics
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.on_fatal: Optional[Callable[[], None]] = None  # called once, on the event loop, at engine death
        self.info: dict[str, Any] = {}
        self.load: dict[str, int] = {}
        self.fatal: Optional[str] = None
        self.tracked: dict[str, Tracked] = {}
        self.queued = 0  # submitted, no event yet: the bound behind 503
        self.last_output_at: Optional[float] = None  # perf_counter of the last token event (/health_generate)
        self._flushes: dict[str, asyncio.Future] = {}  # flush token -> its reply (slots freed)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._closing = False
        self.proc, self._commands, self._events = engine.proc, engine.commands, engine.events

    # ------------------------------------------------------------ lifecycle

    def wait_ready(self, timeout_s: float = 900.0) -> dict[str, Any]:
        """Block until the launched engine reports ready (its info) or fails (raised)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                events = self._events.get(timeout=READER_POLL_S)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise EngineUnavailable(f"engine process exited with code {self.proc.exitcode} during start") from None
                continue
            for ev in events:
                if isinstance(ev, EngineFatal):  # a start-up failure: its whole message, for the exit line
                    self.proc.join(5)
                    raise (ConfigError if ev.config else EngineUnavailable)(ev.message)
                if isinstance(ev, EngineReady):
                    self.info = ev.info
                    return self.info
        self.proc.kill()
        raise EngineUnavailable(f"engine not ready after {timeout_s:.0f} s")

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start routing events into `loop` (call from inside it)."""
        self._loop = loop
        threading.Thread(target=self._read_events, name="engine-events", daemon=True).start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the engine to abort what is left and exit; kill it if it does not within the bound.
        A failed engine is not asked: it is killed after a moment, so the server exits promptly."""
        self._closing = True
        if self.fatal is not None:
            timeout_s = FAILED_ENGINE_EXIT_S
        elif self.proc.is_alive():
            self._commands.put(Shutdown())
        self.proc.join(timeout_s)
        if self.proc.is_alive():
            logger.error("engine process did not exit within %.0f s; killing it", timeout_s)
            self.proc.kill()
            self.proc.join(5)
        elif self.fatal is None and self.proc.exitcode != 0:  # asked to stop, it should have exited cleanly
            logger.error("engine process exited with code %s at shutdown", self.proc.exitcode)

    @property
    def healthy(self) -> bool:
        return self.fatal is None and self.proc.is_alive()

    @property
    def health_reason(self) -> str:
        """Why the engine is not healthy, in one line."""
        return self.fatal or f"engine process exited with code {self.proc.exitcode}"

    # ------------------------------------------------------------ requests

    def submit(self, rid: str, input_ids: list[int], params: SamplingParams, sink: asyncio.Queue, index: int = 0) -> None:
        """Send one request, its params parsed and validated by the route, to the engine process."""
        if not self.healthy:
            raise EngineUnavailable(self.fatal or "engine process is not running")
        self.tracked[rid] = Tracked(sink, index)
        self.queued += 1
        self.metrics.queued.set(self.queued)
        self._commands.put(AddRequest(rid, input_ids, params))

    def abort(self, rid: str) -> None:
        """Stop a request (client gone); its KV is freed by the engine. No-op once finished."""
        if rid in self.tracked:
            self._commands.put(AbortRequest(rid))

    async def flush_cache(self) -> int:
        """Drop the engine's unheld cached prefixes; the KV slots freed (on the event loop)."""
        if not self.healthy:
            raise EngineUnavailable(self.fatal or "engine process is not running")
        token = f"flush-{len(self._flushes)}-{time.perf_counter_ns()}"
        self._flushes[token] = done = asyncio.get_running_loop().create_future()
        self._commands.put(FlushCache(token))
        try:
            return await done
        finally:
            self._flushes.pop(token, None)

    # ------------------------------------------------------------ events

    def _read_events(self) -> None:
        """The reader thread: any error of its own is engine death, never a silent stop."""
        try:
            reason = self._read_until_engine_ends()
        except BaseException as exc:
            logger.critical("engine event reader failed", exc_info=True)
            reason = f"engine event reader failed: {type(exc).__name__}: {exc}"
        if reason is not None and not self._closing:
            self._call(self._fail_all, reason)

    def _read_until_engine_ends(self) -> Optional[str]:
        """Route events until the engine exits or misses its heartbeat: the reason, None at shutdown."""
        last_sign = time.monotonic()  # any event, heartbeats included, shows the engine alive
        while True:
            try:
                events = self._events.get(timeout=READER_POLL_S)
                last_sign = time.monotonic()
            except queue.Empty:
                events = None
            if events is not None:
                self._call(self._dispatch, events)
                continue
            if not self.proc.is_alive():
                return None if self._closing else f"engine process exited with code {self.proc.exitcode}"
            silent = time.monotonic() - last_sign
            if silent > self.heartbeat_timeout_s and not self._closing:
                self.proc.kill()  # stopped or wedged: it must not come back and act on stale requests
                return f"engine process stopped answering (no heartbeat for {silent:.0f} s); killed it"

    def _call(self, fn, *args) -> None:
        assert self._loop is not None, "attach() sets it before the reader starts"
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server is gone
            pass

    def _dispatch(self, events: list[Event]) -> None:
        """On the event loop: route one list of events; a failure here would lose final events, so it
        is engine death too."""
        try:
            self._route_all(events)
        except Exception as exc:
            logger.critical("routing engine events failed", exc_info=True)
            self._fail_all(f"routing engine events failed: {type(exc).__name__}: {exc}")

    def _route_all(self, events: list[Event]) -> None:
        now = time.perf_counter()
        for ev in events:
            match ev:
                case LoadReport(load=load):
                    self.load = load
                    self.metrics.observe_load(load)
                case CacheFlushed(token=token, freed_tokens=freed):
                    if token in self._flushes and not self._flushes[token].done():
                        self._flushes[token].set_result(freed)
                case Heartbeat():
                    pass
                case EngineFatal(message=message):
                    self._fail_all(message)
                case TokensOut() | RequestDone() | RequestError() | RequestFailed():
                    self._route(ev, now)
                case _:
                    logger.warning("unexpected engine event %r", ev)

    def _route(self, ev: Union[TokensOut, RequestDone, RequestError, RequestFailed], now: float) -> None:
        t = self.tracked.get(ev.rid)
        if t is None:  # aborted and already answered, or not ours
            return
        tokens = isinstance(ev, TokensOut)
        if tokens:
            self.last_output_at = now
        if t.first_at is None:
            t.first_at = now
            self.queued -= 1
            self.metrics.queued.set(self.queued)
            if tokens:
                self.metrics.ttft.observe(now - t.submitted)
        elif tokens:
            assert t.last_at is not None, "set with first_at"
            self.metrics.itl.observe(now - t.last_at)
        t.last_at = now
        if not tokens:
            del self.tracked[ev.rid]
            if isinstance(ev, RequestDone):
                self.metrics.observe_done(ev.output, now - t.submitted)
        t.sink.put_nowait(Delivery(t.index, ev))

    def _fail_all(self, message: str) -> None:
        """Engine death: every open request fails now, and the server is told to stop (once)."""
        first = self.fatal is None
        if self.fatal is None:
            logger.critical("engine failed: %s", message)
            self.fatal = one_line(message)
        fatal = EngineFatal(self.fatal)
        for rid in list(self.tracked):
            t = self.tracked.pop(rid)
            t.sink.put_nowait(Delivery(t.index, fatal))
        self.queued = 0
        self.metrics.queued.set(0)
        for done in self._flushes.values():
            if not done.done():
                done.set_exception(EngineUnavailable(self.fatal))
        if first and self.on_fatal is not None:
            self.on_fatal()
