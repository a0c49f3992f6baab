"""`python -m benchmarks startup`: seconds from starting a server to its first answered token, ours
against native `llama-server` on the same file, in interleaved rounds.

Each start runs `specserve serve --model-path F` (plus the flags after `--`) or `llama-server -m F
-t THREADS`, on a free loopback port, and records from the moment the process is started: when
`/health` first answers 200 (ready), when a one-token `/v1/completions` request made right then
returns (first token), and the resident memory of the server and its children then. Per file: one
unrecorded llama-server start (the file into the page cache), then specserve's first start with an
empty weight cache (`--weight-cache` in a temporary folder: it packs the file and keeps the packed
weights), then interleaved rounds of a specserve restart (mapping them) and a llama-server start.
Reports the medians [min-max] and the ratio ours / native of the first-token times within each round.
"""

from __future__ import annotations

import argparse
import glob
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

POLL_S = 0.05
START_TIMEOUT_S = 600.0


def add_startup_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", action="append", required=True, help="a GGUF file (repeat for several)")
    p.add_argument("--llama-server", required=True, help="a native llama-server binary (scripts/llama_cpp_build.sh)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per file")
    p.add_argument("--threads", type=int, default=2, help="threads for both servers")
    p.add_argument("--context", type=int, default=4096,
                   help="tokens of KV both servers hold (specserve --context-length and --max-total-tokens, "
                        "llama-server -c): the same cache on each side")  # fmt: skip
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then extra `specserve serve` flags")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mib(pid: int) -> float:
    """Resident MiB of a server and every process under it (specserve's engine is a child)."""
    from specserve.bench.load import _descendants, _rss

    return sum(_rss(p) for p in [pid, *_descendants(pid)]) / 2**20


def _commands(kind: str, path: str, port: int, ns: argparse.Namespace) -> list[str]:
    if kind == "specserve":
        return [sys.executable, "-m", "specserve.cli", "serve", "--model-path", path, "--port", str(port),
                "--num-threads", str(ns.threads), "--context-length", str(ns.context), "--max-total-tokens", str(ns.context),
                "--weight-cache", ns.weight_cache, *(a for a in ns.serve_args if a != "--")]  # fmt: skip
    return [ns.llama_server, "-m", path, "--port", str(port), "-t", str(ns.threads), "-c", str(ns.context),
            "--host", "127.0.0.1"]  # fmt: skip


def time_start(kind: str, path: str, ns: argparse.Namespace, settle=None) -> dict[str, float]:
    """One start of one server: seconds to ready and to the first token, resident MiB then;
    `settle()` runs before the server is stopped (untimed)."""
    import httpx

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        started = time.monotonic()
        proc = subprocess.Popen(_commands(kind, path, port, ns), stdout=log, stderr=subprocess.STDOUT)
        try:
            ready = _wait_healthy(proc, url, started, log)
            body = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
            if kind == "specserve":
                body["model"] = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=START_TIMEOUT_S)
            first = time.monotonic() - started
            if reply.status_code != 200:
                raise RuntimeError(f"{kind} answered {reply.status_code}: {reply.text[:300]}")
            result = {"ready_s": ready, "first_token_s": first, "rss_mib": _rss_mib(proc.pid)}
            if settle is not None:
                settle()
            return result
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _wait_healthy(proc: subprocess.Popen, url: str, started: float, log) -> float:
    import httpx

    while time.monotonic() - started < START_TIMEOUT_S:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} while starting:\n{log.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(POLL_S)
    raise RuntimeError(f"{proc.args[0]} not healthy within {START_TIMEOUT_S:.0f} s")


def _wait_for_cache(folder: str) -> None:
    """The first start's packed weights written (the restarts must map them, not pack again)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not glob.glob(os.path.join(folder, "*.pt")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"specserve's first start kept no packed weights in {folder}")
        time.sleep(POLL_S)


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def bench_file(path: str, ns: argparse.Namespace) -> dict[str, Any]:
    """specserve's first (packing) start, then interleaved rounds of restarts against llama-server."""
    kinds = ("specserve", "llama-server")
    time_start("llama-server", path, ns)  # the file into the page cache
    with tempfile.TemporaryDirectory() as folder:
        ns.weight_cache = folder
        first = time_start("specserve", path, ns, settle=lambda: _wait_for_cache(folder))
        print(f"{os.path.basename(path)} specserve first start: {first}", file=sys.stderr, flush=True)
        runs = _rounds(kinds, path, ns)
    out: dict[str, Any] = {"file_mib": os.path.getsize(path) / 2**20, "specserve_first_start": first}
    for kind, rows in runs.items():
        out[kind] = {key: _spread([r[key] for r in rows]) for key in rows[0]}
    ratios = [a["first_token_s"] / b["first_token_s"] for a, b in zip(runs["specserve"], runs["llama-server"])]
    out["first_token_ratio"] = _spread(ratios)
    return out


def _rounds(kinds: tuple[str, ...], path: str, ns: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for _ in range(ns.rounds):
        for kind in kinds:
            runs[kind].append(time_start(kind, path, ns))
            print(f"{os.path.basename(path)} {kind}: {runs[kind][-1]}", file=sys.stderr, flush=True)
    return runs


def run_startup(ns: argparse.Namespace) -> int:
    from specserve.bench.provenance import emit_report, provenance

    report: dict[str, Any] = {"rounds": ns.rounds, "threads": ns.threads, "context": ns.context,
                              "serve_args": [a for a in ns.serve_args if a != "--"], "files": {}}  # fmt: skip
    for path in ns.model_path:
        report["files"][os.path.basename(path)] = bench_file(path, ns)
    report |= provenance(None)
    emit_report(report, ns.out)
    return 0


def first_token_line(name: str, row: dict[str, Any], machine: Optional[str] = None) -> str:
    """One line for a report: both first-token times and their ratio, with spreads."""
    ours, native, ratio = row["specserve"]["first_token_s"], row["llama-server"]["first_token_s"], row["first_token_ratio"]
    where = f" ({machine})" if machine else ""
    return (f"{name}{where}: first token {ours['median']:.1f} s [{ours['min']:.1f}-{ours['max']:.1f}] after start, "
            f"llama-server {native['median']:.1f} s [{native['min']:.1f}-{native['max']:.1f}]: "
            f"{ratio['median']:.2f}x [{ratio['min']:.2f}-{ratio['max']:.2f}]")  # fmt: skip
