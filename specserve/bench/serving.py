"""`specserve bench serving`: drive OpenAI-compatible endpoints and compare them side by side.

Each `--target NAME=URL` (specserve's own server, llama.cpp's server, any other) gets the same
prompts at each concurrency of the sweep (or at a Poisson `--request-rate`), streamed through
`/v1/chat/completions`. Per run: output tokens/s, requests/s, TTFT and TPOT p50/p90/p99, and the
accept length when the server reports it (specserve's `specserve` field). With several targets the
report gives each one's throughput and TPOT as a ratio to the first target's.

Output tokens are counted from the stream's usage chunk when the server sends one, else by
tokenizing the streamed text with the embedded model's tokenizer (same model on every target).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Union

from specserve.args import number_list
from specserve.errors import ConfigError

DEFAULT_CONCURRENCIES = "1,4,16,64"
Prompt = Union[str, list[dict[str, str]]]  # a user message, or a whole conversation


def add_serving_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", action="append", default=None,
                   help="NAME=URL of an OpenAI-compatible server (repeatable; the first is the baseline of "
                        "the ratios). Default: specserve=http://127.0.0.1:30000")
    p.add_argument("--model", default=None, help="model id to send (default: each server's first /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", default="mt-bench",
                   help="mt-bench | sharegpt | random | a .jsonl of prompts | a workload of `bench spec` (multiturn, "
                        "code-edit, extraction, repeated-task: whole conversations)")
    p.add_argument("--num-prompts", type=int, default=80, help="requests per run")
    p.add_argument("--distinct-prompts", action="store_true",
                   help="every run (round and concurrency) its own prompts, the warm-up others again: no request "
                        "repeats, which a prefix cache or a drafter over past outputs would otherwise see")
    p.add_argument("--random-input-words", type=int, default=64, help="prompt length for --dataset random")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--concurrency", default=DEFAULT_CONCURRENCIES, help="comma-separated sweep")
    p.add_argument("--request-rate", type=float, default=None,
                   help="Poisson arrivals at this many requests/s (the concurrency values then cap in-flight "
                        "requests)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per (target, concurrency), interleaved: each round runs every target once at each "
                        "concurrency, so a throughput ratio is formed within its round and reported with its spread")
    p.add_argument("--warmup", type=int, default=2, help="requests before each target's first run (not counted)")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write all results as JSON here")
    p.add_argument("--plot", default=None, help="write a PNG of the concurrency sweep here")


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    accept_length: Optional[float] = None
    error: str = ""

    @property
    def tpot(self) -> Optional[float]:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass
class RunResult:
    target: str
    concurrency: int
    request_rate: Optional[float]
    completed: int
    failed: int
    duration_s: float
    output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    accept_length: Optional[float]
    errors: list[str] = field(default_factory=list)
    repeat: int = 0  # the round of --repeats this run belongs to


def load_bench_prompts(dataset: str, n: int, seed: int, random_words: int) -> list[Prompt]:
    """User messages, or for a `bench spec` workload whole conversations (message lists)."""
    from specserve.bench.workloads import WORKLOADS, load_workloads
    from specserve.datasets import load_prompts, sharegpt_first_turns

    if dataset in WORKLOADS:
        return [item["messages"] for item in load_workloads(dataset, n)[dataset]]
    if dataset == "sharegpt":
        return sharegpt_first_turns(n, seed=seed)
    if dataset == "random":
        rng = random.Random(seed)
        words = ["river", "stone", "light", "market", "engine", "garden", "winter", "signal", "paper", "ocean"]
        return [" ".join(rng.choice(words) for _ in range(random_words)) for _ in range(n)]
    prompts = [p["prompt"] for p in load_prompts(dataset)]
    return [prompts[i % len(prompts)] for i in range(n)]


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    s = sorted(values)

    def pick(q: float) -> float:
        return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))] * 1e3

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": sum(s) / len(s) * 1e3}


class Target:
    """One endpoint: its URL, model id and a token counter for servers that send no usage."""

    def __init__(self, name: str, url: str, model: Optional[str], api_key: Optional[str], count_tokens):
        self.name, self.url, self.model = name, url.rstrip("/"), model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.count_tokens = count_tokens

    async def resolve_model(self, http) -> None:
        if self.model is None:
            r = await http.get(self.url + "/v1/models", headers=self.headers)
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]

    async def request(self, http, prompt: Prompt, max_tokens: int, temperature: float, timeout: float) -> RequestResult:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        ttft, text, usage_tokens, accept = None, [], None, None
        try:
            async with http.stream("POST", self.url + "/v1/chat/completions", json=body, headers=self.headers,
                                   timeout=timeout) as r:
                if r.status_code != 200:
                    return RequestResult(False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    for choice in chunk.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content")
                        if piece:
                            ttft = ttft if ttft is not None else time.perf_counter() - start
                            text.append(piece)
                    if chunk.get("usage"):
                        usage_tokens = chunk["usage"].get("completion_tokens")
                    spec = chunk.get("specserve")
                    if spec and spec.get("spec_accept_length"):
                        accept = spec["spec_accept_length"]
        except Exception as exc:  # a failed request is counted and reported, the run goes on
            return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
        latency = time.perf_counter() - start
        tokens = usage_tokens if usage_tokens is not None else self.count_tokens("".join(text))
        return RequestResult(True, ttft if ttft is not None else latency, latency, tokens, accept)


async def run_one(target: Target, prompts: list[Prompt], concurrency: int, rate: Optional[float], ns,
                  progress) -> RunResult:
    import httpx

    # No keep-alive: a connection per request, so no request races a server closing an idle or
    # used-up connection (llama-server's HTTP library closes one after a few requests).
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=ns.timeout) as http:
        await target.resolve_model(http)
        gate = asyncio.Semaphore(concurrency)
        rng = random.Random(ns.seed)

        async def one(prompt: Prompt) -> RequestResult:
            async with gate:
                res = await target.request(http, prompt, ns.max_tokens, ns.temperature, ns.timeout)
            progress.update(1)
            return res

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            if rate:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(target.name, concurrency, rate, results, duration)


def summarize(name: str, concurrency: int, rate: Optional[float], results: list[RequestResult],
              duration: float) -> RunResult:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    accepts = [r.accept_length for r in ok if r.accept_length]
    return RunResult(name, concurrency, rate, len(ok), len(results) - len(ok), round(duration, 3), tokens,
                     tokens / duration, len(ok) / duration, percentiles([r.ttft for r in ok]),
                     percentiles([r.tpot for r in ok if r.tpot is not None]),
                     sum(accepts) / len(accepts) if accepts else None,
                     sorted({r.error for r in results if not r.ok})[:5])


async def warm_up(target: Target, prompts: list[Prompt], ns) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=ns.timeout) as http:
        await target.resolve_model(http)
        for prompt in prompts[:ns.warmup]:
            await target.request(http, prompt, min(ns.max_tokens, 32), ns.temperature, ns.timeout)


def server_settings(url: str) -> dict[str, Any]:
    """What a specserve server says it runs (/server_info: algorithm, policy, drafter); {} from a
    server without that route (llama.cpp's)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/server_info", timeout=10) as resp:
            info = json.load(resp)
    except (OSError, ValueError):
        return {}
    keys = ("speculative_algorithm", "speculative_policy", "speculative_draft_model_path", "dtype", "tp_size")
    return {k: info.get(k) for k in keys if k in info}


def parse_targets(specs: Optional[list[str]]) -> list[tuple[str, str]]:
    out = []
    for spec in specs or ["specserve=http://127.0.0.1:30000"]:
        name, sep, url = spec.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ConfigError(f"--target must be NAME=http(s)://host:port, got {spec!r}")
        out.append((name, url))
    return out


def ratios(runs: list[RunResult]) -> list[dict[str, Any]]:
    """Per round and concurrency: each target's throughput and TPOT p50 over the first target's."""
    base = {(r.repeat, r.concurrency): r for r in runs if r.target == runs[0].target}
    rows = []
    for r in runs:
        b = base.get((r.repeat, r.concurrency))
        if b is None or r.target == b.target:
            continue
        rows.append({"concurrency": r.concurrency, "target": r.target, "baseline": b.target, "repeat": r.repeat,
                     "throughput_ratio": r.output_tokens_per_s / b.output_tokens_per_s if b.output_tokens_per_s else None,
                     "tpot_p50_ratio": (r.tpot_ms.get("p50", 0) / b.tpot_ms["p50"]) if b.tpot_ms.get("p50") else None})
    return rows


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summary(runs: list[RunResult]) -> list[dict[str, Any]]:
    """Per (target, concurrency) over the rounds: throughput, TPOT p50 and TTFT p50 as median, lowest
    and highest; and the throughput and TPOT ratios to the first target, each formed within its round."""
    within = ratios(runs)
    out = []
    for target in dict.fromkeys(r.target for r in runs):
        for c in sorted({r.concurrency for r in runs}):
            mine = [r for r in runs if r.target == target and r.concurrency == c]
            mine_ratios = [x for x in within if x["target"] == target and x["concurrency"] == c]
            row: dict[str, Any] = {
                "target": target, "concurrency": c, "runs": len(mine),
                "output_tokens_per_s": _spread([r.output_tokens_per_s for r in mine]),
                "tpot_p50_ms": _spread([r.tpot_ms.get("p50", float("nan")) for r in mine]),
                "ttft_p50_ms": _spread([r.ttft_ms.get("p50", float("nan")) for r in mine]),
            }
            if mine_ratios:
                row["throughput_ratio"] = _spread([x["throughput_ratio"] for x in mine_ratios])
                if all(x["tpot_p50_ratio"] for x in mine_ratios):
                    row["tpot_p50_ratio"] = _spread([x["tpot_p50_ratio"] for x in mine_ratios])
            out.append(row)
    return out


def run_serving_bench(ns: argparse.Namespace) -> int:
    from tqdm import tqdm

    from specserve.tokenizer.tokenizer import load_tokenizer
    from specserve.models.loader import resolve_model_path

    concurrencies = number_list("--concurrency", ns.concurrency)
    if not concurrencies or min(concurrencies) < 1:
        raise ConfigError("--concurrency must list integers >= 1")
    targets_spec = parse_targets(ns.target)
    tokenizer = load_tokenizer(resolve_model_path(None))
    if ns.repeats < 1:
        raise ConfigError("--repeats must be >= 1")
    slices = ns.repeats * len(concurrencies) if ns.distinct_prompts else 1
    extra = ns.warmup if ns.distinct_prompts else 0
    pool = load_bench_prompts(ns.dataset, ns.num_prompts * slices + extra, ns.seed, ns.random_input_words)
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    targets = [Target(name, url, ns.model, ns.api_key, count) for name, url in targets_spec]
    for target in targets:
        asyncio.run(warm_up(target, pool[len(pool) - extra :] if extra else pool, ns))
    runs: list[RunResult] = []
    for repeat in range(ns.repeats):  # rounds: every target at every concurrency, the targets interleaved
        for i, c in enumerate(concurrencies):
            at = (repeat * len(concurrencies) + i) % slices * ns.num_prompts
            prompts = pool[at : at + ns.num_prompts]  # the same for every target of this run
            for target in targets:
                with tqdm(total=len(prompts), desc=f"{target.name} c={c} #{repeat}", unit="req", leave=False) as bar:
                    run = asyncio.run(run_one(target, prompts, c, ns.request_rate, ns, bar))
                run.repeat = repeat
                runs.append(run)
                tqdm.write(_line(run))
    from specserve.bench.provenance import provenance

    servers = {name: server_settings(url) for name, url in targets_spec}
    drafters = [s["speculative_draft_model_path"] for s in servers.values() if s.get("speculative_draft_model_path")]
    report = {**provenance(drafters[0] if drafters else None), "servers": servers,
              "models": {t.name: os.path.basename(t.model or "") for t in targets},  # the id each server served
              "dataset": ns.dataset, "num_prompts": ns.num_prompts, "distinct_prompts": ns.distinct_prompts,
              "max_tokens": ns.max_tokens,
              "temperature": ns.temperature, "request_rate": ns.request_rate, "repeats": ns.repeats,
              "runs": [asdict(r) for r in runs], "ratios": ratios(runs), "summary": summary(runs)}
    for row in report["summary"]:
        if "throughput_ratio" in row:
            t = row["throughput_ratio"]
            print(f"c={row['concurrency']:>3} {row['target']} / {targets[0].name}: throughput x{t['median']:.2f} "
                  f"({t['min']:.2f}-{t['max']:.2f}) over {row['runs']} rounds")
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=1)
    if ns.plot:
        plot_sweep(report["summary"], ns.plot)
    return 0 if all(r.failed == 0 for r in runs) else 1


