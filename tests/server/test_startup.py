"""A first run that explains itself: `specserve serve` with no flags logs the start-up block and
one "ready" line, `--log-level warning` quiets them, and SIGTERM after real traffic (a streamed
request, a structured one) exits 0 with no native thread left unjoined ("terminate called")."""

from __future__ import annotations

import re
import time

import httpx

from helpers import MODEL, ServerProcess
from specserve.models.activations import INT8_REASON


def wait_for(srv: ServerProcess, pattern: str, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log = srv.log(whole=True)
        if re.search(pattern, log):
            return log
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} in the log:\n{srv.log()}")


def test_default_serve_logs_the_block_and_ready_and_exits_cleanly(tmp_path):
    srv = ServerProcess(log_path=str(tmp_path / "server.log"), log_level=None)
    try:
        log = wait_for(srv, r"ready: http://127\.0\.0\.1:\d+ answers \(/health 200\)")
        block = log[log.index("serving "):]
        assert f"serving {MODEL}" in block
        assert re.search(r"model +SmolLM2-135M-Instruct\.Q4_1\.gguf: llama, 134\.5M parameters; weights Q4_1 x210", block)
        compute = r"compute +bfloat16 on cpu, (avx512_bf16|avx2_fma|generic) kernels, \d+ threads, TP 1"
        assert re.search(compute, block)
        assert f"  activations  int8 for the quantized linears ({INT8_REASON})" in block  # models/activations.py
        assert re.search(r"KV cache +[\d,]+ tokens; context 8,192", block)
        assert "  weight cache off (SPECSERVE_WEIGHT_CACHE_DIR=off)" in block  # the test suite's setting (conftest.py)
        assert re.search(r"speculation +adaptive policy over DSPARK \(smollm2-135m-instruct\), NGRAM", block)
        assert f"address      {srv.url} (OpenAI API under /v1" in block
        assert log.index("serving ") < log.index("ready: "), "the ready line comes after the block"
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8}
        streamed = httpx.post(srv.url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=120)
        assert streamed.status_code == 200 and "data: [DONE]" in streamed.text
        structured = httpx.post(srv.url + "/v1/chat/completions", timeout=120,
                                json={**chat, "response_format": {"type": "json_object"}})
        assert structured.status_code == 200, structured.text
    finally:
        code = srv.stop()
    log = srv.log(whole=True)
    assert code == 0, log[-3000:]
    assert "terminate called" not in log and "Traceback" not in log, log[-3000:]
    assert "engine process exited with code" not in log, log[-3000:]  # the engine's own exit was clean too
    # One line says what the stop drained: here nothing (both requests had finished).
    assert "shutdown: drained 0 running and 0 waiting requests (aborted 0), freed 0 KV slots" in log, log[-3000:]


def test_log_level_warning_quiets_the_start_up_lines(tmp_path):
    srv = ServerProcess(log_path=str(tmp_path / "server.log"), log_level="warning")
    try:
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
        time.sleep(1.0)  # the ready line, if any, follows /health's first answer closely
    finally:
        code = srv.stop()
    log = srv.log(whole=True)
    assert code == 0 and "serving " not in log and "ready: " not in log and " INFO " not in log, log[-3000:]
