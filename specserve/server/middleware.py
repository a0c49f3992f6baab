"""GuardMiddleware: the API key and body-size checks every request passes, and the request counter.

The body limit counts the bytes actually received, chunked or not: the middleware reads the body
itself, answers 413 as soon as it passes the limit (without reading the rest), and replays what it
read to the app.
"""

from __future__ import annotations

import hmac
from typing import Optional

from starlette.responses import Response

from specserve.server.errors import APIError
from specserve.server.state import ServerState

# No API key needed: health, metrics, docs, and what a router reads to register a worker and balance load.
OPEN_PATHS = (
    "/health",
    "/metrics",
    "/docs",
    "/openapi.json",
    "/redoc",
    "/model_info",
    "/get_model_info",
    "/server_info",
    "/get_server_info",
    "/get_load",
)
KNOWN_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/generate",
    "/v1/models",
    "/health",
    "/metrics",
    "/health_generate",
    "/model_info",
    "/get_model_info",
    "/server_info",
    "/get_server_info",
    "/get_load",
    "/flush_cache",
)


class GuardMiddleware:
    """Pure ASGI, so streamed responses pass through untouched.

    A rejected request never reaches a route. Every HTTP request, rejected or not, is counted by
    endpoint (unknown paths as "other", to bound the label set) and final status code.
    """

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status = {"code": 500}  # a response that never started counts as a server error

        async def send_recording(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            rejection = self._reject(scope)
            if rejection is None:
                first, rejection = await self._read_body(receive)
            if rejection is not None:
                await rejection(scope, receive, send_recording)
            else:
                await self.app(scope, _replay(first, receive), send_recording)
        finally:
            endpoint = path if path in KNOWN_PATHS else "other"
            self.state.metrics.requests.labels(endpoint=endpoint, status=str(status["code"])).inc()

    async def _read_body(self, receive) -> tuple[dict, Optional[Response]]:
        """The first message the app will see (the whole body in one, or the client's disconnect),
        or a 413 once the bytes received pass the limit."""
        chunks, size, limit = [], 0, self.state.max_request_bytes
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left mid-body: the app sees that, not half a body
                return message, None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return {}, _too_large(f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}, None

    def _reject(self, scope) -> Optional[Response]:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.state.api_key and not scope["path"].startswith(OPEN_PATHS):
            given = headers.get("authorization", "")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.state.api_key.encode()):
                return APIError(
                    "invalid or missing API key (Authorization: Bearer ...)",
                    401,
                    code="invalid_api_key",
                    err_type="authentication_error",
                ).response()
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.state.max_request_bytes:
            return _too_large(f"request body of {length} bytes exceeds the limit of {self.state.max_request_bytes}")
        return None


def _too_large(message: str) -> Response:
    return APIError(message, 413, code="request_too_large").response()


def _replay(first: dict, receive):
    """A receive that hands the app the message read already, then the client's later messages."""
    pending = [first]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed
