"""Every Prometheus metric the conductor exports, in one place.

Conventions: ``conductor_`` prefix, base units (seconds), ``_total`` only on
counters, no colons, and bounded labels only — ``endpoint`` is one of the fixed
route names, ``outcome`` one of ``OUTCOMES``, ``reason`` one of the rejection
reasons the code defines. Nothing from a request body ever becomes a label.
Each app instance has its own registry, so several apps can live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

OUTCOMES = ("success", "client_error", "rejected", "upstream_error", "cancelled")
ENDPOINTS = ("chat_completions", "completions")

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ConductorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "conductor_requests_total",
            "Generation requests by endpoint and outcome.",
            ("endpoint", "outcome"),
            registry=r,
        )
        self.rejections = Counter(
            "conductor_rejections_total",
            "Requests refused before any engine work, by reason.",
            ("reason",),
            registry=r,
        )
        self.request_duration = Histogram(
            "conductor_request_duration_seconds",
            "End-to-end duration of generation requests.",
            ("endpoint",),
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.ttft = Histogram(
            "conductor_time_to_first_token_seconds",
            "Time from request arrival to the first generated token.",
            ("endpoint",),
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.tbt = Histogram(
            "conductor_time_between_tokens_seconds",
            "Mean gap between streamed tokens of a request.",
            ("endpoint",),
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1, 2.5),
            registry=r,
        )
        self.decision = Histogram(
            "conductor_scheduling_decision_seconds",
            "Time to place one request: block keys, prefix match, Algorithm 1.",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1),
            registry=r,
        )
        self.event_lag = Histogram(
            "conductor_shadow_event_lag_seconds",
            "Delay from an agent emitting a block/load event to this conductor applying it.",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
            registry=r,
        )
        self.prompt_cache_tokens = Counter(
            "conductor_prompt_cache_tokens_total",
            "Prompt tokens by where their KV came from: reused on the prefill node (local), "
            "pulled from another node (migrated), or computed.",
            ("source",),
            registry=r,
        )
        self.migrations = Counter(
            "conductor_kv_migrations_total",
            "Prefix migrations (hot-spot replication) between nodes.",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "conductor_prompt_tokens_total", "Prompt tokens of served requests.", registry=r
        )
        self.completion_tokens = Counter(
            "conductor_completion_tokens_total", "Generated tokens.", registry=r
        )
        self.inflight = Gauge(
            "conductor_requests_in_flight", "Generation requests in flight.", registry=r
        )
        self.agents_usable = Gauge(
            "conductor_agents_usable",
            "Node agents that answered the latest poll and serve this model, by role.",
            ("role",),
            registry=r,
        )
        for endpoint in ENDPOINTS:
            for outcome in OUTCOMES:
                self.requests.labels(endpoint, outcome)
        for source in ("local", "migrated", "computed"):
            self.prompt_cache_tokens.labels(source)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
