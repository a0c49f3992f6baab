"""The HTTP server: OpenAI-compatible chat and completions, the native /generate, health, metrics.

Every request is validated (pydantic models in protocol.py, then the engine's own checks) and a
client error answers with an OpenAI-style error body naming the field; nothing else is disturbed.
Requests run in the engine process (engine_client.py); a client that goes away mid-request aborts
it there, which frees its KV slots.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.tokenizer.tokenizer import Tokenizer
from specserve.server.engine_client import EngineClient, EngineUnavailable
from specserve.server.metrics import ServerMetrics
from specserve.server.protocol import (ChatCompletionRequest, CompletionRequest, GenerateRequest, RequestError,
                                       _SamplingFields)
from specserve.server.text_stream import TextStream

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25
SPEC_KEYS = ("spec_verify_ct", "spec_num_correct_drafts", "spec_accept_length", "spec_correct_drafts_histogram",
             "spec_cap_trim_histogram")


@dataclass
class ServerState:
    """What the routes need; one per app."""

    client: EngineClient
    tokenizer: Tokenizer
    metrics: ServerMetrics
    model_name: str
    api_key: Optional[str] = None
    max_queued_requests: int = 256
    max_request_bytes: int = 8 << 20

    @property
    def context_length(self) -> int:
        return self.client.info["context_length"]


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="specserve", version="0.1.0")
    app.state.server = state

    @app.on_event("startup")
    async def _attach() -> None:
        state.client.attach(asyncio.get_running_loop())

    _install_error_handlers(app)
    app.add_middleware(GuardMiddleware, state=state)
    _add_info_routes(app, state)
    _add_generation_routes(app, state)
    return app


# ------------------------------------------------------------------ errors and guards


def _error(exc: RequestError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=getattr(exc, "headers", None))


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(validation_to_request_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return _error(RequestError(str(exc.detail), exc.status_code, code=code))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error")
        return _error(RequestError(f"internal error: {type(exc).__name__}", 500, err_type="server_error"))


def validation_to_request_error(errors: list[dict]) -> RequestError:
    """The first pydantic error as a 400 naming the field (json_invalid: the body is not JSON)."""
    err = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return RequestError(f"request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}",
                            code="invalid_json")
    if not loc and err.get("type") in ("model_attributes_type", "dict_type", "missing"):
        return RequestError("request body: must be a JSON object (send Content-Type: application/json)",
                            code="invalid_value")
    param = ".".join(loc) or None
    msg = err["msg"].removeprefix("Value error, ")
    if err.get("type") == "extra_forbidden":
        msg = "unknown field (not part of the API or not supported by specserve)"
    return RequestError(f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


class GuardMiddleware:
    """Pure ASGI (streaming-safe): API key, request body size, and the per-status request counter."""

    OPEN_PATHS = ("/health", "/metrics", "/docs", "/openapi.json", "/redoc")

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status = {"code": 500}

        async def send_recording(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            rejection = self._reject(scope)
            if rejection is not None:
                await rejection(scope, receive, send_recording)
            else:
                await self.app(scope, receive, send_recording)
        finally:
            endpoint = path if path in KNOWN_PATHS else "other"
            self.state.metrics.requests.labels(endpoint=endpoint, status=str(status["code"])).inc()

    def _reject(self, scope) -> Optional[Response]:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.state.api_key and not scope["path"].startswith(self.OPEN_PATHS):
            given = headers.get("authorization", "")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.state.api_key.encode()):
                return _error(RequestError("invalid or missing API key (Authorization: Bearer ...)", 401,
                                           code="invalid_api_key", err_type="authentication_error"))
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.state.max_request_bytes:
            return _error(RequestError(f"request body of {length} bytes exceeds the limit of "
                                       f"{self.state.max_request_bytes}", 413, code="request_too_large"))
        return None


KNOWN_PATHS = ("/v1/chat/completions", "/v1/completions", "/generate", "/v1/models", "/health", "/metrics")


# ------------------------------------------------------------------ info routes


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        if state.client.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "error", "message": state.client.fatal or "engine not running"}, 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                             "owned_by": "specserve", "max_model_len": state.context_length}]}


# ------------------------------------------------------------------ generation


class Generation:
    """The n engine requests behind one API request, their events on one queue, abort on exit."""

    def __init__(self, state: ServerState, prompt_ids: list[list[int]], params: list[dict[str, Any]]):
        self.state = state
        self.sink: asyncio.Queue = asyncio.Queue()
        base = uuid.uuid4().hex
        self.rids = [f"{base}-{i}" for i in range(len(prompt_ids))]
        self.prompt_ids = prompt_ids
        self.params = params
        self.open = set(range(len(prompt_ids)))

    def start(self) -> None:
        client = self.state.client
        if client.queued + len(self.rids) > self.state.max_queued_requests:
            err = RequestError(f"server overloaded: {client.queued} requests queued (limit "
                               f"{self.state.max_queued_requests}); retry later", 503, code="overloaded",
                               err_type="server_error")
            err.headers = {"Retry-After": "1"}
            raise err
        try:
            for i, (rid, ids, params) in enumerate(zip(self.rids, self.prompt_ids, self.params)):
                client.submit(rid, ids, params, self.sink, index=i)
        except EngineUnavailable as exc:
            self.abort()
            raise RequestError(f"engine unavailable: {exc}", 503, err_type="server_error") from exc

    async def next_event(self) -> tuple[str, int, Any]:
        kind, index, payload = await self.sink.get()
        if kind in ("done", "error", "fatal"):
            self.open.discard(index)
        if kind == "error":
            self.abort()
            raise RequestError(payload, 400, param=_param_of(payload), code=_code_of(payload))
        if kind == "fatal":
            self.abort()
            raise RequestError(f"engine failed: {payload.splitlines()[0]}", 500, err_type="server_error")
        return kind, index, payload

    def abort(self) -> None:
        for i in list(self.open):
            self.state.client.abort(self.rids[i])
        self.open.clear()


def _param_of(message: str) -> Optional[str]:
    head = message.split(":", 1)[0]
    return head if head and " " not in head else None


def _code_of(message: str) -> Optional[str]:
    return "context_length_exceeded" if "context window" in message or "KV slots" in message else "invalid_value"


async def _watch_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _collect(gen: Generation, request: Request) -> list[dict[str, Any]]:
    """Wait for every choice to finish; a client that disconnects aborts them."""
    outputs: list[Optional[dict]] = [None] * len(gen.rids)

    async def gather() -> None:
        while gen.open:
            kind, index, payload = await gen.next_event()
            if kind == "done":
                outputs[index] = payload

    watcher = asyncio.ensure_future(_watch_disconnect(request))
    task = asyncio.ensure_future(gather())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise RequestError("client disconnected", 499)
        task.result()
    finally:
        watcher.cancel()
        task.cancel()
        gen.abort()
    _check_not_aborted(outputs)
    return outputs


def _check_not_aborted(outputs: list[dict]) -> None:
    if any(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outputs):
        raise RequestError("request aborted: the server is shutting down", 503, err_type="server_error")


async def _first_event(gen: Generation) -> tuple[str, int, Any]:
    """Before a stream starts: surface an engine rejection as a plain HTTP error, not a broken stream."""
    try:
        return await gen.next_event()
    except BaseException:
        gen.abort()
        raise


def _sse(obj: Union[dict, str]) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


def _spec_extension(outputs: list[dict]) -> dict[str, Any]:
    return {"choices": [{"index": i, "cached_tokens": o["meta_info"]["cached_tokens"],
                         **{k: o["meta_info"][k] for k in SPEC_KEYS if k in o["meta_info"]}}
                        for i, o in enumerate(outputs)]}


def _usage(prompt_tokens: int, outputs: list[dict]) -> dict[str, Any]:
    completion = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    accepted = sum(o["meta_info"].get("spec_num_correct_drafts", 0) for o in outputs)
    cached = max(o["meta_info"]["cached_tokens"] for o in outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"accepted_prediction_tokens": accepted, "reasoning_tokens": 0}}


def _finish_reason(output: dict) -> str:
    return output["meta_info"]["finish_reason"]["type"]


def _check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise RequestError(f"model: '{model}' is not served here (available: '{state.model_name}')", 404,
                           param="model", code="model_not_found")


def _check_context(state: ServerState, ids: list[int], field: str) -> None:
    if len(ids) >= state.context_length:
        raise RequestError(f"{field}: {len(ids)} tokens do not fit the context window of {state.context_length} "
                           "tokens", 400, param=field, code="context_length_exceeded")


def _engine_params(state: ServerState, body: _SamplingFields, limit: Optional[int], n_ids: int,
                   seed_offset: int) -> dict[str, Any]:
    params = body.sampling_params(limit if limit is not None else state.context_length - n_ids)
    if body.seed is not None and seed_offset:  # n choices with one seed: distinct, reproducible streams
        params["seed"] = (body.seed + seed_offset) % (2**63)
    return params


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(state, body.model)
        messages = [m.as_template_message() for m in body.messages]
        try:
            ids = await asyncio.to_thread(state.tokenizer.apply_chat_template, messages)
        except Exception as exc:  # the template rejects the conversation (e.g. role order)
            raise RequestError(f"messages: {exc}", 400, param="messages") from exc
        _check_context(state, ids, "messages")
        params = [_engine_params(state, body, body.token_limit(), len(ids), i) for i in range(body.n)]
        gen = Generation(state, [ids] * body.n, params)
        gen.start()
        if body.stream:
            first = await _first_event(gen)
            return StreamingResponse(_chat_stream(state, body, gen, first, len(ids)), media_type="text/event-stream")
        outputs = await _collect(gen, request)
        return {"id": f"chatcmpl-{gen.rids[0]}", "object": "chat.completion", "created": int(time.time()),
                "model": state.model_name,
                "choices": [{"index": i, "message": {"role": "assistant", "content": o["text"]}, "logprobs": None,
                             "finish_reason": _finish_reason(o)} for i, o in enumerate(outputs)],
                "usage": _usage(len(ids), outputs), "specserve": _spec_extension(outputs)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(state, body.model)
        prompts = [await asyncio.to_thread(state.tokenizer.encode, p) if isinstance(p, str) else p
                   for p in body.prompts()]
        vocab = state.client.info["vocab_size"]
        for ids in prompts:
            if any(t < 0 or t >= vocab for t in ids):
                raise RequestError(f"prompt: token ids must be in [0, {vocab})", 400, param="prompt")
            _check_context(state, ids, "prompt")
        # choices: n per prompt, prompt-major (OpenAI's order)
        ids_list = [ids for ids in prompts for _ in range(body.n)]
        params = [_engine_params(state, body, body.token_limit(), len(ids), i % body.n) for i, ids in enumerate(ids_list)]
        gen = Generation(state, ids_list, params)
        gen.start()
        prompt_tokens = sum(len(p) for p in prompts)
        if body.stream:
            first = await _first_event(gen)
            return StreamingResponse(_completion_stream(state, body, gen, first, prompt_tokens),
                                     media_type="text/event-stream")
        outputs = await _collect(gen, request)
        return {"id": f"cmpl-{gen.rids[0]}", "object": "text_completion", "created": int(time.time()),
                "model": state.model_name,
                "choices": [{"index": i, "text": o["text"], "logprobs": None, "finish_reason": _finish_reason(o)}
                            for i, o in enumerate(outputs)],
                "usage": _usage(prompt_tokens, outputs), "specserve": _spec_extension(outputs)}

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        if body.text is not None:
            ids = await asyncio.to_thread(state.tokenizer.encode, body.text)
        else:
            ids = list(body.input_ids)
        _check_context(state, ids, "text" if body.text is not None else "input_ids")
        params = dict(body.sampling_params)
        params.setdefault("max_new_tokens", min(128, state.context_length - len(ids)))
        gen = Generation(state, [ids], [params])
        gen.start()
        if body.stream:
            first = await _first_event(gen)
            return StreamingResponse(_generate_stream(state, gen, first), media_type="text/event-stream")
        return (await _collect(gen, request))[0]


# ------------------------------------------------------------------ streams


async def _events(gen: Generation, first: tuple[str, int, Any]) -> AsyncIterator[tuple[str, int, Any]]:
    """All events of a generation; abort whatever is left if the consumer stops (client gone)."""
    try:
        yield first
        while gen.open:
            yield await gen.next_event()
    finally:
        gen.abort()


async def _chat_stream(state: ServerState, body: ChatCompletionRequest, gen: Generation,
                       first: tuple[str, int, Any], prompt_tokens: int) -> AsyncIterator[str]:
    head = {"id": f"chatcmpl-{gen.rids[0]}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": state.model_name}

    def chunk(index: int, delta: dict, finish: Optional[str] = None, **extra) -> str:
        return _sse({**head, "choices": [{"index": index, "delta": delta, "logprobs": None,
                                          "finish_reason": finish}], **extra})

    for i in range(len(gen.rids)):
        yield chunk(i, {"role": "assistant", "content": ""})
    async for piece in _text_pieces(state, body.stop_list(), gen, first, prompt_tokens, body.include_usage):
        if piece[0] == "text":
            yield chunk(piece[1], {"content": piece[2]})
        elif piece[0] == "finish":
            yield chunk(piece[1], {}, piece[2], specserve=_spec_extension([piece[3]])["choices"][0])
        elif piece[0] == "error":
            yield _sse(piece[1])
        else:
            yield _sse({**head, "choices": [], "usage": piece[1]})
    yield _sse("[DONE]")


async def _completion_stream(state: ServerState, body: CompletionRequest, gen: Generation,
                             first: tuple[str, int, Any], prompt_tokens: int) -> AsyncIterator[str]:
    head = {"id": f"cmpl-{gen.rids[0]}", "object": "text_completion", "created": int(time.time()),
            "model": state.model_name}
    async for piece in _text_pieces(state, body.stop_list(), gen, first, prompt_tokens, body.include_usage):
        if piece[0] == "text":
            yield _sse({**head, "choices": [{"index": piece[1], "text": piece[2], "logprobs": None,
                                             "finish_reason": None}]})
        elif piece[0] == "finish":
            yield _sse({**head, "choices": [{"index": piece[1], "text": "", "logprobs": None,
                                             "finish_reason": piece[2]}],
                        "specserve": _spec_extension([piece[3]])["choices"][0]})
        elif piece[0] == "error":
            yield _sse(piece[1])
        else:
            yield _sse({**head, "choices": [], "usage": piece[1]})
    yield _sse("[DONE]")


async def _text_pieces(state: ServerState, stops: list[str], gen: Generation, first: tuple[str, int, Any],
                       prompt_tokens: int, include_usage: bool) -> AsyncIterator[tuple]:
    """("text", index, delta), ("finish", index, reason, output), then ("usage", usage) or ("error", body)."""
    streams = [TextStream(state.tokenizer, stops) for _ in gen.rids]
    outputs: list[Optional[dict]] = [None] * len(gen.rids)
    try:
        async for kind, index, payload in _events(gen, first):
            if kind == "tokens":
                delta = streams[index].add(payload)
                if delta:
                    yield ("text", index, delta)
                continue
            outputs[index] = payload
            rest = streams[index].finish(payload["text"])
            if rest:
                yield ("text", index, rest)
            yield ("finish", index, _finish_reason(payload), payload)
    except RequestError as exc:  # the engine failed mid-stream: say so in the stream, then end it
        yield ("error", exc.body())
        return
    if include_usage:
        yield ("usage", _usage(prompt_tokens, outputs))


async def _generate_stream(state: ServerState, gen: Generation, first: tuple[str, int, Any]) -> AsyncIterator[str]:
    """Native streaming: cumulative text and ids per delivery, then the final output dict."""
    ids: list[int] = []
    try:
        async for kind, _, payload in _events(gen, first):
            if kind == "tokens":
                ids += payload
                yield _sse({"text": state.tokenizer.decode(ids), "output_ids": ids})
            else:
                yield _sse(payload)
    except RequestError as exc:
        yield _sse(exc.body())
    yield _sse("[DONE]")
