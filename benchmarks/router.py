"""`python -m benchmarks router`: specserve replicas behind SGLang's router, on MT-Bench conversations.

One launcher (`specserve serve --dp-size 2`, the default engine) and, over the same two replicas, a
second router with the round-robin policy. Each router runs the same multi-turn workload with the
replicas' prefix caches flushed before: every MT-Bench first turn, then its second turn with the first
exchange as prefix, `--concurrency` conversations at a time, all streamed. Reported per policy: the
second turns' prefix-cache hit rate (cached / prompt tokens, from each response's usage) and time to
first token, and how many requests each replica served.

Then throughput: the same first turns (fixed lengths) through the 2 replicas (the launcher's share of
the cores each) and through one server alone (all the cores). On a 2-core machine no gain is
expected (both configurations have the same cores); the figure shows the routing spreads the work.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from specserve.server.replicas import free_loopback_port, stop_process, wait_for_workers

STARTUP_S = 600


def add_router_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-conversations", type=int, default=40, help="MT-Bench questions (two turns each)")
    p.add_argument("--concurrency", type=int, default=4, help="conversations in flight at once")
    p.add_argument("--first-tokens", type=int, default=64, help="first-turn answer length (greedy)")
    p.add_argument("--second-tokens", type=int, default=16, help="second-turn answer length")
    p.add_argument("--serve-args", default="", help="more `specserve serve` flags for every server, one string")
    p.add_argument("--out", default=None)


@dataclass
class Turn:
    """One streamed chat request as the client saw it."""

    text: str
    ttft_s: float
    seconds: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def chat_stream(url: str, model: str, messages: list[dict], max_tokens: int, fixed_length: bool = False) -> Turn:
    """A greedy streamed chat request (stdlib HTTP: the bench needs no client library)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": fixed_length}
    start = time.perf_counter()
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"{url}: HTTP {response.status}: {response.read()[:300]!r}")
    text, first, usage = "", None, None
    while line := response.readline():
        if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        delta = "".join(c["delta"].get("content") or "" for c in chunk["choices"])
        if delta and first is None:
            first = time.perf_counter() - start
        text += delta
        usage = chunk.get("usage") or usage
    if usage is None:
        raise RuntimeError(f"{url}: the stream ended without its usage (cut short)")
    return Turn(text, first if first is not None else time.perf_counter() - start, time.perf_counter() - start,
                usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                usage["completion_tokens"])


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.load(r)


def _post(url: str) -> None:
    with urllib.request.urlopen(urllib.request.Request(url, b"{}", {"Content-Type": "application/json"}),
                                timeout=60) as r:
        r.read()


def served(replica: str) -> int:
    """Requests a replica finished (its Prometheus counter)."""
    with urllib.request.urlopen(replica + "/metrics", timeout=60) as r:
        lines = r.read().decode().splitlines()
    return int(sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("specserve_request_finished_total")))


class Servers:
    """The processes a bench run starts, stopped (SIGTERM, then SIGKILL) however the run ends."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            stop_process(proc)
        self.procs.clear()


def serve_argv(port: int, extra: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "specserve.cli", "serve", "--port", str(port), *flags, *extra.split()]


def conversations(router: str, model: str, questions: list[dict], ns: argparse.Namespace) -> list[Turn]:
    """Every question's two turns, `concurrency` conversations at a time: the second turns."""
    def converse(q: dict) -> Turn:
        messages = [{"role": "user", "content": q["turns"][0]}]
        first = chat_stream(router, model, messages, ns.first_tokens)
        messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": q["turns"][1]}]
        return chat_stream(router, model, messages, ns.second_tokens)

    with ThreadPoolExecutor(ns.concurrency) as pool:
        return list(pool.map(converse, questions))


def policy_run(router: str, launcher_router: str, replicas: list[str], model: str, questions: list[dict],
               ns: argparse.Namespace) -> dict[str, Any]:
    _post(launcher_router + "/flush_cache")  # every replica starts cold
    before = [served(r) for r in replicas]
    start = time.perf_counter()
    turns = conversations(router, model, questions, ns)
    wall = time.perf_counter() - start
    prompt, cached = sum(t.prompt_tokens for t in turns), sum(t.cached_tokens for t in turns)
    ttft = [1e3 * t.ttft_s for t in turns]
    return {"second_turn_hit_rate": cached / max(1, prompt), "second_turn_prompt_tokens": prompt,
            "second_turn_cached_tokens": cached, "second_turn_ttft_ms_mean": statistics.mean(ttft),
            "second_turn_ttft_ms_p50": statistics.median(ttft),
            "requests_per_replica": [served(r) - b for r, b in zip(replicas, before)], "wall_s": wall}


