"""specserve replicas behind SGLang's router (`specserve serve --dp-size 2`): answers equal a direct
request, a conversation's later turns land where its prefix is cached, and a SIGKILLed replica is
taken out of rotation, fails its open requests with an error, and comes back.

The router's health checks run every second here (one failure marks a worker unhealthy, one success
healthy again), so a dead replica is noticed within a few seconds."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from helpers import MODEL, free_port
from specserve.server.replicas import healthy_workers, stop_process, wait_for_workers

STARTUP_S = 300
NOTICE_S = 30  # the router marks a killed replica unhealthy within this (checks every 1 s)
RESTART_S = 180  # the launcher restarts it and the router sees it healthy within this
LONG_QUESTION = ("I am planning a week-long trip through the mountains of northern Italy in early autumn, "
                 "travelling by train and on foot, and I would like to visit small villages, eat local food "
                 "and avoid crowded places. ")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.load(r)


def _post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


class Fleet:
    """The launcher (2 bf16 replicas, the cache-aware router) and a round-robin router over the same replicas."""

    def __init__(self, log_dir):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(os.path.join(log_dir, "fleet.log"), "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specserve.cli", "serve", "--dp-size", "2", "--port", str(self.port),
             "--dtype", "bfloat16", "--speculative-algorithm", "NONE", "--max-total-tokens", "4096",
             "--log-level", "info", "--router-health-check-interval", "1",
             "--router-args", "--health-failure-threshold 1 --health-success-threshold 1"],
            stdout=self._log, stderr=subprocess.STDOUT)
        workers = wait_for_workers(self.url, 2, STARTUP_S, alive=lambda: self.proc.poll() is None)
        self.replicas = sorted(workers)
        self.rr_url = f"http://127.0.0.1:{free_port()}"
        self.rr = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--port", self.rr_url.rsplit(":", 1)[1],
             "--policy", "round_robin", "--prometheus-port", str(free_port()), "--log-level", "warn",
             "--health-check-interval-secs", "1", "--worker-urls", *self.replicas],
            stdout=self._log, stderr=subprocess.STDOUT)
        wait_for_workers(self.rr_url, 2, 60, alive=lambda: self.rr.poll() is None)

    def log(self) -> str:
        self._log.flush()
        with open(self._log.name) as f:
            return f.read()[-6000:]

    def stop(self) -> int:
        stop_process(self.rr, signal.SIGTERM, 30)
        code = stop_process(self.proc, signal.SIGTERM, 90)
        self._log.close()
        return code


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    fleet = Fleet(str(tmp_path_factory.mktemp("fleet")))
    yield fleet
    code = fleet.stop()
    assert code == 0, f"launcher exited with {code} on SIGTERM:\n{fleet.log()}"


def _client(url: str):
    import openai
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(url: str, messages: list[dict], max_tokens: int, stream: bool = False):
    """(text, usage) of a greedy chat request."""
    c = _client(url)
    if not stream:
        r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
        return r.choices[0].message.content, r.usage
    chunks = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    for ch in chunks:
        text += "".join(choice.delta.content or "" for choice in ch.choices)
        usage = ch.usage or usage
    return text, usage


def test_router_answers_equal_each_replica_directly(fleet):
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    routed = _chat(fleet.url, messages, 24)[0]
    assert routed and routed == _chat(fleet.url, messages, 24, stream=True)[0]
    body = {"text": "The three primary colours are", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    status, generated = _post(fleet.url + "/generate", body)
    assert status == 200, generated
    for replica in fleet.replicas:
        assert _chat(replica, messages, 24)[0] == routed
        assert _chat(replica, messages, 24, stream=True)[0] == routed
        direct = _post(replica + "/generate", body)[1]
        assert direct["output_ids"] == generated["output_ids"] and direct["text"] == generated["text"]


def test_worker_endpoints_answer_what_the_router_asks(fleet):
    replica = fleet.replicas[0]
    info = _get(replica + "/server_info")
    assert info["served_model_name"] == MODEL and info["dp_size"] == 1 and "api_key" not in info
    assert _get(replica + "/get_model_info")["is_generation"] is True
    load = _get(replica + "/get_load")
    assert load[0]["dp_rank"] == 0 and load[0]["num_reqs"] == 0  # nothing is in flight here
    assert _get(replica + "/health_generate")["status"] == "ok"
    status, flushed = _post(fleet.url + "/flush_cache", {})
    assert status == 200 and flushed["workers_flushed"] == 2, flushed
    status, err = _post(fleet.url + "/v1/embeddings", {"model": MODEL, "input": "hello"})
    assert status == 404 and err["error"]["code"] == "unsupported_endpoint", err
    status, err = _post(fleet.url + "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "return_hidden_states": True})
    assert status == 400 and err["error"]["param"] == "return_hidden_states", err


def _second_turn_hit_rate(url: str, conversations: int) -> float:
    """Cached share of the second turns' prompts, conversations one after the other."""
    prompt = cached = 0
    for i in range(conversations):
        messages = [{"role": "user", "content": f"{LONG_QUESTION}Conversation {i}: which villages should I see?"}]
        answer, _ = _chat(url, messages, 8)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
        _, usage = _chat(url, messages, 4)
        prompt += usage.prompt_tokens
        cached += usage.prompt_tokens_details.cached_tokens
    return cached / prompt


