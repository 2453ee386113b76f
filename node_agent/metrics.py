"""Every Prometheus metric the node agent exports, in one place, and its ``/metrics`` server.

Conventions (as in ``conductor/metrics.py``): ``node_agent_`` prefix, base units
(``_seconds``, ``_bytes``), ``_total`` only on counters, ratios 0–1, no colons, and
bounded labels only. Every label value comes from a fixed tuple below (``TX_OPS``,
``TX_OUTCOMES``, ``BLOCK_STATES``, …) or, for ``node_agent_info``, from the agent's
configuration (role, engine, served model name): nothing from a request, a tenant or
a transaction id ever becomes a label. Each agent has its own registry, so several
agents can live in one process (the integration tests do).

Pool and engine gauges are sampled by ``refresh`` (the housekeeping loop and every
scrape call it); events are counted where they happen (``node_agent/server.py`` and
the parts it delegates to).

The registry also holds ``prometheus_client``'s process, platform and GC collectors
(``process_resident_memory_bytes``, ``python_info``, ``python_gc_…``): the agent's own
resource use next to its work. ``MetricsServer`` exposes the registry with
``prometheus_client``'s ASGI app under uvicorn, on the agent's own event loop (no
thread, no second loop); it answers ``GET``/``HEAD /metrics`` and nothing else, at most
``MAX_CONNECTIONS`` scrapes at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Iterator, MutableMapping, Sequence
from typing import Any

import uvicorn
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    make_asgi_app,
)
from prometheus_client.exposition import choose_encoder

from node_agent.blocks.pool import BlockPool
from node_agent.blocks.tiers import TierStats
from node_agent.blocks.types import (
    CapacityExhausted,
    InvalidArgument,
    TxClosed,
    TxExpired,
    TxNotFound,
)
from node_agent.engines.base import EngineLoad

log = logging.getLogger("node_agent.metrics")

Scope = MutableMapping[str, Any]
ASGIReceive = Callable[[], Awaitable[MutableMapping[str, Any]]]
ASGISend = Callable[[MutableMapping[str, Any]], Awaitable[None]]

TX_OPS = ("allocate", "lock_only", "commit", "abort", "extend")
# "draining": refused because the agent is draining (shutdown or the Drain RPC).
TX_OUTCOMES = ("ok", "capacity", "invalid", "not_found", "expired", "closed", "draining", "error")
BLOCK_STATES = ("free", "cached", "allocated")
TRANSFER_DIRECTIONS = ("sent", "received")
TRANSFER_KINDS = ("handoff", "migration")  # prefill → decode; prefix pulled between nodes
TOKEN_SOURCES = ("computed", "cached")
EVENT_KINDS = ("stored", "removed", "moved", "retained", "cleared", "load")
RETENTION_OUTCOMES = ("granted", "over_budget", "node_full", "unsupported", "too_long")
TIER_MEDIA = ("host", "disk")  # the lower KV tiers (L2, L3); the pool itself is "device"

MAX_CONNECTIONS = 16  # concurrent scrapes of /metrics; more get a 503
_START_TIMEOUT_S = 10.0

_PREFILL_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TRANSFER_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


def tx_outcome(exc: BaseException | None) -> str:
    """The ``outcome`` label of a Tx call that raised ``exc`` (None: it succeeded)."""
    if exc is None:
        return "ok"
    if isinstance(exc, CapacityExhausted):
        return "capacity"
    if isinstance(exc, InvalidArgument):
        return "invalid"
    if isinstance(exc, TxNotFound):
        return "not_found"
    if isinstance(exc, TxExpired):  # before TxClosed: it is one
        return "expired"
    if isinstance(exc, TxClosed):
        return "closed"
    return "error"


class AgentMetrics:
    """The agent's metrics on a registry of its own; ``exposition()`` renders them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.info = Info(
            "node_agent",
            "This agent's configured role, engine and served model name (value 1).",
            registry=r,
        )
        self.tx = Counter(
            "node_agent_tx_total",
            "Block-table transaction calls by operation and outcome.",
            ("op", "outcome"),
            registry=r,
        )
        self.lease_expiries = Counter(
            "node_agent_lease_expiries_total",
            "Transactions aborted because their lease ran out (a conductor died or lost "
            "its commit/abort).",
            registry=r,
        )
        self.blocks = Gauge(
            "node_agent_kv_blocks",
            "KV blocks of the pool by state (free + cached + allocated = capacity).",
            ("state",),
            registry=r,
        )
        self.capacity_blocks = Gauge(
            "node_agent_kv_capacity_blocks", "KV blocks in the pool.", registry=r
        )
        self.locked_blocks = Gauge(
            "node_agent_kv_locked_blocks",
            "KV blocks locked by open transactions (never evicted while locked).",
            registry=r,
        )
        self.retained_blocks = Gauge(
            "node_agent_kv_retained_blocks",
            "KV blocks kept out of eviction by a prompt-cache retention (cache_control "
            "breakpoints) until their TTL.",
            registry=r,
        )
        self.retentions = Counter(
            "node_agent_retentions",
            "Retentions asked in transactions, by outcome (granted, over_budget, "
            "node_full, unsupported, too_long); a refused one never refuses its transaction.",
            ("outcome",),
            registry=r,
        )
        self.kv_usage = Gauge(
            "node_agent_kv_usage_ratio",
            "Share of the pool's blocks not free (0-1).",
            registry=r,
        )
        self.open_txs = Gauge(
            "node_agent_open_transactions", "Transactions holding a lease.", registry=r
        )
        self.transfer_bytes = Counter(
            "node_agent_kv_transfer_bytes_total",
            "KV bytes moved between agents, by direction and kind (handoff: prefill to "
            "decode; migration: a prefix pulled from another node).",
            ("direction", "kind"),
            registry=r,
        )
        self.transfer_seconds = Histogram(
            "node_agent_kv_transfer_seconds",
            "Duration of complete KV transfers, by direction and kind.",
            ("direction", "kind"),
            buckets=_TRANSFER_BUCKETS_S,
            registry=r,
        )
        self.donations = Counter(
            "node_agent_kv_donations_total",
            "Donate before evict: blocks this agent offered peers (direction given: "
            "accepted, refused by every peer tried, failed, or dropped unsent) and peers' "
            "blocks it was offered (direction taken: accepted or refused).",
            ("direction", "outcome"),
            registry=r,
        )
        self.shared_memory_transfers = Counter(
            "node_agent_kv_shared_memory_transfers_total",
            "KV transfers this agent received through a shared-memory file (the sender on "
            "the same host) instead of a gRPC stream.",
            registry=r,
        )
        self.transfer_failures = Counter(
            "node_agent_kv_transfer_failures_total",
            "KV transfers this agent received that failed (peer unreachable, checksum, "
            "size or layout mismatch), by kind.",
            ("kind",),
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "node_agent_prefill_duration_seconds",
            "Engine time of one prefill (prompt KV computed into the Tx's blocks).",
            buckets=_PREFILL_BUCKETS_S,
            registry=r,
        )
        self.tier_blocks = Gauge(
            "node_agent_tier_blocks",
            "KV blocks held in a lower tier (host memory L2, disk L3) below the pool.",
            ("medium",),
            registry=r,
        )
        self.tier_used_bytes = Gauge(
            "node_agent_tier_used_bytes",
            "Bytes of KV held in a lower tier.",
            ("medium",),
            registry=r,
        )
        self.tier_capacity_bytes = Gauge(
            "node_agent_tier_capacity_bytes",
            "A lower tier's budget in bytes (0: tier off).",
            ("medium",),
            registry=r,
        )
        self.tier_read_bandwidth = Gauge(
            "node_agent_tier_read_bandwidth_bytes",
            "Measured promotion bandwidth, bytes per second, out of a lower tier onto the "
            "engine's device "
            "(moving mean; what a hit there costs).",
            ("medium",),
            registry=r,
        )
        self.tier_promoted_blocks = Counter(
            "node_agent_tier_promoted_blocks_total",
            "Blocks brought back from host memory or disk into the pool by a hit.",
            ("medium",),
            registry=r,
        )
        self.tier_io_queued = Gauge(
            "node_agent_tier_io_queued_jobs",
            "KV tier copies and disk I/O waiting for the agent's I/O thread (demotions, "
            "file writes and removals; promotions go first). Growing: demotions outpace "
            "the disk.",
            registry=r,
        )
        self.tier_torn_files = Counter(
            "node_agent_tier_torn_files_total",
            "Disk-tier files found damaged (short, long, bad checksum) and treated as misses.",
            registry=r,
        )
        self.prefill_tokens = Counter(
            "node_agent_prefill_tokens_total",
            "Prompt tokens of prefills by source: computed here or reused from cached blocks.",
            ("source",),
            registry=r,
        )
        self.generated_tokens = Counter(
            "node_agent_generated_tokens_total", "Tokens this agent's engine decoded.", registry=r
        )
        self.running_requests = Gauge(
            "node_agent_running_requests", "Generations the engine is running.", registry=r
        )
        self.queued_requests = Gauge(
            "node_agent_queued_requests", "Generations waiting for the engine.", registry=r
        )
        self.queued_prefill_tokens = Gauge(
            "node_agent_queued_prefill_tokens",
            "Prompt tokens waiting to be prefilled.",
            registry=r,
        )
        self.staged_bytes = Gauge(
            "node_agent_staged_kv_bytes",
            "Prefilled KV staged for decode nodes to fetch.",
            registry=r,
        )
        self.events = Counter(
            "node_agent_events_published_total",
            "Events appended to this agent's event stream, by kind.",
            ("kind",),
            registry=r,
        )
        self.watch_subscribers = Gauge(
            "node_agent_watch_subscribers",
            "Open WatchEvents streams (normally one per conductor).",
            registry=r,
        )
        for op in TX_OPS:
            for outcome in TX_OUTCOMES:
                self.tx.labels(op, outcome)
        for direction in TRANSFER_DIRECTIONS:
            for kind in TRANSFER_KINDS:
                self.transfer_bytes.labels(direction, kind)
                self.transfer_seconds.labels(direction, kind)
        for kind in TRANSFER_KINDS:
            self.transfer_failures.labels(kind)
        for source in TOKEN_SOURCES:
            self.prefill_tokens.labels(source)
        for kind in EVENT_KINDS:
            self.events.labels(kind)
        for outcome in RETENTION_OUTCOMES:
            self.retentions.labels(outcome)
        for state in BLOCK_STATES:
            self.blocks.labels(state)
        for medium in TIER_MEDIA:
            self.tier_blocks.labels(medium)
            self.tier_used_bytes.labels(medium)
            self.tier_capacity_bytes.labels(medium)
            self.tier_read_bandwidth.labels(medium)
            self.tier_promoted_blocks.labels(medium)
        self._leases_expired_seen = 0
        self._promoted_seen: dict[str, int] = dict.fromkeys(TIER_MEDIA, 0)
        self._torn_seen = 0

    def set_info(self, *, role: str, engine: str, model: str) -> None:
        """Configured values only: role, engine adapter name, served model name."""
        self.info.info({"role": role, "engine": engine, "model": model})

    def record_tx(self, op: str, exc: BaseException | None = None) -> None:
        self.tx.labels(op, tx_outcome(exc)).inc()

    def record_transfer(self, direction: str, kind: str, nbytes: int, seconds: float) -> None:
        self.transfer_bytes.labels(direction, kind).inc(nbytes)
        self.transfer_seconds.labels(direction, kind).observe(seconds)

    def record_event(self, kind: str | None) -> None:
        if kind in EVENT_KINDS:
            self.events.labels(kind).inc()

    def refresh(
        self,
        pool: BlockPool,
        load: EngineLoad,
        staged_bytes: int,
        *,
        engine_tiers: Sequence[TierStats] = (),
    ) -> None:
        """Sample the pool and the engine into the gauges (cheap: counters the pool keeps)."""
        stats = pool.stats()
        self.blocks.labels("free").set(stats.free_blocks)
        self.blocks.labels("cached").set(stats.cached_blocks)
        self.blocks.labels("allocated").set(stats.allocated_blocks)
        self.capacity_blocks.set(stats.capacity_blocks)
        self.locked_blocks.set(stats.locked_blocks)
        self.retained_blocks.set(stats.retained_blocks)
        self.kv_usage.set(1.0 - stats.free_blocks / stats.capacity_blocks)
        self.open_txs.set(stats.open_txs)
        expired = pool.leases_expired
        if expired > self._leases_expired_seen:
            self.lease_expiries.inc(expired - self._leases_expired_seen)
            self._leases_expired_seen = expired
        self._refresh_tiers(pool, engine_tiers)
        self.running_requests.set(load.running_requests)
        self.queued_requests.set(load.waiting_requests)
        self.queued_prefill_tokens.set(load.queued_prefill_tokens)
        self.staged_bytes.set(staged_bytes)

    def _refresh_tiers(self, pool: BlockPool, engine_tiers: Sequence[TierStats]) -> None:
        """The agent's own tiers, or the engine's (vLLM's CPU offloading) where it has one."""
        lower = pool.lower
        for tier in (*(lower.stats() if lower is not None else ()), *engine_tiers):
            medium = tier.medium.name.lower()
            self.tier_blocks.labels(medium).set(tier.blocks)
            self.tier_used_bytes.labels(medium).set(tier.used_bytes)
            self.tier_capacity_bytes.labels(medium).set(tier.capacity_bytes)
            self.tier_read_bandwidth.labels(medium).set(tier.read_bytes_per_s)
        if lower is None:
            return
        self.tier_io_queued.set(lower.io_backlog)
        for tier_medium, count in pool.promoted_blocks.items():
            medium = tier_medium.name.lower()
            if count > self._promoted_seen[medium]:
                self.tier_promoted_blocks.labels(medium).inc(count - self._promoted_seen[medium])
                self._promoted_seen[medium] = count
        if lower.torn_files > self._torn_seen:
            self.tier_torn_files.inc(lower.torn_files - self._torn_seen)
            self._torn_seen = lower.torn_files

    def exposition(self, accept: str = "") -> tuple[bytes, str]:
        """(body, content type) in the format the scraper asked for (``Accept``)."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


class MetricsServer:
    """``GET``/``HEAD /metrics``, ``/health`` and ``/ready`` served by uvicorn on the
    running event loop.

    The body is ``prometheus_client``'s ASGI app over the agent's registry (the format
    the scraper's ``Accept`` asks for, uncompressed); ``before_scrape`` runs first on
    every scrape (the agent samples its gauges there). ``/health`` answers 200 while
    the event loop runs; ``/ready`` 200 while ``ready()`` holds (the agent takes new
    work), else 503: kubelet's HTTP probes, which need no client certificate when the
    gRPC port requires one (kubelet's gRPC probe speaks no TLS). Any other path is a
    404, any other method a 405. ``port`` is the bound port (``port=0`` picks a free
    one).
    """

    def __init__(
        self,
        metrics: AgentMetrics,
        *,
        host: str,
        port: int,
        before_scrape: Callable[[], None] | None = None,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        self._ready = ready
        self._exposition = make_asgi_app(metrics.registry, disable_compression=True)
        self._before_scrape = before_scrape
        self._host = host
        self._port = port
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    async def _app(self, scope: Scope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path not in ("/metrics", "/health", "/ready"):
            await _respond(send, 404, b"not found: try /metrics\n")
            return
        if scope["method"] not in ("GET", "HEAD"):
            await _respond(send, 405, b"")
            return
        if path == "/health":
            await _respond(send, 200, b"ok\n")
            return
        if path == "/ready":
            ready = self._ready is None or self._ready()
            await _respond(send, 200 if ready else 503, b"ready\n" if ready else b"draining\n")
            return
        if self._before_scrape is not None:
            try:
                self._before_scrape()
            except Exception:  # a failed sample must not cost the whole scrape
                log.exception("sampling metrics before a scrape failed")
        await self._exposition(scope, receive, _with_content_length(send))

    async def start(self) -> int:
        sock = socket.create_server((self._host, self._port), reuse_port=False)
        self.port = int(sock.getsockname()[1])
        config = uvicorn.Config(
            self._app,
            interface="asgi3",
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            timeout_keep_alive=5,
            limit_concurrency=MAX_CONNECTIONS,
        )
        self._server = _Uvicorn(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="metrics")
        async with asyncio.timeout(_START_TIMEOUT_S):
            while not self._server.started:
                if self._task.done():
                    await self._task  # raises why it could not start
                await asyncio.sleep(0.005)
        return self.port

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
        self._server = None
        self._task = None


class _Uvicorn(uvicorn.Server):
    """uvicorn without its signal handlers: SIGTERM belongs to the agent (it drains)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _with_content_length(send: ASGISend) -> ASGISend:
    """``send`` for an app that answers in one body message: the response start is held
    back until the body is known, then sent with its ``Content-Length``."""
    start: MutableMapping[str, Any] | None = None

    async def sized_send(message: MutableMapping[str, Any]) -> None:
        nonlocal start
        if message["type"] == "http.response.start":
            start = message
            return
        if start is not None and message["type"] == "http.response.body":
            length = str(len(message.get("body", b""))).encode()
            start["headers"] = [*start.get("headers", []), (b"content-length", length)]
            await send(start)
            start = None
        await send(message)

    return sized_send


async def _respond(send: ASGISend, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