def throughput(url: str, model: str, questions: list[dict], ns: argparse.Namespace,
               replicas: tuple[str, ...] = ()) -> dict[str, Any]:
    """First turns of fixed length, `concurrency` at a time: output tokens per second (and how many
    requests each of `replicas` served)."""
    def one(q: dict) -> Turn:
        return chat_stream(url, model, [{"role": "user", "content": q["turns"][0]}], ns.first_tokens, True)

    before = [served(r) for r in replicas]
    start = time.perf_counter()
    with ThreadPoolExecutor(ns.concurrency) as pool:
        turns = list(pool.map(one, questions))
    wall = time.perf_counter() - start
    tokens = sum(t.completion_tokens for t in turns)
    out = {"requests": len(turns), "output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall}
    if replicas:
        out["requests_per_replica"] = [served(r) - b for r, b in zip(replicas, before)]
    return out


def run_router_bench(ns: argparse.Namespace) -> int:
    from specserve.bench.provenance import provenance
    from specserve.datasets import mtbench_questions

    questions = mtbench_questions()[:ns.num_conversations]
    servers = Servers()
    try:
        port = free_loopback_port()
        launcher = servers.start(serve_argv(port, ns.serve_args, "--dp-size", "2", "--log-level", "warning",
                                            "--router-health-check-interval", "1"))
        router = f"http://127.0.0.1:{port}"
        replicas = sorted(wait_for_workers(router, 2, STARTUP_S, alive=lambda: launcher.poll() is None))
        model = _get(replicas[0] + "/model_info")["served_model_name"]
        rr_port = free_loopback_port()
        rr = servers.start([sys.executable, "-m", "sglang_router.launch_router", "--port", str(rr_port),
                            "--policy", "round_robin", "--prometheus-port", str(free_loopback_port()),
                            "--log-level", "warn", "--worker-urls", *replicas])
        round_robin = f"http://127.0.0.1:{rr_port}"
        wait_for_workers(round_robin, 2, 120, alive=lambda: rr.poll() is None)
        for r in replicas:  # warm: the first request of a process pays one-off costs
            chat_stream(r, model, [{"role": "user", "content": "Hello"}], 4)
        report: dict[str, Any] = {**provenance(), "num_conversations": len(questions),
                                  "concurrency": ns.concurrency, "first_tokens": ns.first_tokens,
                                  "second_tokens": ns.second_tokens, "serve_args": ns.serve_args}
        report["cache_aware"] = policy_run(router, router, replicas, model, questions, ns)
        report["round_robin"] = policy_run(round_robin, router, replicas, model, questions, ns)
        _post(router + "/flush_cache")  # the policy runs cached these prompts; the lone server starts cold
        report["two_replicas"] = throughput(router, model, questions, ns, tuple(replicas))
        servers.stop_all()
        single_port = free_loopback_port()
        single = servers.start(serve_argv(single_port, ns.serve_args, "--log-level", "warning"))
        wait_healthy(f"http://127.0.0.1:{single_port}", single)
        chat_stream(f"http://127.0.0.1:{single_port}", model, [{"role": "user", "content": "Hello"}], 4)
        report["one_server"] = throughput(f"http://127.0.0.1:{single_port}", model, questions, ns)
    finally:
        servers.stop_all()
    ca, rr_run = report["cache_aware"], report["round_robin"]
    report["ratios"] = {
        "hit_rate_cache_aware_over_round_robin": ca["second_turn_hit_rate"] / max(1e-9, rr_run["second_turn_hit_rate"]),
        "ttft_round_robin_over_cache_aware": rr_run["second_turn_ttft_ms_mean"] / ca["second_turn_ttft_ms_mean"],
        "throughput_two_replicas_over_one_server": (report["two_replicas"]["output_tokens_per_s"]
                                                    / report["one_server"]["output_tokens_per_s"])}
    print(json.dumps(report, indent=1))
    if ns.out:
        os.makedirs(os.path.dirname(os.path.abspath(ns.out)), exist_ok=True)
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = STARTUP_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} during start")
        try:
            if _get(url + "/health")["status"] == "ok":
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s")