def test_cache_aware_routing_keeps_a_conversation_on_its_replica(fleet):
    _post(fleet.url + "/flush_cache", {})
    cache_aware = _second_turn_hit_rate(fleet.url, 4)
    _post(fleet.url + "/flush_cache", {})
    round_robin = _second_turn_hit_rate(fleet.rr_url, 4)  # a conversation's turns alternate replicas
    assert cache_aware > 0.6, (cache_aware, round_robin)  # the first turn's whole prompt is cached
    assert cache_aware > round_robin + 0.3, (cache_aware, round_robin)


def _served(replica: str) -> float:
    with urllib.request.urlopen(replica + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("specserve_request_finished_total"))


def _stream_outcome(port: int, i: int, streaming: threading.Event) -> str:
    """'done' (the stream ended with a finish reason and [DONE]), 'cut' (it ended without them: what
    the router sends when the replica dies mid-stream) or the exception's name. `streaming` is set at
    the first token (before it, the router would retry a failed request on the other replica)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me a long story, number {i}."}],
            "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    lines = []
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            return f"HTTP {response.status}"
        while line := response.readline():
            if line.startswith(b"data:"):
                lines.append(line.decode().strip())
                streaming.set()
    except Exception as exc:
        return type(exc).__name__
    finished = any('"finish_reason":"length"' in line for line in lines)
    return "done" if finished and lines[-1] == "data: [DONE]" else "cut"


def test_a_killed_replica_fails_its_requests_leaves_rotation_and_comes_back(fleet):
    outcomes: dict[int, str] = {}
    port = int(fleet.url.rsplit(":", 1)[1])
    streaming = [threading.Event() for _ in range(4)]
    threads = [threading.Thread(target=lambda i=i: outcomes.__setitem__(i, _stream_outcome(port, i, streaming[i])),
                                daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for event in streaming:
        assert event.wait(120), f"a stream never started: {outcomes}"
    busy = [r for r in fleet.replicas if _get(r + "/get_load")[0]["num_reqs"] > 0]
    assert busy, "no replica has the requests"
    victim = busy[0]
    pid = _get(victim + "/server_info")["pid"]
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), f"a request hung after its replica died: {outcomes}"
    assert any(o != "done" for o in outcomes.values()), f"no request failed although its replica died: {outcomes}"

    while healthy_workers(fleet.url).get(victim, True) and time.monotonic() - killed_at < NOTICE_S:
        time.sleep(0.2)
    assert healthy_workers(fleet.url)[victim] is False, "the router never took the dead replica out"
    for i in range(4):  # every request now goes to the live replica
        assert _chat(fleet.url, [{"role": "user", "content": f"Say hello {i}."}], 4)[0]

    wait_for_workers(fleet.url, 2, RESTART_S, alive=lambda: fleet.proc.poll() is None)
    assert _get(victim + "/server_info")["pid"] != pid  # a new process, on the same port
    wait_for_workers(fleet.rr_url, 2, NOTICE_S)
    before = _served(victim)
    for i in range(4):  # round robin: half of these go to the restarted replica
        assert _chat(fleet.rr_url, [{"role": "user", "content": f"Count to {i + 2}."}], 4)[0]
    assert _served(victim) >= before + 1, "the restarted replica served nothing through the router"
