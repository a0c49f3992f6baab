"""`specserve serve --dp-size N`: N engine replicas behind SGLang's router, restarted when they die.

Each replica is a whole `specserve serve` (HTTP server and engine process) on a free loopback
port, with the same flags and its share of the CPU threads. Once every replica is healthy, SGLang's
router (`sglang-router`, a Rust load balancer; cache-aware by default) starts on --host/--port with
the replicas as its workers. The router's health checks take a dead or unhealthy replica out of
rotation and put it back once it answers again; this launcher restarts a replica that exits (its
engine died: the server exits non-zero) or stays unhealthy past --replica-unhealthy-timeout, on the
same port, so it rejoins the router by itself.

Across machines the same is two commands: `specserve serve --host 0.0.0.0 --port P` on each
machine, and `python -m sglang_router.launch_router --worker-urls http://A:P http://B:P` (README).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Optional

from specserve.args import ServerArgs
from specserve.errors import ConfigError

logger = logging.getLogger(__name__)

ROUTER_MODULE = "sglang_router.launch_router"
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
ROUTER_LOG_LEVELS = {"debug": "debug", "info": "info", "warning": "warn", "error": "error", "critical": "error"}
# `specserve serve` flags a replica takes over from the launcher as given (host and port are its own).
FORWARDED_SERVE_FLAGS = (
    "api_key",
    "served_model_name",
    "max_queued_requests",
    "max_request_bytes",
    "shutdown_timeout",
    "engine_heartbeat_timeout",
    "engine_step_timeout",
    "reasoning_parser",
    "tool_call_parser",
)
REPLICA_START_TIMEOUT_S = 900.0
ROUTER_START_TIMEOUT_S = 120.0
SUPERVISE_EVERY_S = 0.5
MAX_RESTART_BACKOFF_S = 30.0
PROBE_TIMEOUT_S = 5.0


def add_data_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dp-size",
        type=int,
        default=1,
        help="engine replicas behind SGLang's router (needs `pip install sglang-router`); 1: no router",
    )
    p.add_argument(
        "--router-policy",
        default="cache_aware",
        choices=ROUTER_POLICIES,
        help="the router's load-balancing policy (cache_aware: a conversation's turns go where its prefix is cached)",
    )
    p.add_argument(
        "--router-health-check-interval",
        type=int,
        default=5,
        help="seconds between the router's health checks of each replica",
    )
    p.add_argument(
        "--router-args", default="", help='more flags for the router, as one string (e.g. "--health-failure-threshold 2")'
    )
    p.add_argument(
        "--replica-unhealthy-timeout",
        type=float,
        default=60.0,
        help="a replica whose /health fails this long is killed and restarted",
    )


def check_data_parallel_args(ns: argparse.Namespace, args: ServerArgs) -> None:
    """ValueError naming the flag when the data-parallel flags cannot work together."""
    if ns.dp_size == 1:
        return
    if args.nnodes > 1 or args.node_rank > 0:
        raise ConfigError(
            "--dp-size: replicas run on this machine; across machines start one `specserve serve` "
            "per machine and the router yourself (see the README)"
        )
    if args.dist_init_addr is not None:
        raise ConfigError("--dist-init-addr: leave it unset with --dp-size (each replica's ranks find a free port)")
    try:
        import sglang_router
    except ImportError:
        raise ConfigError("--dp-size needs SGLang's router: pip install 'sglang-router>=0.3'") from None
    del sglang_router  # only checked: the router runs as a process of its own


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_argv(ns: argparse.Namespace, port: int, threads: int) -> list[str]:
    """The `specserve serve` command of one replica: every engine flag the launcher was given, the
    forwarded server flags, loopback on its own port, and its share of the threads."""
    argv = [sys.executable, "-m", "specserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    for f in dataclasses.fields(ServerArgs):
        value = getattr(ns, f.name)
        if f.name == "num_threads":
            value = value if value is not None else threads
        argv += _flag(f.name, value)
    for name in FORWARDED_SERVE_FLAGS:
        argv += _flag(name, getattr(ns, name))
    return argv


def _flag(name: str, value) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if value is None or value is False:
        return []
    return [flag] if value is True else [flag, str(value)]


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
    """Send `sig`, wait up to timeout_s, then SIGKILL: the exit code (a no-op for one that has exited)."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=PROBE_TIMEOUT_S) as r:
            return r.status == 200
    except OSError:
        return False


@dataclass
class Replica:
    """One `specserve serve` process the launcher keeps alive on a fixed port."""

    index: int
    argv: list[str]
    port: int
    proc: Optional[subprocess.Popen] = None
    restarts: int = 0
    next_start_at: float = 0.0
    unhealthy_since: Optional[float] = None
    ready: bool = False
    backoff_s: float = 1.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=dict(os.environ, SPECSERVE_REPLICA=str(self.index)))
        self.ready, self.unhealthy_since = False, None
        logger.warning("replica %d: starting on %s (pid %d)", self.index, self.url, self.proc.pid)

    def stop(self, sig: int, timeout_s: float) -> None:
        if self.proc is not None:
            stop_process(self.proc, sig, timeout_s)


