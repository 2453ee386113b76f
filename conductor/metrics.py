"""Every Prometheus metric the conductor exports, in one place.

Conventions: ``conductor_`` prefix, base units (seconds), ``_total`` only on
counters, no colons, and bounded labels only — ``endpoint`` is one of the fixed
route names, ``outcome`` one of ``OUTCOMES``, ``reason`` one of ``REJECTION_REASONS``
(anything else is counted as ``other``), ``method`` a NodeAgent RPC name and ``code``
a gRPC status name. The one label taken from configuration is ``agent`` on
``conductor_agent_up``: the agent addresses this conductor is configured with (or
discovers in its registry), so its cardinality is the fleet size; an agent that
leaves the fleet leaves the metric at the next scrape. Nothing from a request body
ever becomes a label. Each app instance has its own registry, so several apps can
live in one process.

Several processes (``--workers``): the supervisor sets ``PROMETHEUS_MULTIPROC_DIR``
before it starts them, prometheus_client keeps every value in a file per process there,
and ``/metrics`` — whichever worker answers it — reads them all: counters and
histograms summed over the workers (those of a worker that died included, so they never
go backwards), ``conductor_requests_in_flight`` summed over the live ones, the agent
and Redis gauges as last set by any live worker (the answering one samples the fleet
first). The ``process_*``/``python_*`` families are left out there (they would
describe one worker), and an agent that left the fleet stays at
``conductor_agent_up 0`` until the workers restart.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
    multiprocess,
)

from kvc.roles import NODE_ROLES


class _RememberedChildren:
    """``labels(*values)`` remembered per values for metrics whose label sets are fixed
    and few: prometheus_client checks, converts and locks on every ``labels`` call
    (~1 µs), and a request makes about eight. ``remove``/``clear`` forget them."""

    _kvc_children: dict[tuple[object, ...], Any]

    def labels(self, *labelvalues: object, **labelkwargs: object) -> Any:
        if labelkwargs or not labelvalues:
            return super().labels(*labelvalues, **labelkwargs)  # type: ignore[misc]
        children = self.__dict__.setdefault("_kvc_children", {})
        child = children.get(labelvalues)
        if child is None:
            child = children[labelvalues] = super().labels(*labelvalues)  # type: ignore[misc]
        return child

    def remove(self, *labelvalues: object) -> None:
        self.__dict__.pop("_kvc_children", None)
        super().remove(*labelvalues)  # type: ignore[misc]

    def clear(self) -> None:
        self.__dict__.pop("_kvc_children", None)
        super().clear()  # type: ignore[misc]


class _Counter(_RememberedChildren, Counter):
    """A Counter of fixed label sets (children remembered)."""


class _Histogram(_RememberedChildren, Histogram):
    """A Histogram of fixed label sets (children remembered)."""


# Set by the supervisor of several workers (conductor.main): values in files there.
MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

OUTCOMES = ("success", "client_error", "rejected", "upstream_error", "cancelled")
ENDPOINTS = ("chat_completions", "completions", "messages")

PROMPT_SOURCES = ("local", "migrated", "computed")
# What became of a request's prompt-cache breakpoints (conductor.api.prompt_cache).
RETENTION_OUTCOMES = (
    "granted",
    "over_budget",
    "node_full",
    "unsupported",
    "too_long",
    "below_minimum",
)
PREDICTED_QUANTITIES = ("ttft", "tbt")  # what a prediction-ratio sample compares
# predicted / actual: 1 is perfect; < 1 optimistic (admits too much), > 1 pessimistic.
_RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.67, 0.8, 0.9, 1.1, 1.25, 1.5, 2, 4, 10)
# Every cause the conductor refuses a request for before any engine work (429 or 503).
REJECTION_REASONS = (
    "conductor_overloaded",  # max_inflight_requests reached on this conductor
    "tenant_rate_limit",  # the tenant's requests or tokens per minute
    "ttft_slo",  # predicted time to first token over the SLO
    "tbt_slo",  # predicted time between tokens over the SLO
    "no_prefill_node",  # no prefill node fits (capacity)
    "no_decode_node",  # no decode node has room or a free generation slot
    "insufficient_capacity",  # every node refused the Tx for capacity
    "no_capacity",  # no node serving the model is ready (503)
    "unavailable",  # nodes unreachable (503)
    "rate_limit_exceeded",  # a RateLimited raised without a reason of its own
    "other",
)
# The NodeAgent RPCs (kvc.v1) and the gRPC status codes: fixed sets.
AGENT_METHODS = (
    "GetInfo",
    "TxAllocate",
    "TxCommit",
    "TxAbort",
    "Snapshot",
    "Prefill",
    "PullBlocks",
    "Generate",  # counted by how the stream starts: OK at its first token, or its error
    "other",
)
GRPC_CODES = (
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
)


def rejection_reason(reason: str) -> str:
    """The ``reason`` label for a refusal: one of ``REJECTION_REASONS``."""
    return reason if reason in REJECTION_REASONS else "other"


class AgentView(Protocol):
    """What the metrics read of an agent handle (``conductor.adapters.agents.AgentHandle``)."""

    @property
    def address(self) -> str: ...
    @property
    def reachable(self) -> bool: ...
    @property
    def usable(self) -> bool: ...
    @property
    def role(self) -> str: ...


_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ConductorMetrics:
    def __init__(self, *, redis: bool = True) -> None:
        """``redis``: export ``conductor_redis_up`` (only when Redis is configured: no
        series at all rather than a false 0)."""
        # One of several worker processes (see the module's docstring).
        self.multiprocess = bool(os.environ.get(MULTIPROCESS_DIR_ENV))
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        if not self.multiprocess:
            # The standard process (memory, CPU, fds) and Python runtime families.
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
            GCCollector(registry=r)
        self._agents_seen: set[str] = set()
        self.requests = _Counter(
            "conductor_requests_total",
            "Generation requests by endpoint and outcome.",
            ("endpoint", "outcome"),
            registry=r,
        )
        self.rejections = _Counter(
            "conductor_rejections_total",
            "Requests refused before any engine work, by reason.",
            ("reason",),
            registry=r,
        )
        self.request_duration = _Histogram(
            "conductor_request_duration_seconds",
            "End-to-end duration of generation requests.",
            ("endpoint",),
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.ttft = _Histogram(
            "conductor_time_to_first_token_seconds",
            "Time from request arrival to the first generated token.",
            ("endpoint",),
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.tbt = _Histogram(
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
            "Delay from a block/load event's origin (the engine's KV event for engines that "
            "report them, like vLLM; else the agent) to this conductor applying it.",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
            registry=r,
        )
        self.prompt_cache_tokens = _Counter(
            "conductor_prompt_cache_tokens_total",
            "Prompt tokens by where their KV came from: reused on the prefill node (local), "
            "pulled from another node (migrated), or computed.",
            ("source",),
            registry=r,
        )
        self.prompt_cache_retentions = Counter(
            "conductor_prompt_cache_retentions_total",
            "Requests that asked for prompt-cache retention (cache_control breakpoints, "
            "prompt_cache_retention), by what became of it; per tenant: /admin/prompt-cache.",
            ("outcome",),
            registry=r,
        )
        self.prompt_cache_write_tokens = Counter(
            "conductor_prompt_cache_write_tokens_total",
            "Prompt tokens written to the cache at granted breakpoints (cache writes).",
            registry=r,
        )
        self.migrations = Counter(
            "conductor_kv_migrations_total",
            "Prefix migrations (hot-spot replication) between nodes.",
            registry=r,
        )
        self.prediction_ratio = _Histogram(
            "conductor_prediction_ratio",
            "Predicted over actual time per served request: TTFT by the prefill node's role, "
            "mean TBT by the decode node's role (1 = exact, <1 optimistic, >1 pessimistic).",
            ("quantity", "role"),
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.would_have_hit_tokens = Counter(
            "conductor_would_have_hit_tokens_total",
            "Prompt tokens recomputed on the chosen prefill node although another node held "
            "them at decision time (the placement traded reuse for load or transfer).",
            registry=r,
        )
        self.redis_up: Gauge | None = None
        if redis:
            self.redis_up = Gauge(
                "conductor_redis_up",
                "1 when the last Redis operation (registry, rate limits, keys) succeeded.",
                registry=r,
                multiprocess_mode="livemostrecent",
            )
        self.prompt_tokens = Counter(
            "conductor_prompt_tokens_total", "Prompt tokens of served requests.", registry=r
        )
        self.completion_tokens = Counter(
            "conductor_completion_tokens_total", "Generated tokens.", registry=r
        )
        self.inflight = Gauge(
            "conductor_requests_in_flight",
            "Generation requests in flight.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.agents_usable = Gauge(
            "conductor_agents_usable",
            "Node agents that answered the latest poll, serve this model and key blocks in "
            "this conductor's layout, by role.",
            ("role",),
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.agent_up = Gauge(
            "conductor_agent_up",
            "1 when the agent answered this conductor's latest poll, else 0; one series per "
            "agent address in the fleet.",
            ("agent",),
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.agent_calls = _Counter(
            "conductor_agent_calls_total",
            "Calls to node agents by RPC and gRPC status: unary calls when they end, Generate "
            "streams by how they start (OK at the first token, or the error before it). "
            "RESOURCE_EXHAUSTED from TxAllocate, Prefill or Generate is a capacity refusal "
            "(Prefill and Generate carry the allocation of a fused Tx); UNAVAILABLE an "
            "unreachable agent.",
            ("method", "code"),
            registry=r,
        )
        for endpoint in ENDPOINTS:
            for outcome in OUTCOMES:
                self.requests.labels(endpoint, outcome)
        for source in PROMPT_SOURCES:
            self.prompt_cache_tokens.labels(source)
        for retention in RETENTION_OUTCOMES:
            self.prompt_cache_retentions.labels(retention)
        for reason in REJECTION_REASONS:
            self.rejections.labels(reason)
        for node_role in NODE_ROLES:
            self.agents_usable.labels(node_role)
        # TTFT is measured on prefill-capable nodes, TBT on decode-capable ones.
        for quantity, roles in (("ttft", ("prefill", "both")), ("tbt", ("decode", "both"))):
            for role in roles:
                self.prediction_ratio.labels(quantity, role)
        for method in ("TxAllocate", "TxCommit", "TxAbort", "Prefill", "Generate"):
            for code in ("OK", "RESOURCE_EXHAUSTED", "UNAVAILABLE"):
                self.agent_calls.labels(method, code)

    # The dispatcher's telemetry (``conductor.dispatch.DispatchTelemetry``).
    def observe_decision(self, seconds: float) -> None:
        self.decision.observe(seconds)

    def observe_prediction(
        self, quantity: str, role: str, predicted_s: float, actual_s: float
    ) -> None:
        """One served request's predicted vs actual TTFT or TBT (ignored when not > 0)."""
        if quantity in PREDICTED_QUANTITIES and role in NODE_ROLES and predicted_s > 0 < actual_s:
            self.prediction_ratio.labels(quantity, role).observe(predicted_s / actual_s)

    def count_would_have_hit(self, tokens: int) -> None:
        if tokens > 0:
            self.would_have_hit_tokens.inc(tokens)

    def record_agent_call(self, method: str, code: str) -> None:
        """Count one agent call (a unary one that ended, a ``Generate`` stream that started
        or failed first); ``method`` may be a full gRPC path."""
        name = method.rsplit("/", 1)[-1]
        self.agent_calls.labels(
            name if name in AGENT_METHODS else "other", code if code in GRPC_CODES else "UNKNOWN"
        ).inc()

    def refresh_agents(self, agents: Iterable[AgentView]) -> None:
        """Sample the fleet: usable agents by role, and up/down per agent address."""
        agents = list(agents)
        for node_role in NODE_ROLES:
            self.agents_usable.labels(node_role).set(
                sum(1 for a in agents if a.usable and a.role == node_role)
            )
        current = {a.address for a in agents}
        if self.multiprocess:  # a cleared series would live on in this worker's file
            for gone in self._agents_seen - current:
                self.agent_up.labels(gone).set(0)
        else:
            self.agent_up.clear()  # agents that left the fleet leave the metric
        self._agents_seen |= current
        for a in agents:
            self.agent_up.labels(a.address).set(1 if a.reachable else 0)

    def set_redis_up(self, up: bool) -> None:
        """The outcome of the latest Redis operation (ignored without Redis)."""
        if self.redis_up is not None:
            self.redis_up.set(int(up))

    def exposition(self) -> bytes:
        if self.multiprocess:  # every worker's values, whichever worker answers
            merged = CollectorRegistry(auto_describe=True)
            multiprocess.MultiProcessCollector(merged)  # type: ignore[no-untyped-call]  # untyped upstream
            return generate_latest(merged)
        return generate_latest(self.registry)
