"""Engine death is loud and final: open requests fail at once, /health says why in one line, and
the server exits non-zero within seconds so that a supervisor restarts it.

Each test kills its own server (a small one: 256-token context).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from helpers import MODEL, ServerProcess

HEARTBEAT_TIMEOUT_S = 4
EXIT_WITHIN_S = 30  # engine death noticed, the failed requests answered, the server gone


@pytest.fixture
def doomed_server(tmp_path):
    srv = ServerProcess("--context-length", "256", "--engine-heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
                        log_path=str(tmp_path / "server.log"))
    engine = srv.engine_pid()
    yield srv
    srv.stop(signal.SIGKILL)
    _kill_quietly(engine)


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class OpenStream(threading.Thread):
    """One streamed chat request that runs until the server ends it; records its SSE lines."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.lines, self.error = url, [], None
        self.started, self.ended = threading.Event(), threading.Event()

    def run(self) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to a thousand."}],
                "max_tokens": 200, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.started.set()
        except httpx.HTTPError as exc:  # the connection dropped: also an ending, but not the one we want
            self.error = exc
        finally:
            self.started.set()
            self.ended.set()

    def error_body(self) -> dict:
        """The OpenAI error body the stream ended with."""
        assert self.lines[-1] == "data: [DONE]", self.lines[-3:]
        return json.loads(self.lines[-2].removeprefix("data: "))["error"]


class HealthWatcher(threading.Thread):
    """Polls /health until the server stops answering; keeps the first non-200 answer."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.unhealthy = url, None

    def run(self) -> None:
        while True:
            try:
                r = httpx.get(self.url + "/health", timeout=5)
            except httpx.HTTPError:
                return
            if r.status_code != 200 and self.unhealthy is None:
                self.unhealthy = (r.status_code, r.json())
            time.sleep(0.05)


def _streams_under_load(srv: ServerProcess, n: int = 3) -> list[OpenStream]:
    streams = [OpenStream(srv.url) for _ in range(n)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(120) and not s.ended.is_set(), srv.log()
    return streams


def _assert_dies_loudly(srv: ServerProcess, streams: list[OpenStream], watcher: HealthWatcher,
                        reason: str) -> None:
    for s in streams:
        assert s.ended.wait(EXIT_WITHIN_S), "an open stream hung after the engine died"
        assert s.error is None, s.error
        err = s.error_body()
        assert err["type"] == "server_error" and reason in err["message"], err
    srv.proc.wait(EXIT_WITHIN_S)
    assert srv.proc.returncode not in (None, 0), srv.log()
    watcher.join(10)
    status, body = watcher.unhealthy
    assert status == 503 and reason in body["message"] and "\n" not in body["message"], body
    assert "Traceback" not in body["message"]


def test_sigkill_of_the_engine_fails_open_streams_and_the_server_exits_non_zero(doomed_server):
    streams = _streams_under_load(doomed_server)
    watcher = HealthWatcher(doomed_server.url)
    watcher.start()
    os.kill(doomed_server.engine_pid(), signal.SIGKILL)
    _assert_dies_loudly(doomed_server, streams, watcher, "engine process exited with code -9")


def test_a_stopped_engine_misses_its_heartbeat_and_is_killed(doomed_server):
    engine = doomed_server.engine_pid()
    streams = _streams_under_load(doomed_server)
    watcher = HealthWatcher(doomed_server.url)
    watcher.start()
    os.kill(engine, signal.SIGSTOP)
    _assert_dies_loudly(doomed_server, streams, watcher, "stopped answering")
    time.sleep(1)
    with pytest.raises(ProcessLookupError):  # killed by the server, not left stopped
        os.kill(engine, 0)
