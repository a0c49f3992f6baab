"""Generation: the engine requests behind one API request (one per choice) and their events.

An API request with n choices (times prompts, for completions) becomes that many engine requests
sharing one sink. A generation never outlives its HTTP request: whoever drives it aborts whatever
is still open when it stops (done, failed, or the client went away), which frees the KV slots.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, AsyncIterator, Awaitable, Optional, TypeVar

from fastapi import Request

from specserve.engine.messages import EngineFatal, RequestDone, RequestError, RequestFailed
from specserve.sampling_params import SamplingParams
from specserve.server.engine_client import Delivery, EngineUnavailable
from specserve.server.errors import APIError, from_engine_fatal, from_engine_rejection, from_request_failure, server_error
from specserve.server.state import ServerState

T = TypeVar("T")

DISCONNECT_POLL_S = 0.25


class Generation:
    """The n engine requests behind one API request, their events on one queue, abort on exit."""

    def __init__(
        self,
        state: ServerState,
        prompt_ids: list[list[int]],
        params: list[SamplingParams],
        names: Optional[dict[str, str]] = None,
    ):
        self.state = state
        self.names = names or {}  # the engine's field names -> the API's, for a rejection's 400
        self.sink: asyncio.Queue[Delivery] = asyncio.Queue()
        base = uuid.uuid4().hex
        self.rids = [f"{base}-{i}" for i in range(len(prompt_ids))]
        self.prompt_ids = prompt_ids
        self.params = params
        self.open = set(range(len(prompt_ids)))  # choice indices without a final event yet

    def start(self) -> None:
        """Submit every choice, or none: 400 when they could never all be queued, 503 when the queue bound
        would be passed now or the engine is gone."""
        client = self.state.client
        if len(self.rids) > self.state.max_queued_requests:  # can never be queued: not worth a retry
            raise APIError(
                f"n: the request needs {len(self.rids)} engine requests (prompts x n) but at most "
                f"{self.state.max_queued_requests} can be queued",
                400,
                param="n",
                code="exceeds_queue_limit",
            )
        if client.queued + len(self.rids) > self.state.max_queued_requests:
            raise APIError(
                f"server overloaded: {client.queued} requests queued (limit {self.state.max_queued_requests}); retry later",
                503,
                code="overloaded",
                err_type="server_error",
                headers={"Retry-After": "1"},
            )
        try:
            for i, (rid, ids, params) in enumerate(zip(self.rids, self.prompt_ids, self.params)):
                client.submit(rid, ids, params, self.sink, index=i)
        except EngineUnavailable as exc:
            self.abort()
            raise server_error(f"engine unavailable: {exc}", 503) from exc

    async def next_event(self) -> Delivery:
        """The next TokensOut or RequestDone; an engine rejection or failure aborts the rest and raises APIError."""
        delivery = await self.sink.get()
        match delivery.event:
            case RequestDone():
                self.open.discard(delivery.choice)
            case RequestError() as event:
                self.open.discard(delivery.choice)
                self.abort()
                raise from_engine_rejection(event, self.names)
            case RequestFailed() as event:
                self.open.discard(delivery.choice)
                self.abort()
                raise from_request_failure(event)
            case EngineFatal() as event:
                self.open.discard(delivery.choice)
                self.abort()
                raise from_engine_fatal(event)
        return delivery

    async def first_event(self, request: Request) -> Delivery:
        """Wait before a stream starts, so an engine rejection answers as a plain HTTP error. A
        client that leaves before then (its prompt queued or prefilling) aborts the request: no
        response has started, so nothing else would notice."""
        try:
            return await unless_disconnected(self.next_event(), request)
        except BaseException:
            self.abort()
            raise

    async def events(self, first: Delivery) -> AsyncIterator[Delivery]:
        """`first`, then every later event; aborts whatever is left if the consumer stops (client gone)."""
        try:
            yield first
            while self.open:
                yield await self.next_event()
        finally:
            self.abort()

    def abort(self) -> None:
        for i in list(self.open):
            self.state.client.abort(self.rids[i])
        self.open.clear()


async def collect(gen: Generation, request: Request) -> list[dict[str, Any]]:
    """Every choice's output dict, in choice order; a client that disconnects first aborts them."""
    outputs: list[Optional[dict[str, Any]]] = [None] * len(gen.rids)

    async def gather() -> None:
        while gen.open:
            delivery = await gen.next_event()
            if isinstance(delivery.event, RequestDone):
                outputs[delivery.choice] = delivery.event.output

    try:
        await unless_disconnected(gather(), request)
    finally:
        gen.abort()
    done = every_output(outputs)
    if any(o["meta_info"]["finish_reason"]["type"] == "abort" for o in done):
        raise server_error("request aborted: the server is shutting down", 503)
    return done


def every_output(outputs: list[Optional[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The choices' output dicts, once every choice has finished (a RequestDone each)."""
    done = [o for o in outputs if o is not None]
    assert len(done) == len(outputs), "every choice finished: its events ended with a RequestDone"
    return done


async def unless_disconnected(awaitable: Awaitable[T], request: Request) -> T:
    """`awaitable`'s result, or APIError 499 as soon as the client has gone (then it is cancelled)."""
    watcher = asyncio.ensure_future(_watch_disconnect(request))
    task = asyncio.ensure_future(awaitable)
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise APIError("client disconnected", 499)
        return task.result()
    finally:
        watcher.cancel()
        task.cancel()


async def _watch_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