def _line(r: RunResult) -> str:
    acc = f", accept {r.accept_length:.2f}" if r.accept_length else ""
    return (f"{r.target:>12} c={r.concurrency:<3} {r.completed} ok {r.failed} failed in {r.duration_s:.1f} s: "
            f"{r.output_tokens_per_s:.1f} out tok/s, {r.requests_per_s:.2f} req/s, TTFT p50 {r.ttft_ms.get('p50', 0):.0f} "
            f"p99 {r.ttft_ms.get('p99', 0):.0f} ms, TPOT p50 {r.tpot_ms.get('p50', 0):.1f} p99 "
            f"{r.tpot_ms.get('p99', 0):.1f} ms{acc}")


def plot_sweep(rows: list[dict[str, Any]], path: str) -> None:
    """The sweep's medians (summary rows) per target, with the rounds' range as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.2))
    for name in dict.fromkeys(r["target"] for r in rows):
        rs = sorted((r for r in rows if r["target"] == name), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rs]
        for ax, key in ((ax1, "output_tokens_per_s"), (ax2, "tpot_p50_ms"), (ax3, "ttft_p50_ms")):
            mid = [r[key]["median"] for r in rs]
            err = [[m - r[key]["min"] for m, r in zip(mid, rs)], [r[key]["max"] - m for m, r in zip(mid, rs)]]
            ax.errorbar(xs, mid, yerr=err, fmt="o-", capsize=3, label=name)
    for ax, title in ((ax1, "output tokens/s"), (ax2, "TPOT p50 (ms)"), (ax3, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
