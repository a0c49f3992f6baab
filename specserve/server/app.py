"""The HTTP server: OpenAI-compatible chat and completions, the native /generate, health, metrics,
and what a router asks of its workers (worker_routes.py).

Every request is validated (pydantic models in protocol.py, then the engine's own checks) and a
client error answers with an OpenAI-style error body naming the field; nothing else is disturbed.
Requests run in the engine process (engine_client.py); a client that goes away mid-request aborts
it there, which frees its KV slots.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI

from specserve.server.errors import install_error_handlers
from specserve.server.fields import bound_by_vocab
from specserve.server.middleware import GuardMiddleware
from specserve.server.routes import add_generation_routes, add_info_routes
from specserve.server.state import ServerState
from specserve.server.worker_routes import add_worker_routes


def create_app(state: ServerState) -> FastAPI:
    """The app for one engine client; it routes the engine's events once its event loop runs."""
    app = FastAPI(title="specserve", version="0.1.0")
    app.state.server = state

    @app.on_event("startup")
    async def _attach() -> None:
        state.client.attach(asyncio.get_running_loop())

    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, state=state)
    add_info_routes(app, state)
    add_generation_routes(app, state)
    add_worker_routes(app, state)
    _document_vocab_bounds(app, state.client.info["vocab_size"])
    return app


def _document_vocab_bounds(app: FastAPI, vocab_size: int) -> None:
    """The OpenAPI schema states the served model's bounds on token ids and top_k."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            bound_by_vocab(build(), vocab_size)
        assert app.openapi_schema is not None, "build() keeps the schema it makes"
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend its schema
