"""What a router asks of a worker (SGLang's router, `sglang-router`, or any load balancer).

- `/health`: the engine process is alive (cheap; the router's default health check).
- `/health_generate`: the engine generates: a token came out recently, or a one-token request
  finishes within HEALTH_GENERATE_TIMEOUT_S.
- `/model_info`, `/server_info` (and their `get_` names): what the router registers the worker by.
- `/get_load`: SGLang's per-data-parallel-rank load list (one rank per specserve server).
- `/flush_cache`: drop the prefix cache's unheld entries.

Endpoints a router may forward that specserve does not implement (embeddings, rerank, the
Responses API, ...) answer 404 naming the endpoint, never a generic error.
"""

from __future__ import annotations

import asyncio
import os
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from specserve.sampling_params import SamplingParams
from specserve.server.engine_client import EngineUnavailable
from specserve.server.errors import APIError, server_error
from specserve.server.generation import Generation, collect
from specserve.server.state import ServerState

HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's bound for its own /health_generate
HEALTH_GENERATE_FRESH_S = 5.0  # a token event this recent already shows the engine generating
FLUSH_TIMEOUT_S = 30.0
UNSUPPORTED_ENDPOINTS = (
    "/v1/embeddings",
    "/v1/rerank",
    "/rerank",
    "/v1/responses",
    "/v1/score",
    "/v1/classify",
    "/classify",
    "/encode",
    "/v1/tokenize",
    "/v1/detokenize",
)


def add_worker_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health_generate")
    async def health_generate(request: Request) -> JSONResponse:
        if not state.client.healthy:
            return JSONResponse({"status": "error", "message": state.client.health_reason}, 503)
        last = state.client.last_output_at
        if last is not None and time.perf_counter() - last < HEALTH_GENERATE_FRESH_S:
            return JSONResponse({"status": "ok", "checked": "recent output"})
        try:
            await asyncio.wait_for(_one_token(state, request), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return JSONResponse({"status": "error", "message": f"no token within {HEALTH_GENERATE_TIMEOUT_S:g} s"}, 503)
        except APIError as exc:
            return JSONResponse({"status": "error", "message": exc.message}, 503)
        return JSONResponse({"status": "ok", "checked": "one-token generation"})

    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, lambda: model_info(state), methods=["GET"])
    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, lambda: server_info(state), methods=["GET"])

    @app.get("/get_load")
    async def get_load() -> list[dict[str, int]]:
        load, queued = state.client.load, state.client.queued
        waiting = load.get("waiting", 0) + queued
        return [
            {
                "dp_rank": 0,
                "num_reqs": load.get("running", 0) + waiting,
                "num_waiting_reqs": waiting,
                "num_tokens": load.get("kv_request_tokens", 0),
            }
        ]

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> dict[str, Any]:
        try:
            freed = await asyncio.wait_for(state.client.flush_cache(), FLUSH_TIMEOUT_S)
        except EngineUnavailable as exc:
            raise server_error(f"engine unavailable: {exc}", 503) from exc
        except asyncio.TimeoutError:
            raise server_error(f"the engine did not flush within {FLUSH_TIMEOUT_S:g} s", 503) from None
        return {"status": "ok", "flushed_tokens": freed}

    async def unsupported(request: Request) -> JSONResponse:
        return APIError(
            f"{request.url.path}: not supported by specserve, which serves text generation "
            "(/v1/chat/completions, /v1/completions, /generate)",
            404,
            code="unsupported_endpoint",
        ).response()

    for path in UNSUPPORTED_ENDPOINTS:
        app.add_api_route(path, unsupported, methods=["GET", "POST"], include_in_schema=False)


async def _one_token(state: ServerState, request: Request) -> None:
    """A one-token greedy request through the engine (APIError if it fails or cannot be queued;
    aborted if the health checker hangs up)."""
    gen = Generation(state, [state.tokenizer.encode("Hi")], [SamplingParams(max_new_tokens=1, temperature=0.0)])
    gen.start()
    await collect(gen, request)


def model_info(state: ServerState) -> dict[str, Any]:
    """SGLang's model info: the router names the worker's model by `served_model_name`."""
    return {
        "model_path": state.model_path,
        "tokenizer_path": state.model_path,
        "is_generation": True,
        "served_model_name": state.model_name,
        "context_length": state.context_length,
        "vocab_size": state.client.info["vocab_size"],
    }


def server_info(state: ServerState) -> dict[str, Any]:
    """The server's settings (never the API key) and its live state: one data-parallel rank."""
    info = {name: value for name, value in state.settings.items() if name != "api_key"}
    info.update(
        model_path=state.model_path,
        served_model_name=state.model_name,
        dp_size=1,
        version=_version(),
        pid=os.getpid(),
        engine_pid=state.client.info.get("pid"),
        context_length=state.context_length,
        max_total_num_tokens=state.client.info["kv_total_tokens"],
        speculative_algorithm=state.client.info["speculative_algorithm"],
        cpu_activations=state.client.info["cpu_activations"],  # auto as the engine resolved it
        internal_states=[dict(state.client.load, queued=state.client.queued)],
    )
    return info


def _version() -> str:
    try:
        return version("specserve")
    except PackageNotFoundError:
        return "unknown"
