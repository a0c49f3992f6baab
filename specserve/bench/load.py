"""`specserve bench load`: many streaming clients against a live server, with the rude ones mixed in.

It starts `specserve serve` (the flags after `--`) on a free loopback port and runs `--clients`
concurrent clients for `--minutes`. Each client loops over request kinds: valid streamed chat,
valid completions, valid `/generate`, a stream it drops mid-way (disconnect), a request it drops
before the first byte (abort), and hostile requests (out-of-range or wrongly typed fields).

Valid requests take `--max-tokens` (a list mixes output lengths: each request draws one).

Checks, each reported with the figures behind it, and a non-zero exit if one fails:
- no valid request gets a 5xx, a stream that ends in an error, a dropped connection or a timeout:
  each one sent ends answered whole or counted as one of those, so none is lost silently (the
  report gives the valid requests sent and answered);
- every hostile request gets a 4xx, and the server stays healthy;
- when the clients stop and the engine is idle, no KV slot is held by a request;
- the resident memory of the server and its engine (summed) grows less than `--max-rss-growth`
  between `--rss-baseline-s` and the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

from specserve.bench.provenance import emit_report, provenance
from specserve.errors import ConfigError

KINDS = ("chat_stream", "completion", "generate", "disconnect", "abort", "hostile")
IDLE_TIMEOUT_S = 120.0
STARTUP_TIMEOUT_S = 600.0


def add_load_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--max-tokens", type=_token_budgets, default=[48],
                   help="per valid request; a comma-separated list mixes lengths (each request draws one)")
    p.add_argument("--hostile-share", type=float, default=0.1)
    p.add_argument("--disconnect-share", type=float, default=0.1, help="streams dropped mid-way")
    p.add_argument("--abort-share", type=float, default=0.05, help="requests dropped before their first byte")
    p.add_argument("--rss-baseline-s", type=float, default=60.0, help="when the memory baseline is taken")
    p.add_argument("--max-rss-growth", type=float, default=0.10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the report as JSON here")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then flags for `specserve serve`")


def _token_budgets(text: str) -> list[int]:
    try:
        budgets = [int(part) for part in text.split(",")]
    except ValueError:
        budgets = []
    if not budgets or min(budgets) < 1:
        raise argparse.ArgumentTypeError(f"--max-tokens takes positive integers separated by commas, not {text!r}")
    return budgets


@dataclass
class Tally:
    """What the clients saw, by request kind."""

    sent: Counter = field(default_factory=Counter)
    ok: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)  # "kind:status"
    valid_failures: list[str] = field(default_factory=list)  # a 5xx, an error chunk, a dropped connection
    hostile_not_4xx: list[str] = field(default_factory=list)
    tokens: int = 0


# ------------------------------------------------------------------ requests


def hostile_bodies(model: str) -> list[tuple[str, dict]]:
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    gen = {"input_ids": [1, 2, 3]}
    return [("/v1/chat/completions", {**chat, "top_k": 2**63}),
            ("/v1/chat/completions", {**chat, "temperature": -1}),
            ("/v1/chat/completions", {**chat, "stop": ["x"] * 40}),
            ("/v1/chat/completions", {**chat, "n": 10**6}),
            ("/v1/chat/completions", {**chat, "model": "gpt-4"}),
            ("/v1/completions", {"model": model, "prompt": [10**9], "max_tokens": 2}),
            ("/generate", {**gen, "sampling_params": {"skip_special_tokens": None}}),
            ("/generate", {**gen, "sampling_params": {"stop_token_ids": list(range(5000))}}),
            ("/generate", {**gen, "sampling_params": {"seed": 2**70}}),
            ("/generate", {"text": "x", "input_ids": [1]})]


class Client:
    """One simulated client: picks a kind per request, checks the answer, records it."""

    def __init__(self, http, model: str, prompts: list[str], ns: argparse.Namespace, tally: Tally, rng: random.Random):
        self.http, self.model, self.prompts, self.ns, self.tally, self.rng = http, model, prompts, ns, tally, rng
        self.hostile_requests = hostile_bodies(model)
        valid = 1 - ns.hostile_share - ns.disconnect_share - ns.abort_share
        self.weights = [valid / 3, valid / 3, valid / 3, ns.disconnect_share, ns.abort_share, ns.hostile_share]

    async def run(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            kind = self.rng.choices(KINDS, self.weights)[0]
            self.tally.sent[kind] += 1
            try:
                await getattr(self, kind)()
            except Exception as exc:  # a dropped connection or a timeout on a request we meant to finish
                if kind not in ("disconnect", "abort"):
                    self._fail(kind, f"{type(exc).__name__}: {exc}")

    def _fail(self, kind: str, why: str) -> None:
        target = self.tally.hostile_not_4xx if kind == "hostile" else self.tally.valid_failures
        target.append(f"{kind}: {why}"[:300])

    def _budget(self) -> int:
        return self.rng.choice(self.ns.max_tokens)

    def _chat(self, stream: bool) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": self.rng.choice(self.prompts)}],
                "max_tokens": self._budget(), "temperature": self.rng.choice((0, 0.8)), "stream": stream,
                "stream_options": {"include_usage": True} if stream else None}

    async def chat_stream(self) -> None:
        await self._stream("chat_stream", "/v1/chat/completions", self._chat(True), drop_after=None)

    async def disconnect(self) -> None:
        await self._stream("disconnect", "/v1/chat/completions", self._chat(True), drop_after=self.rng.randint(1, 8))

    async def _stream(self, kind: str, path: str, body: dict, drop_after: Optional[int]) -> None:
        lines = 0
        async with self.http.stream("POST", path, json=body) as r:
            self.tally.statuses[f"{kind}:{r.status_code}"] += 1
            if r.status_code != 200:
                return self._fail(kind, f"status {r.status_code}: {(await r.aread())[:200]!r}")
            last = ""
            async for line in r.aiter_lines():
                if not line:
                    continue
                lines, last = lines + 1, line
                if drop_after is not None and lines >= drop_after:
                    self.tally.ok[kind] += 1
                    return  # leaving the block closes the connection mid-stream
                if line.startswith('data: {"error"'):
                    return self._fail(kind, line)
                if '"usage"' in line and '"completion_tokens"' in line:
                    self.tally.tokens += json.loads(line[6:])["usage"]["completion_tokens"]
            if last != "data: [DONE]":
                return self._fail(kind, f"stream ended without [DONE]: {last[:100]}")
        self.tally.ok[kind] += 1

    async def completion(self) -> None:
        body = {"model": self.model, "prompt": self.rng.choice(self.prompts), "max_tokens": self._budget(),
                "temperature": 0}
        await self._plain("completion", "/v1/completions", body)

    async def generate(self) -> None:
        body = {"text": self.rng.choice(self.prompts),
                "sampling_params": {"max_new_tokens": self._budget(), "temperature": 0.7,
                                    "seed": self.rng.getrandbits(32)}}
        await self._plain("generate", "/generate", body)

    async def _plain(self, kind: str, path: str, body: dict) -> None:
        r = await self.http.post(path, json=body)
        self.tally.statuses[f"{kind}:{r.status_code}"] += 1
        if r.status_code != 200:
            return self._fail(kind, f"status {r.status_code}: {r.text[:200]}")
        out = r.json()
        self.tally.tokens += out["usage"]["completion_tokens"] if "usage" in out else out["meta_info"]["completion_tokens"]
        self.tally.ok[kind] += 1

    async def abort(self) -> None:
        try:
            r = await asyncio.wait_for(self.http.post("/v1/chat/completions", json=self._chat(False)),
                                       timeout=self.rng.uniform(0.01, 0.2))
        except asyncio.TimeoutError:
            self.tally.ok["abort"] += 1
            return
        self.tally.statuses[f"abort:{r.status_code}"] += 1  # it finished before the client gave up
        if r.status_code != 200:
            self._fail("abort", f"status {r.status_code}: {r.text[:200]}")

    async def hostile(self) -> None:
        path, body = self.rng.choice(self.hostile_requests)
        r = await self.http.post(path, json=body)
        self.tally.statuses[f"hostile:{r.status_code}"] += 1
        if 400 <= r.status_code < 500:
            self.tally.ok["hostile"] += 1
        else:
            self._fail("hostile", f"{path} {list(body)} -> {r.status_code}")


# ------------------------------------------------------------------ the server under load


class LiveServer:
    """`specserve serve` on a free loopback port; its memory and metrics."""

    def __init__(self, serve_args: list[str], log_path: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        cmd = [sys.executable, "-m", "specserve.cli", "serve", "--port", str(self.port), *serve_args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    async def wait_ready(self, http) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start (log: {self.log.name})")
            try:
                if (await http.get("/health")).status_code == 200:
                    return (await http.get("/v1/models")).json()["data"][0]["id"]
            except Exception:
                pass
            await asyncio.sleep(0.5)
        raise RuntimeError("server not healthy in time")

    def rss_bytes(self) -> int:
        """Resident memory of the server and every process under it."""
        return sum(_rss(pid) for pid in [self.proc.pid, *_descendants(self.proc.pid)])

    async def metrics(self, http) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        text = (await http.get("/metrics")).text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        children = [c for c, p in parents.items() if p == pid]
        found += children
        frontier += children
    return found


# ------------------------------------------------------------------ the run


async def _wait_idle(server: LiveServer, http) -> dict[str, float]:
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        m = await server.metrics(http)
        busy = sum(m.get(f"specserve_num_requests_{k}", 0) for k in ("queued", "waiting", "running"))
        if busy == 0 or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.5)


SERIES_EVERY_S = 30.0  # the resident-memory series' spacing: a leak climbs, a warm-up levels off


async def _sample_rss(server: LiveServer, baseline_at: float, samples: dict[str, Any], stop: asyncio.Event) -> None:
    started, next_point = time.monotonic(), 0.0
    samples["series"] = []
    while not stop.is_set():
        now = time.monotonic()
        if "baseline" not in samples and now >= baseline_at:
            samples["baseline"] = server.rss_bytes()
        samples["peak"] = max(samples.get("peak", 0), server.rss_bytes())
        if now - started >= next_point:  # seconds, the server process's MiB, its children's (the engine)
            own = _rss(server.proc.pid)
            samples["series"].append([round(now - started), round(own / 2**20, 1),
                                      round((server.rss_bytes() - own) / 2**20, 1)])
            next_point += SERIES_EVERY_S
        try:
            await asyncio.wait_for(stop.wait(), timeout=1.0)
        except asyncio.TimeoutError:
            pass


async def run_load(ns: argparse.Namespace, server: LiveServer) -> dict[str, Any]:
    import httpx

    from specserve.datasets import mtbench_first_turns

    prompts = [q["prompt"] for q in mtbench_first_turns()]
    tally = Tally()
    limits = httpx.Limits(max_connections=ns.clients + 8, max_keepalive_connections=ns.clients + 8)
    async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as http:
        model = await server.wait_ready(http)
        started = time.monotonic()
        rss: dict[str, Any] = {}
        stop = asyncio.Event()
        sampler = asyncio.ensure_future(_sample_rss(server, started + ns.rss_baseline_s, rss, stop))
        deadline = started + ns.minutes * 60
        rng = random.Random(ns.seed)
        clients = [Client(http, model, prompts, ns, tally, random.Random(rng.getrandbits(32))) for _ in range(ns.clients)]
        await asyncio.gather(*(c.run(deadline) for c in clients))
        elapsed = time.monotonic() - started
        end_metrics = await _wait_idle(server, http)
        health = (await http.get("/health")).status_code
        rss["end"] = server.rss_bytes()
        stop.set()
        await sampler
    return _report(ns, tally, elapsed, end_metrics, health, rss)


def _report(ns, tally: Tally, elapsed: float, m: dict[str, float], health: int, rss: dict[str, Any]) -> dict[str, Any]:
    base = rss.get("baseline")  # None when the run ended before the baseline time: not measured
    growth = rss["end"] / base - 1 if base else None
    valid = ("chat_stream", "completion", "generate")  # each should end in a whole answer
    report = {"minutes": ns.minutes, "rss_baseline_s": ns.rss_baseline_s, "clients": ns.clients, "max_tokens": ns.max_tokens, "seconds": round(elapsed, 1),
              "sent": dict(tally.sent), "ok": dict(tally.ok),
              "valid_sent": sum(tally.sent[k] for k in valid), "valid_answered": sum(tally.ok[k] for k in valid),
              "statuses": dict(sorted(tally.statuses.items())), "completion_tokens": tally.tokens,
              "completion_tokens_per_s": round(tally.tokens / elapsed, 2),
              "valid_failures": len(tally.valid_failures), "valid_failure_examples": tally.valid_failures[:5],
              "hostile_not_4xx": len(tally.hostile_not_4xx), "hostile_examples": tally.hostile_not_4xx[:5],
              "kv_request_tokens_at_end": m.get("specserve_kv_request_tokens"),
              "requests_running_at_end": m.get("specserve_num_requests_running"),
              "health_at_end": health, "rss_baseline_mib": round(base / 2**20, 1) if base else None,
              "rss_end_mib": round(rss["end"] / 2**20, 1), "rss_peak_mib": round(rss.get("peak", 0) / 2**20, 1),
              "rss_growth": round(growth, 4) if growth is not None else None,
              "rss_series_mib": rss.get("series", [])}  # [seconds, server process, engine processes]
    report["checks"] = {"no_5xx_on_valid_requests": not tally.valid_failures,
                        "every_valid_request_answered": report["valid_sent"] == report["valid_answered"],
                        "hostile_requests_all_4xx": not tally.hostile_not_4xx,
                        "no_kv_held_at_end": report["kv_request_tokens_at_end"] == 0,
                        "healthy_at_end": health == 200,
                        f"rss_growth_under_{ns.max_rss_growth:g}": growth is not None and growth < ns.max_rss_growth}
    report["passed"] = all(report["checks"].values())
    return report


def run_load_bench(ns: argparse.Namespace) -> int:
    serve_args = [a for a in ns.serve_args if a != "--"]
    if ns.rss_baseline_s >= ns.minutes * 60:  # single-flag ranges: flag_bounds.FLAG_BOUNDS
        raise ConfigError("--rss-baseline-s must fall inside the run (below --minutes * 60)")
    if ns.hostile_share + ns.disconnect_share + ns.abort_share >= 1:
        raise ConfigError("--hostile-share + --disconnect-share + --abort-share must leave room for valid requests")
    log_path = ns.out + ".server.log" if ns.out else tempfile.NamedTemporaryFile(suffix=".server.log", delete=False).name
    server = LiveServer(serve_args, log_path)
    try:
        report = asyncio.run(run_load(ns, server))
    finally:
        code = server.stop()
    report["server_exit_code"] = code
    report = {**provenance(), "serve_args": serve_args, **report}
    emit_report(report, ns.out)
    return 0 if report["passed"] and code == 0 else 1
