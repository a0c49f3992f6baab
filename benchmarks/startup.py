"""`python -m benchmarks startup`: from starting a server to its first token and to its first
full-speed token, ours against native `llama-server` on the same file, cold and warm, in
interleaved rounds.

Each start runs `specserve serve --model-path F --speculative-algorithm NONE` (plus the flags after
`--`) or `llama-server -m F -t THREADS` (with its warm-up, and with `--no-warmup`) on a free
loopback port, and records from the moment the process is started: when `/health` first answers
200 (ready), and the arrival of each token of a 64-token streamed `/v1/completions` request made
right then: the first token, and the first full-speed token (the first whose gap to the one
before is within 10% of the median gap of tokens 32-64, either way: a server that maps its weights lazily
answers its first token early and pays the page-in on the next ones, one that warms up pays it
before `/health`); then the resident memory of the server and its children.

The page cache is set for each start: cold (dropped: `echo 3 > /proc/sys/vm/drop_caches`, as root)
or warm on its own (the files that server reads at start read through just before: llama-server's
GGUF; specserve's GGUF, then the packed weights a first start kept, so a file and its packed copy
that do not both fit leave the packed copy cached). Per file: specserve's first start (warm GGUF,
an empty `--weight-cache` in a temporary folder: it packs the file and keeps the packed weights),
then rounds of every server in every state, interleaved. Reports medians [min-max] and, within each
round, llama-server's seconds over ours (a speed-up: above 1 specserve is first).
"""

from __future__ import annotations

import argparse
import glob
import json
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
READ_CHUNK = 64 << 20
FULL_SPEED_GAP = 1.10  # a token within 10% of the steady gap counts as full speed
STEADY_TOKENS = (32, 64)  # the tokens whose gaps set the steady gap
SERVERS = ("specserve", "llama-server", "llama-server --no-warmup")
STATES = ("cold", "warm")


def add_startup_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", action="append", required=True, help="a GGUF file (repeat for several)")
    p.add_argument("--llama-server", required=True, help="a native llama-server binary (scripts/llama_cpp_build.sh)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per file")
    p.add_argument("--threads", type=int, default=2, help="threads for both servers")
    p.add_argument("--tokens", type=int, default=STEADY_TOKENS[1], help="tokens streamed per start")
    p.add_argument("--states", default=",".join(STATES), help="page-cache states to start in: cold, warm")
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


def _commands(server: str, path: str, port: int, ns: argparse.Namespace) -> list[str]:
    if server == "specserve":
        return [sys.executable, "-m", "specserve.cli", "serve", "--model-path", path, "--port", str(port),
                "--num-threads", str(ns.threads), "--context-length", str(ns.context), "--max-total-tokens", str(ns.context),
                "--weight-cache", ns.weight_cache, "--speculative-algorithm", "NONE",
                *(a for a in ns.serve_args if a != "--")]  # fmt: skip
    return [ns.llama_server, "-m", path, "--port", str(port), "-t", str(ns.threads), "-c", str(ns.context),
            "--host", "127.0.0.1", *server.split()[1:]]  # fmt: skip


def full_speed_at(arrivals: list[float]) -> Optional[float]:
    """The arrival of the first full-speed token: the first whose gap to the token before is within
    10% of the median gap over STEADY_TOKENS, either way (two tokens read together, a gap near 0,
    are not a sign of speed), or the last token's where none is; None with too few to tell."""
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]  # gaps[i]: token i + 1 after token i
    lo, hi = STEADY_TOKENS
    if len(gaps) < lo:
        return None
    steady = statistics.median(gaps[lo - 1 : hi - 1])
    within = (i for i, gap in enumerate(gaps) if abs(gap - steady) <= (FULL_SPEED_GAP - 1) * steady)
    return arrivals[next(within, len(gaps) - 1) + 1]


def _stream_arrivals(url: str, body: dict[str, Any]) -> list[float]:
    """Monotonic arrival time of each streamed chunk of tokens (a choice with a `text` field before
    the finish: a server may hold back a token that ends inside a UTF-8 character, sending two at once)."""
    import httpx

    arrivals = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=START_TIMEOUT_S) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"answered {reply.status_code}: {reply.read()[:300]!r}")
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if any("text" in c and (c.get("text") or not c.get("finish_reason")) for c in chunk.get("choices", [])):
                arrivals.append(time.monotonic())
    return arrivals


