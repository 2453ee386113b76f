"""Every Prometheus metric the node agent exports, in one place, and its ``/metrics`` server.

Conventions (as in ``conductor/metrics.py``): ``node_agent_`` prefix, base units
(``_seconds``, ``_bytes``), ``_total`` only on counters, ratios 0–1, no colons, and
bounded labels only. Every label value comes from a fixed tuple below (``TX_OPS``,
``TX_OUTCOMES``, ``BLOCK_STATES``, …) or, for ``node_agent_info``, from the agent's
configuration (role, engine, served model name): nothing from a request, a tenant or
a transaction id ever becomes a label. Each agent has its own registry, so several
agents can live in one process (the integration tests do).

Pool and engine gauges are sampled by ``refresh`` (the housekeeping loop and every
scrape call it); events are counted where they happen in ``node_agent/server.py``.

The exposition server is a few lines of asyncio on the agent's own event loop
(``asyncio.start_server``): no thread, no second loop, no framework. It answers
``GET``/``HEAD /metrics`` and nothing else; every connection is bounded by a read
timeout and a header-size limit and closed after one response, and at most
``MAX_CONNECTIONS`` are served at once (more are closed unanswered).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import choose_encoder

from node_agent.blocks.pool import (
    BlockPool,
    CapacityExhausted,
    InvalidArgument,
    TxClosed,
    TxExpired,
    TxNotFound,
)
from node_agent.engines.base import EngineLoad

log = logging.getLogger("node_agent.metrics")

TX_OPS = ("allocate", "lock_only", "commit", "abort")
# "draining": refused because the agent is draining (shutdown or the Drain RPC).
TX_OUTCOMES = ("ok", "capacity", "invalid", "not_found", "expired", "closed", "draining", "error")
BLOCK_STATES = ("free", "cached", "allocated")
TRANSFER_DIRECTIONS = ("sent", "received")
TRANSFER_KINDS = ("handoff", "migration")  # prefill → decode; prefix pulled between nodes
TOKEN_SOURCES = ("computed", "cached")
EVENT_KINDS = ("stored", "removed", "cleared", "load")

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
        for state in BLOCK_STATES:
            self.blocks.labels(state)
        self._leases_expired_seen = 0

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

    def refresh(self, pool: BlockPool, load: EngineLoad, staged_bytes: int) -> None:
        """Sample the pool and the engine into the gauges (cheap: counters the pool keeps)."""
        stats = pool.stats()
        self.blocks.labels("free").set(stats.free_blocks)
        self.blocks.labels("cached").set(stats.cached_blocks)
        self.blocks.labels("allocated").set(stats.allocated_blocks)
        self.capacity_blocks.set(stats.capacity_blocks)
        self.locked_blocks.set(stats.locked_blocks)
        self.kv_usage.set(1.0 - stats.free_blocks / stats.capacity_blocks)
        self.open_txs.set(stats.open_txs)
        expired = pool.leases_expired
        if expired > self._leases_expired_seen:
            self.lease_expiries.inc(expired - self._leases_expired_seen)
            self._leases_expired_seen = expired
        self.running_requests.set(load.running_requests)
        self.queued_requests.set(load.waiting_requests)
        self.queued_prefill_tokens.set(load.queued_prefill_tokens)
        self.staged_bytes.set(staged_bytes)

    def exposition(self, accept: str = "") -> tuple[bytes, str]:
        """(body, content type) in the format the scraper asked for (``Accept``)."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


class MetricsHttpServer:
    """``GET /metrics`` over HTTP/1.x on the running event loop.

    ``before_scrape`` runs first on every scrape (the agent samples its gauges there).
    Requests are tiny and rare (one per scrape interval per Prometheus), so one
    response per connection and a hand-written parser are enough; anything that is
    not a well-formed ``GET``/``HEAD`` within the limits gets a 4xx and is closed.
    """

    MAX_HEADER_BYTES = 16 * 1024
    READ_TIMEOUT_S = 5.0
    MAX_CONNECTIONS = 16

    def __init__(
        self,
        metrics: AgentMetrics,
        *,
        host: str,
        port: int,
        before_scrape: Callable[[], None] | None = None,
    ) -> None:
        self._metrics = metrics
        self._host = host
        self._port = port
        self._before_scrape = before_scrape
        self._server: asyncio.Server | None = None
        self._connections = 0
        self.port = 0

    async def start(self) -> int:
        self._server = await asyncio.start_server(
            self._handle, self._host, self._port, limit=self.MAX_HEADER_BYTES
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._connections >= self.MAX_CONNECTIONS:
            writer.close()
            return
        self._connections += 1
        try:
            await self._serve_one(reader, writer)
        finally:
            self._connections -= 1

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(self.READ_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            status, body, content_type, send_body = self._respond(head)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            status, body, content_type, send_body = "400 Bad Request", b"", "text/plain", False
        except ConnectionError:
            writer.close()
            return
        headers = (
            f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        with contextlib.suppress(ConnectionError):
            writer.write(headers.encode("latin-1") + (body if send_body else b""))
            await writer.drain()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()

    def _respond(self, head: bytes) -> tuple[str, bytes, str, bool]:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return "400 Bad Request", b"", "text/plain", True
        method, target, _ = parts
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", b"", "text/plain", True
        if target.split("?", 1)[0] != "/metrics":
            return "404 Not Found", b"not found: try /metrics\n", "text/plain", method == "GET"
        accept = ""
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "accept":
                accept = value.strip()
        if self._before_scrape is not None:
            try:
                self._before_scrape()
            except Exception:  # a failed sample must not cost the whole scrape
                log.exception("sampling metrics before a scrape failed")
        body, content_type = self._metrics.exposition(accept)
        return "200 OK", body, content_type, method == "GET"
