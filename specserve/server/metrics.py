"""Prometheus metrics of the server (one registry per app: no module-global state).

Latencies are measured where a client sees them: in the HTTP process, when a request's tokens
arrive from the engine process. Queue, batch and KV gauges come from the engine's load reports;
speculative statistics from each finished request's meta_info.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)
COUNT_BUCKETS = tuple(float(k) for k in range(0, 9))


class ServerMetrics:
    """Every metric `/metrics` exposes, with the updates the server calls."""

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        self._add_request_metrics(r)
        self._add_load_gauges(r)
        self._add_speculative_metrics(r)
        self.info = Gauge("specserve_model_info", "Served model", ["model_name"], registry=r)
        self.info.labels(model_name=model_name).set(1)
        self._prompt_total = 0
        self._cached_total = 0

    def _add_request_metrics(self, r: CollectorRegistry) -> None:
        self.requests = Counter(
            "specserve_http_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self.finished = Counter("specserve_request_finished", "Generation requests by finish reason", ["reason"], registry=r)
        self.prompt_tokens = Counter("specserve_prompt_tokens", "Prompt tokens processed", registry=r)
        self.cached_tokens = Counter(
            "specserve_cached_prompt_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.generation_tokens = Counter("specserve_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "specserve_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "specserve_inter_token_latency_seconds",
            "Time between consecutive token deliveries of a request (one delivery may carry "
            "several tokens with speculative decoding)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram("specserve_e2e_request_latency_seconds", "Request latency", buckets=E2E_BUCKETS, registry=r)

    def _add_load_gauges(self, r: CollectorRegistry) -> None:
        self.queued = Gauge(
            "specserve_num_requests_queued", "Requests accepted by HTTP and not yet producing tokens", registry=r
        )
        self.waiting = Gauge("specserve_num_requests_waiting", "Requests in the scheduler's waiting queue", registry=r)
        self.running = Gauge("specserve_num_requests_running", "Requests in the running batch", registry=r)
        self.kv_total = Gauge("specserve_kv_total_tokens", "KV pool size in tokens", registry=r)
        self.kv_request = Gauge("specserve_kv_request_tokens", "KV slots owned by live requests", registry=r)
        self.kv_cached = Gauge("specserve_kv_cached_tokens", "KV slots held by the prefix cache (evictable)", registry=r)
        self.kv_usage = Gauge("specserve_kv_usage_ratio", "KV slots in use (requests + cache) / pool size", registry=r)
        self.cache_hit_rate = Gauge("specserve_prefix_cache_hit_rate", "Cached prompt tokens / prompt tokens", registry=r)

    def _add_speculative_metrics(self, r: CollectorRegistry) -> None:
        self.accept_length = Histogram(
            "specserve_spec_accept_length", "Per request: tokens per verify step", buckets=ACCEPT_BUCKETS, registry=r
        )
        self.correct_drafts = Histogram(
            "specserve_spec_correct_drafts", "Per verify step: drafts accepted", buckets=COUNT_BUCKETS, registry=r
        )
        self.cap_trim = Histogram(
            "specserve_spec_cap_trim",
            "Per verify step: matching drafts cut by the verify length",
            buckets=COUNT_BUCKETS,
            registry=r,
        )
        self.verify_steps = Counter("specserve_spec_verify_steps", "Verify steps (per request)", registry=r)
        self.correct_total = Counter("specserve_spec_accepted_drafts", "Drafts accepted", registry=r)
        self.draft_len = Histogram(
            "specserve_spec_draft_len",
            "Per request-step of a speculating engine: drafts the policy planned (0: one plain row)",
            buckets=COUNT_BUCKETS,
            registry=r,
        )
        self.drafter_steps = Counter(
            "specserve_spec_drafter_steps", "Request-steps with drafts, by drafter", ["drafter"], registry=r
        )
        self.predicted_accept = Histogram(
            "specserve_spec_predicted_accept_length",
            "Per request: the policy's expected tokens per verify step (compare specserve_spec_accept_length)",
            buckets=ACCEPT_BUCKETS,
            registry=r,
        )
        self.cost_residual = Gauge(
            "specserve_spec_cost_model_residual",
            "Step-cost model: mean |observed - predicted| / observed over recent steps",
            registry=r,
        )

    def observe_load(self, load: dict[str, int]) -> None:
        self.waiting.set(load["waiting"])
        self.running.set(load["running"])
        self.kv_total.set(load["kv_total_tokens"])
        self.kv_request.set(load["kv_request_tokens"])
        self.kv_cached.set(load["kv_cached_tokens"])
        used = load["kv_total_tokens"] - load["kv_free_tokens"]
        self.kv_usage.set(used / max(1, load["kv_total_tokens"]))
        if "spec_cost_residual" in load:
            self.cost_residual.set(load["spec_cost_residual"])

    def observe_done(self, output: dict[str, Any], e2e_s: float) -> None:
        meta = output["meta_info"]
        self.finished.labels(reason=str(meta["finish_reason"]["type"])).inc()
        self.prompt_tokens.inc(meta["prompt_tokens"])
        self.cached_tokens.inc(meta["cached_tokens"])
        self.generation_tokens.inc(meta["completion_tokens"])
        self._prompt_total += meta["prompt_tokens"]
        self._cached_total += meta["cached_tokens"]
        self.cache_hit_rate.set(self._cached_total / max(1, self._prompt_total))
        self.e2e.observe(e2e_s)
        if meta.get("spec_verify_ct"):
            self.accept_length.observe(meta["spec_accept_length"])
            self.verify_steps.inc(meta["spec_verify_ct"])
            self.correct_total.inc(meta["spec_num_correct_drafts"])
            _observe_counts(self.correct_drafts, meta["spec_correct_drafts_histogram"])
            _observe_counts(self.cap_trim, meta["spec_cap_trim_histogram"])
        if "spec_predicted_accept_length" in meta:
            self.predicted_accept.observe(meta["spec_predicted_accept_length"])
        _observe_counts(self.draft_len, meta.get("spec_draft_len_histogram", {}))
        for drafter, steps in meta.get("spec_drafter_steps", {}).items():
            self.drafter_steps.labels(drafter=drafter).inc(steps)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _observe_counts(hist: Histogram, counts: dict) -> None:
    """A {value: occurrences} histogram from the engine into a Prometheus histogram."""
    for value, times in counts.items():
        for _ in range(int(times)):
            hist.observe(float(value))