def time_start(server: str, path: str, ns: argparse.Namespace, settle=None) -> tuple[dict[str, float], list[float]]:
    """One start of one server: seconds to ready, to the first token and to the first full-speed
    token, resident MiB after the request; and each token's arrival, seconds after the start.
    `settle()` runs before the server is stopped (untimed)."""
    import httpx

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        started = time.monotonic()
        proc = subprocess.Popen(_commands(server, path, port, ns), stdout=log, stderr=subprocess.STDOUT)
        try:
            ready = _wait_healthy(proc, url, started, log)
            body: dict[str, Any] = {"prompt": "Hello", "max_tokens": ns.tokens, "temperature": 0, "ignore_eos": True}
            if server == "specserve":
                body["model"] = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            arrivals = _stream_arrivals(url, body)
            if len(arrivals) <= STEADY_TOKENS[0]:
                raise RuntimeError(f"{server} streamed {len(arrivals)} chunks for {ns.tokens} tokens")
            full = full_speed_at(arrivals)
            result = {"ready_s": ready, "first_token_s": arrivals[0] - started,
                      "full_speed_s": (full if full is not None else arrivals[-1]) - started,
                      "rss_mib": _rss_mib(proc.pid)}  # fmt: skip
            if settle is not None:
                settle()
            return result, [round(t - started, 4) for t in arrivals]
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


def drop_page_cache() -> None:
    subprocess.run(["sync"], check=True)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        raise RuntimeError(f"startup: cold starts need root to drop the page cache ({exc}); pass --states warm") from None


def read_through(paths: list[str]) -> None:
    """Each file read once, in order, so that its pages are in the page cache (the last most recent)."""
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(READ_CHUNK):
                pass


def prepare(state: str, server: str, path: str, ns: argparse.Namespace) -> None:
    """The page cache as this start should find it."""
    if state == "cold":
        drop_page_cache()
        return
    packed = sorted(glob.glob(os.path.join(ns.weight_cache, "*.pt"))) if server == "specserve" else []
    read_through([path, *packed])


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def bench_file(path: str, ns: argparse.Namespace) -> dict[str, Any]:
    """specserve's first (packing) start, then interleaved rounds of every server in every state."""
    states = [s for s in ns.states.split(",") if s]
    with tempfile.TemporaryDirectory() as folder:
        ns.weight_cache = folder
        read_through([path])
        first, _ = time_start("specserve", path, ns, settle=lambda: _wait_for_cache(folder))
        print(f"{os.path.basename(path)} specserve first start: {first}", file=sys.stderr, flush=True)
        runs, arrivals = _rounds(states, path, ns)
    return {"file_mib": os.path.getsize(path) / 2**20, "specserve_first_start": first, "states": summarize(runs),
            "arrivals_s": {"order": [f"{state} {server}" for state in states for server in SERVERS],
                           "starts": arrivals}}  # fmt: skip


def _rounds(states: list[str], path: str, ns: argparse.Namespace):
    """Each state's and server's figures per round, and every start's token arrivals in the order run."""
    runs: dict[str, dict[str, list[dict[str, float]]]] = {s: {k: [] for k in SERVERS} for s in states}
    arrivals: list[list[float]] = []
    for _ in range(ns.rounds):
        for state in states:
            for server in SERVERS:
                prepare(state, server, path, ns)
                result, times = time_start(server, path, ns)
                runs[state][server].append(result)
                arrivals.append(times)
                print(f"{os.path.basename(path)} {state} {server}: {result}", file=sys.stderr, flush=True)
    return runs, arrivals


def summarize(runs: dict[str, dict[str, list[dict[str, float]]]]) -> dict[str, Any]:
    """Per state: each server's figures as spreads, and per llama-server mode the speed-ups (its
    seconds over specserve's, formed within each round) to the first and the first full-speed token."""
    out: dict[str, Any] = {}
    for state, by_server in runs.items():
        ours = by_server["specserve"]
        out[state] = {server: {key: _spread([r[key] for r in rows]) for key in rows[0]} for server, rows in by_server.items()}
        out[state]["speedup"] = {
            server: {key: _spread([theirs[key] / mine[key] for mine, theirs in zip(ours, by_server[server])])
                     for key in ("first_token_s", "full_speed_s")}
            for server in SERVERS if server != "specserve"}  # fmt: skip
    return out


def run_startup(ns: argparse.Namespace) -> int:
    from specserve.bench.provenance import emit_report, provenance

    report: dict[str, Any] = {"rounds": ns.rounds, "threads": ns.threads, "context": ns.context, "tokens": ns.tokens,
                              "full_speed_gap": FULL_SPEED_GAP, "steady_tokens": list(STEADY_TOKENS),
                              "serve_args": [a for a in ns.serve_args if a != "--"], "files": {}}  # fmt: skip
    for path in ns.model_path:
        report["files"][os.path.basename(path)] = bench_file(path, ns)
    report |= provenance(None)
    emit_report(report, ns.out)
    return 0
