"""`specserve serve`: start the engine process, then the HTTP server; stop both cleanly on SIGTERM.

If the engine dies (exits, or misses its heartbeat), every open request fails at once, /health
answers 503 with the reason, and the server exits non-zero within FATAL_EXIT_GRACE_S + a few
seconds, for its supervisor to restart it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import re
import signal
import time
from typing import Any

from specserve.args import ServerArgs
from specserve.server.engine_spawn import spawn_engine
from specserve.server.heartbeat import DEFAULT_HEARTBEAT_TIMEOUT_S, DEFAULT_STEP_TIMEOUT_S
from specserve.server.reasoning import REASONING_PARSERS
from specserve.server.tool_parsers import DEFAULT_TOOL_CALL_PARSER, TOOL_CALL_PARSERS

logger = logging.getLogger(__name__)

FATAL_EXIT_GRACE_S = 1.0  # after engine death: time to send the failed requests their errors
FORCE_EXIT_AFTER_S = 5.0  # then connections that do not close are dropped


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on the API routes")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: from the file)")
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="requests waiting for their first token beyond this answer 503 with Retry-After",
    )
    p.add_argument("--max-request-bytes", type=int, default=8 << 20, help="larger bodies answer 413")
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split a reasoning model's replies into reasoning_content and content (its format)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=DEFAULT_TOOL_CALL_PARSER,
        help="the format the model writes tool calls in (parsed into tool_calls; forced calls use it)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let in-flight requests finish before aborting them",
    )
    p.add_argument(
        "--engine-heartbeat-timeout",
        type=float,
        default=DEFAULT_HEARTBEAT_TIMEOUT_S,
        help="an engine process silent this long (stopped or wedged) is killed and the server exits",
    )
    p.add_argument(
        "--engine-step-timeout",
        type=float,
        default=DEFAULT_STEP_TIMEOUT_S,
        help="an engine stuck this long in one step stops its heartbeat (then the timeout above)",
    )


def served_model_name(model_path: str) -> str:
    """'SmolLM2-135M-Instruct.Q4_1.gguf' -> 'SmolLM2-135M-Instruct'; a directory -> its name."""
    name = os.path.basename(os.path.normpath(model_path))
    name = re.sub(r"\.gguf$", "", name, flags=re.IGNORECASE)
    return re.sub(r"\.(Q\d\w*|IQ\d\w*|F16|F32|BF16)$", "", name, flags=re.IGNORECASE)


def run_server(ns: argparse.Namespace, args: ServerArgs) -> int:
    if args.node_rank > 0:  # a node without rank 0 runs its ranks only; node 0 serves HTTP
        from specserve.engine.ranks import run_node_workers

        return run_node_workers(args)
    started_at = time.monotonic()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The engine first: it imports torch and loads the model while this process imports its own
    # modules and reads the tokenizer (server/engine_spawn.py).
    engine = spawn_engine(dataclasses.asdict(args), ns.engine_step_timeout)
    try:
        client, tokenizer, metrics, name, path = _front_end(ns, args, engine)
    except BaseException:
        engine.kill()  # it would only be loading: nothing of it to keep
        raise
    try:
        info = client.wait_ready()
        server, announcer = _http_server(ns, args, (client, tokenizer, metrics, name, path), info, started_at)
    except BaseException:
        client.shutdown()  # never leave a loaded engine behind a server that did not start
        raise
    try:
        server.run()
    finally:
        server.should_exit = True  # the announcer stops waiting if the server never started
        announcer.join()
        client.shutdown()
    return 0 if client.fatal is None else 1


def _http_server(ns: argparse.Namespace, args: ServerArgs, parts: tuple, info: dict[str, Any], started_at: float):
    """The uvicorn server over the ready engine, and the announcer that says when it answers."""
    import uvicorn

    from specserve.server.app import create_app
    from specserve.server.startup import ReadyAnnouncer, startup_block
    from specserve.server.startup import logger as startup_logger
    from specserve.server.state import ServerState

    client, tokenizer, metrics, name, path = parts
    url = f"http://{ns.host}:{ns.port}"
    startup_logger.info("%s", startup_block(name, info, url, time.monotonic() - started_at))
    settings = {**dataclasses.asdict(args), **{k: v for k, v in vars(ns).items() if k not in ("command", "func")}}
    state = ServerState(
        client, tokenizer, metrics, name, path, settings, ns.api_key, ns.max_queued_requests, ns.max_request_bytes,
        reasoning_parser=ns.reasoning_parser, tool_call_parser=ns.tool_call_parser,
    )  # fmt: skip
    # uvicorn's own start-up lines would repeat the block's address: at the default level, warnings only.
    uvicorn_level = "warning" if args.log_level.lower() == "info" else args.log_level.lower()
    config = uvicorn.Config(
        create_app(state),
        host=ns.host,
        port=ns.port,
        log_level=uvicorn_level,
        timeout_graceful_shutdown=ns.shutdown_timeout,
        access_log=False,
    )
    # uvicorn re-raises the signal it shut down on once it is done; with these no-op handlers
    # that re-raise is harmless and a SIGTERM'd server exits 0 after its graceful shutdown.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server = uvicorn.Server(config)
    client.on_fatal = lambda: _exit_soon(server)
    announcer = ReadyAnnouncer(server, url, started_at)
    announcer.start()
    return server, announcer


def _front_end(ns: argparse.Namespace, args: ServerArgs, engine) -> tuple[Any, Any, Any, str, str]:
    """The HTTP side's parts, made while the engine loads: its client, the tokenizer, metrics,
    the served name and the model's path."""
    from specserve.models.loader import resolve_model_path
    from specserve.server.engine_client import EngineClient
    from specserve.server.metrics import ServerMetrics
    from specserve.tokenizer.tokenizer import load_tokenizer

    path = resolve_model_path(args.model_path)
    name = ns.served_model_name or served_model_name(path)
    metrics = ServerMetrics(name)
    client = EngineClient(engine, metrics, ns.engine_heartbeat_timeout)
    tokenizer = load_tokenizer(args.tokenizer_path or path, chat_template=args.chat_template)
    return client, tokenizer, metrics, name, path


def _exit_soon(server) -> None:
    """Engine death (on the event loop): let the failed requests get their errors, then stop serving."""
    loop = asyncio.get_running_loop()
    loop.call_later(FATAL_EXIT_GRACE_S, setattr, server, "should_exit", True)
    loop.call_later(FATAL_EXIT_GRACE_S + FORCE_EXIT_AFTER_S, setattr, server, "force_exit", True)