@dataclass
class DataParallelLauncher:
    """Starts the replicas and the router, supervises them, and stops everything on SIGTERM/SIGINT."""

    replicas: list[Replica]
    router_argv: list[str]
    unhealthy_timeout_s: float
    shutdown_timeout_s: float
    router: Optional[subprocess.Popen] = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stop.set())
        try:
            for r in self.replicas:
                r.start()
            if not self._wait_all_ready():
                return 1
            self.router = subprocess.Popen(self.router_argv)
            logger.warning("router: %s", shlex.join(self.router_argv[1:]))
            return self._supervise()
        finally:
            self._shutdown()

    def _wait_all_ready(self) -> bool:
        """Every replica healthy (True), or one exited during its first start / the launcher was stopped."""
        deadline = time.monotonic() + REPLICA_START_TIMEOUT_S
        while not self._stop.is_set() and time.monotonic() < deadline:
            for r in self.replicas:
                assert r.proc is not None, "run() starts every replica first"
                if r.proc.poll() is not None:
                    logger.error("replica %d exited with %s during start; stopping", r.index, r.proc.returncode)
                    return False
                r.ready = r.ready or _healthy(r.url)
            if all(r.ready for r in self.replicas):
                return True
            self._stop.wait(SUPERVISE_EVERY_S)
        if not self._stop.is_set():
            logger.error("replicas not healthy after %.0f s; stopping", REPLICA_START_TIMEOUT_S)
        return False

    def _supervise(self) -> int:
        assert self.router is not None, "run() starts the router first"
        while not self._stop.wait(SUPERVISE_EVERY_S):
            if self.router.poll() is not None:
                logger.error("router exited with %s; stopping the replicas", self.router.returncode)
                return 1
            for r in self.replicas:
                self._check(r)
        return 0

    def _check(self, r: Replica) -> None:
        """Restart a replica that exited (after its backoff) or stayed unhealthy too long."""
        now = time.monotonic()
        assert r.proc is not None, "run() starts every replica first"
        if r.proc.poll() is not None:
            if r.next_start_at == 0.0:
                logger.error("replica %d exited with %s; restarting in %.0f s", r.index, r.proc.returncode, r.backoff_s)
                r.next_start_at = now + r.backoff_s
                r.backoff_s = min(2 * r.backoff_s, MAX_RESTART_BACKOFF_S)
            elif now >= r.next_start_at:
                r.restarts += 1
                r.next_start_at = 0.0
                r.start()
            return
        if _healthy(r.url):
            if not r.ready:
                logger.warning("replica %d healthy on %s", r.index, r.url)
                r.backoff_s = 1.0  # it served: a later death starts the backoff afresh
            r.ready, r.unhealthy_since = True, None
        elif r.ready:  # a replica still starting is not unhealthy; only one that served and stopped answering
            r.unhealthy_since = r.unhealthy_since or now
            if now - r.unhealthy_since > self.unhealthy_timeout_s:
                logger.error("replica %d unhealthy for %.0f s; killing it", r.index, now - r.unhealthy_since)
                r.proc.kill()

    def _shutdown(self) -> None:
        if self.router is not None:
            stop_process(self.router, signal.SIGTERM, 10)
        for r in self.replicas:
            r.stop(signal.SIGTERM, self.shutdown_timeout_s + 10)


def run_data_parallel(ns: argparse.Namespace, args: ServerArgs) -> int:
    """`specserve serve --dp-size N` (N > 1)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s launcher %(levelname)s: %(message)s")
    threads = max(1, (os.cpu_count() or 1) // ns.dp_size)
    replicas = [Replica(i, [], free_loopback_port()) for i in range(ns.dp_size)]
    for r in replicas:
        r.argv = replica_argv(ns, r.port, threads)
    router_argv = [
        sys.executable,
        "-m",
        ROUTER_MODULE,
        "--host",
        ns.host,
        "--port",
        str(ns.port),
        "--policy",
        ns.router_policy,
        "--health-check-interval-secs",
        str(ns.router_health_check_interval),
        # its Prometheus exporter binds a fixed port by default: two routers on a machine would clash
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_loopback_port()),
        "--log-level",
        ROUTER_LOG_LEVELS.get(args.log_level, "warn"),
        "--worker-urls",
        *[r.url for r in replicas],
    ]
    if ns.api_key:
        router_argv += ["--api-key", ns.api_key]
    router_argv += shlex.split(ns.router_args)
    launcher = DataParallelLauncher(replicas, router_argv, ns.replica_unhealthy_timeout, ns.shutdown_timeout)
    return launcher.run()


def healthy_workers(router_url: str) -> dict[str, bool]:
    """The router's workers by URL with their health (its `/workers`); empty if it does not answer."""
    try:
        with urllib.request.urlopen(router_url + "/workers", timeout=PROBE_TIMEOUT_S) as r:
            return {w["url"]: bool(w["is_healthy"]) for w in json.load(r)["workers"]}
    except OSError:
        return {}


def wait_for_workers(router_url: str, count: int, timeout_s: float, alive=lambda: True) -> dict[str, bool]:
    """Block until the router has `count` healthy workers (TimeoutError after timeout_s, RuntimeError
    as soon as `alive()` turns false, e.g. the launcher exited)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("the launcher exited while waiting for the router's workers")
        workers = healthy_workers(router_url)
        if sum(workers.values()) >= count:
            return workers
        time.sleep(0.5)
    raise TimeoutError(f"{router_url}: fewer than {count} healthy workers after {timeout_s:.0f} s")
