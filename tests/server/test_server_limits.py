"""A small server (64-token context, 4 queued requests, 64 KiB bodies) for overload, body limits,
fuzzing and graceful shutdown.

The tests run in file order: the last one stops the server with SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from helpers import MODEL
from helpers import ServerProcess

QUEUE = 4
BODY_LIMIT = 64 << 10


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    srv = ServerProcess("--context-length", "64", "--max-queued-requests", str(QUEUE), "--shutdown-timeout", "30",
                        "--max-request-bytes", str(BODY_LIMIT),
                        log_path=str(tmp_path_factory.mktemp("small") / "server.log"))
    yield srv
    srv.stop(signal.SIGKILL)


def chat_body(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **kw}


def chat(server, **kw) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=chat_body(**kw), timeout=120)


def test_a_request_that_can_never_be_queued_answers_400(small_server):
    r = chat(small_server, n=QUEUE + 1)
    assert r.status_code == 400 and "retry-after" not in r.headers, r.text
    assert r.json()["error"]["code"] == "exceeds_queue_limit" and r.json()["error"]["param"] == "n"
    assert chat(small_server, n=QUEUE).status_code == 200


def test_overload_answers_503_with_retry_after(small_server):
    engine = small_server.engine_pid()
    answers: list[int] = []
    os.kill(engine, signal.SIGSTOP)  # nothing reaches its first token: the queue fills deterministically
    try:
        waiting = [threading.Thread(target=lambda: answers.append(chat(small_server).status_code))
                   for _ in range(QUEUE)]
        for t in waiting:
            t.start()
        _wait_for_metric(small_server, "specserve_num_requests_queued", QUEUE)
        r = chat(small_server)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "overloaded"
    finally:
        os.kill(engine, signal.SIGCONT)
    for t in waiting:
        t.join(120)
    assert answers == [200] * QUEUE
    assert chat(small_server).status_code == 200


def _wait_for_metric(server, name: str, value: float, timeout_s: float = 30) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        if samples.get(name) == value:
            return
        time.sleep(0.1)
    raise AssertionError(f"{name} never reached {value}")


def _chunks(data: bytes, size: int = 4096):
    for i in range(0, len(data), size):
        yield data[i:i + size]


def test_body_limit_counts_the_bytes_received_chunked_or_not(small_server):
    url = small_server.url + "/v1/chat/completions"
    headers = {"content-type": "application/json"}
    big = json.dumps(chat_body(user="x" * (2 * BODY_LIMIT))).encode()
    for content in (big, _chunks(big)):  # with a Content-Length header, then chunked without one
        r = httpx.post(url, content=content, headers=headers, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    small = json.dumps(chat_body()).encode()
    r = httpx.post(url, content=_chunks(small, 16), headers=headers, timeout=60)  # a chunked body within the limit
    assert r.status_code == 200, r.text


GENERATING = ("POST /v1/chat/completions", "POST /v1/completions", "POST /generate")


def _satisfy_cross_field_rules(body: dict) -> None:
    """What the OpenAPI schema cannot say (one field's validity depending on another's), applied to a
    generated valid case so that it is valid: `top_logprobs` needs `logprobs`; tools are left out
    (a tool_choice needs the tools it names, and the tool descriptions alone overflow this server's
    64-token context; test_openai_structured.py covers tools); a conversation is cut to its last,
    short message (the context window is a limit of this server, not of the schema)."""
    if body.get("top_logprobs") is not None:
        body["logprobs"] = True
    body.pop("tools", None)
    body.pop("tool_choice", None)
    if isinstance(body.get("messages"), list) and body["messages"]:  # and a conversation must fit 64 tokens
        body["messages"] = body["messages"][-1:]
        if isinstance(body["messages"][0].get("content"), str):
            body["messages"][0]["content"] = body["messages"][0]["content"][:32]


def test_fuzzed_requests_never_get_5xx_and_valid_ones_generate(small_server):
    """Schema-driven fuzzing with `model` pinned to the served name, so generated cases reach the
    engine: no 5xx ever, and at least 30% of the valid cases of each generating route answer 2xx."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable

    schema = schemathesis.openapi.from_url(small_server.url + "/openapi.json")
    seen: dict[str, int] = {}
    positive_ok: dict[str, list[int]] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        for mode, examples in ((schemathesis.GenerationMode.POSITIVE, 20), (schemathesis.GenerationMode.NEGATIVE, 30)):
            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(op.as_strategy(generation_mode=mode))
            def call(case):
                if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
                    case.body["model"] = MODEL
                if mode == schemathesis.GenerationMode.POSITIVE and isinstance(case.body, dict):
                    _satisfy_cross_field_rules(case.body)
                response = case.call(base_url=small_server.url, timeout=120)
                seen[op.label] = seen.get(op.label, 0) + 1
                assert response.status_code < 500, (case.body, response.status_code, response.text[:500])
                if mode == schemathesis.GenerationMode.POSITIVE:
                    positive_ok.setdefault(op.label, []).append(response.status_code < 300)

            try:
                call()
            except Unsatisfiable:  # no invalid input exists (a GET, or POST /flush_cache: no parameters)
                assert mode == schemathesis.GenerationMode.NEGATIVE and (
                    op.method.upper() == "GET" or op.label == "POST /flush_cache"), op.label
    assert sum(seen.values()) >= 120 and len(seen) >= 6, seen
    shares = {label: sum(oks) / len(oks) for label, oks in positive_ok.items() if label in GENERATING}
    print("2xx share of valid fuzz cases:", shares)
    assert set(shares) == set(GENERATING) and min(shares.values()) >= 0.3, shares
    assert httpx.get(small_server.url + "/health", timeout=30).status_code == 200


def test_sigterm_finishes_in_flight_stream_and_exits_0(small_server):
    lines: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", small_server.url + "/v1/chat/completions", timeout=120,
                          json=chat_body(max_tokens=30, stream=True, ignore_eos=True)) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    code = small_server.stop(signal.SIGTERM)
    reader.join(30)
    assert code == 0, small_server.log()
    assert lines[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in lines[-2]
