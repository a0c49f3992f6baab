"""The routes: OpenAI chat and completions, the native /generate, health, metrics and the model list.

A generation route validates what only the server can check (model name, chat template, token ids,
context window), parses and validates its sampling params once into a typed `SamplingParams` per
choice (what goes to the engine process), and either streams the events or waits for every choice.
What depends on the engine's state (KV room) and the grammar's compile are checked by the engine,
whose rejection answers 400 before a stream starts.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specserve.errors import InvalidRequestError
from specserve.sampling_params import SAMPLING_FIELDS, SamplingParams
from specserve.server.errors import APIError, api_rejection
from specserve.server.generation import Generation, collect
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest, SamplingFields
from specserve.server.reasoning import ReasoningSetup
from specserve.server.responses import chat_completion, text_completion
from specserve.server.sampling_models import openai_param_names
from specserve.server.sse import chat_stream, completion_stream, generate_stream
from specserve.server.state import ServerState

SSE = "text/event-stream"
GENERATE_DEFAULT_MAX_NEW_TOKENS = 128
# The engine's field names in its errors -> OpenAI's (max_new_tokens -> max_tokens), from the declarations.
OPENAI_PARAM_NAMES = openai_param_names(SAMPLING_FIELDS)
# A chat's grammar error (from the engine's compile) names the field the schema came in.
CHAT_PARAM_NAMES = {**OPENAI_PARAM_NAMES, "sampling_params.json_schema": "response_format",
                    "sampling_params.regex": "regex", "sampling_params.ebnf": "ebnf"}  # fmt: skip


def add_info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        if state.client.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "error", "message": state.client.health_reason}, 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": state.started_at,
                    "owned_by": "specserve",
                    "max_model_len": state.context_length,
                }
            ],
        }


def add_generation_routes(app: FastAPI, state: ServerState) -> None:
    """The endpoints that generate: OpenAI's chat and text completions and SGLang's native /generate."""
    _add_chat_route(app, state)
    _add_completion_route(app, state)
    _add_generate_route(app, state)


def _add_chat_route(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(state, body.model)
        text, ids = await asyncio.to_thread(_render_chat, state, body)
        _check_context(state, ids, "messages")
        params = [_parse_params(state, _engine_params(state, body, len(ids), i), OPENAI_PARAM_NAMES) for i in range(body.n)]
        gen = Generation(state, [ids] * body.n, params, CHAT_PARAM_NAMES)
        gen.start()
        parser = state.reasoning_parser if body.separate_reasoning else None
        reasoning = ReasoningSetup.for_prompt(parser, text, body.stream_reasoning)
        if body.stream:
            first = await gen.first_event(request)
            return StreamingResponse(chat_stream(state, body, gen, first, len(ids), reasoning), media_type=SSE)
        outputs = await collect(gen, request)
        tools = body.tool_format(state.tool_call_parser)
        return chat_completion(gen.rids[0], state.model_name, outputs, len(ids), state.tokenizer, tools, reasoning)


def _render_chat(state: ServerState, body: ChatCompletionRequest) -> tuple[str, list[int]]:
    """The conversation through the model's template (with the request's template variables): its
    text and token ids."""
    try:
        text = state.tokenizer.render_chat(body.template_messages(state.tool_call_parser), True, body.template_variables())
    except InvalidRequestError as exc:  # a field the template refuses, named
        raise APIError(str(exc), 400, param=exc.param or "messages") from exc
    except Exception as exc:  # the template rejects the conversation (e.g. role order)
        raise APIError(f"messages: {exc}", 400, param="messages") from exc
    return text, state.tokenizer.encode(text, add_special_tokens=False)


def _add_completion_route(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(state, body.model)
        prompts = [await asyncio.to_thread(state.tokenizer.encode, p) if isinstance(p, str) else p for p in body.prompts()]
        for ids in prompts:
            _check_token_ids(state, ids, "prompt")
            _check_context(state, ids, "prompt")
        ids_list = [ids for ids in prompts for _ in range(body.n)]  # n choices per prompt, prompt-major
        params = [
            _parse_params(state, _engine_params(state, body, len(ids), i % body.n), OPENAI_PARAM_NAMES)
            for i, ids in enumerate(ids_list)
        ]
        gen = Generation(state, ids_list, params, OPENAI_PARAM_NAMES)
        gen.start()
        prompt_tokens = sum(len(p) for p in prompts)
        echo = [(_prompt_text(state, p), ids) for p, ids in zip(body.prompts(), prompts) for _ in range(body.n)]
        if body.stream:
            first = await gen.first_event(request)
            return StreamingResponse(completion_stream(state, body, gen, first, prompt_tokens, echo), media_type=SSE)
        return text_completion(
            gen.rids[0],
            state.model_name,
            await collect(gen, request),
            prompt_tokens,
            state.tokenizer,
            echo if body.echo else None,
        )


def _add_generate_route(app: FastAPI, state: ServerState) -> None:
    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        if body.model is not None:
            _check_model(state, body.model)
        if body.text is not None:
            ids = await asyncio.to_thread(state.tokenizer.encode, body.text)
        else:
            assert body.input_ids is not None, "GenerateRequest: exactly one of text and input_ids"
            ids = list(body.input_ids)
            _check_token_ids(state, ids, "input_ids")
        _check_context(state, ids, "text" if body.text is not None else "input_ids")
        params = body.engine_params()
        params.setdefault("max_new_tokens", min(GENERATE_DEFAULT_MAX_NEW_TOKENS, state.context_length - len(ids)))
        gen = Generation(state, [ids], [_parse_params(state, params, {})], {})
        gen.start()
        if body.stream:
            first = await gen.first_event(request)
            return StreamingResponse(generate_stream(state, gen, first), media_type=SSE)
        return (await collect(gen, request))[0]


def _prompt_text(state: ServerState, prompt: "str | list[int]") -> str:
    return prompt if isinstance(prompt, str) else state.tokenizer.decode(prompt)


def _check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise APIError(
            f"model: '{model}' is not served here (available: '{state.model_name}')",
            404,
            param="model",
            code="model_not_found",
        )


def _check_token_ids(state: ServerState, ids: list[int], field: str) -> None:
    vocab = state.client.info["vocab_size"]
    if any(t < 0 or t >= vocab for t in ids):
        raise APIError(f"{field}: token ids must be in [0, {vocab})", 400, param=field)


def _parse_params(state: ServerState, params: dict[str, Any], names: dict[str, str]) -> SamplingParams:
    """The request's sampling params parsed and validated, with the vocabulary, once, before anything
    is queued: a 400 naming the request's field (`names` maps the engine's field names to the API's)."""
    try:
        return SamplingParams.from_dict(params, state.client.info["vocab_size"])
    except InvalidRequestError as exc:
        raise api_rejection(str(exc), exc.param, exc.code, names) from exc


def _check_context(state: ServerState, ids: list[int], field: str) -> None:
    if len(ids) >= state.context_length:
        raise APIError(
            f"{field}: {len(ids)} tokens do not fit the context window of {state.context_length} tokens",
            400,
            param=field,
            code="context_length_exceeded",
        )


def _engine_params(state: ServerState, body: SamplingFields, n_ids: int, seed_offset: int) -> dict[str, Any]:
    """Engine sampling params of one choice; without a token limit it may fill the context window."""
    limit: Optional[int] = body.token_limit()
    budget = limit if limit is not None else state.context_length - n_ids
    if isinstance(body, ChatCompletionRequest):  # a forced call's grammar writes the server's tool format
        params = body.sampling_params(budget, state.tool_call_parser)
    else:
        params = body.sampling_params(budget)
    if body.seed is not None and seed_offset:  # n choices with one seed: distinct, reproducible streams
        params["seed"] = (body.seed + seed_offset) % (2**63)
    return params
