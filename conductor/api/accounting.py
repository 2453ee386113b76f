"""The books of one generation request: the only writer of the per-request metrics.

A ``RequestAccount`` opens when a generation request is admitted for checking and is
closed exactly once, with one outcome (``conductor.metrics.OUTCOMES``): a refusal before
any engine work, a failure to start, or the end of the generation (success, upstream
error, client gone). It holds the conductor's in-flight slot while it has one, so the
in-flight count and gauge cannot leak.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from conductor.errors import ConductorError, RateLimited, ServiceUnavailable
from conductor.generation import TokenStream, UsageCounts
from conductor.metrics import rejection_reason
from conductor.state import AppState


@dataclass(slots=True)
class RequestAccount:
    state: AppState
    endpoint: str  # conductor.metrics.ENDPOINTS
    started: float = field(default_factory=time.perf_counter)
    in_flight: bool = False
    closed: bool = False
    tenant: str = ""  # set once the tenant is known

    def refuse(self, reason: str) -> None:
        """Refused before any engine work (429/503): counted with its reason."""
        self.state.metrics.rejections.labels(reason).inc()
        self.close("rejected")

    def enter(self) -> None:
        """Take one of the conductor's in-flight slots (given back on close)."""
        self.state.inflight += 1
        self.state.metrics.inflight.inc()
        self.in_flight = True

    def first_token(self) -> None:
        """The first token exists: observe the time to it."""
        self.state.metrics.ttft.labels(self.endpoint).observe(time.perf_counter() - self.started)

    def failed_to_start(self, exc: BaseException) -> None:
        """Admission, placement, prefill or the first token failed: the outcome follows
        the error (a no-op when a refusal already closed the account)."""
        if self.closed:
            return
        outcome = "cancelled"
        if isinstance(exc, RateLimited):
            outcome = "rejected"
            self.state.metrics.rejections.labels(rejection_reason(exc.reason)).inc()
        elif isinstance(exc, ServiceUnavailable):
            outcome = "rejected"
            self.state.metrics.rejections.labels("unavailable").inc()
        elif isinstance(exc, ConductorError):
            outcome = "client_error" if exc.status_code < 500 else "upstream_error"
        elif isinstance(exc, Exception):
            outcome = "upstream_error"
        self.close(outcome)

    def close(
        self,
        outcome: str,
        stream: TokenStream | None = None,
        usage: UsageCounts | None = None,
    ) -> None:
        """Count the request once; with its ``stream``, the duration, TBT and tokens too."""
        if self.closed:
            return
        self.closed = True
        m = self.state.metrics
        m.requests.labels(self.endpoint, outcome).inc()
        if self.in_flight:
            self.in_flight = False
            self.state.inflight -= 1
            m.inflight.dec()
        if stream is None:
            return
        m.request_duration.labels(self.endpoint).observe(time.perf_counter() - self.started)
        if (tbt_s := stream.mean_gap_s) is not None:
            m.tbt.labels(self.endpoint).observe(tbt_s)
        if usage is not None:
            cached = min(usage.cached_tokens, usage.prompt_tokens)
            migrated = min(stream.placed.migrated_tokens, cached)
            m.prompt_tokens.inc(usage.prompt_tokens)
            m.prompt_cache_tokens.labels("local").inc(cached - migrated)
            m.prompt_cache_tokens.labels("migrated").inc(migrated)
            m.prompt_cache_tokens.labels("computed").inc(usage.prompt_tokens - cached)
            m.completion_tokens.inc(usage.completion_tokens)
            self._prompt_cache(usage, cached, stream)
            if migrated:
                m.migrations.inc()

    def _prompt_cache(self, usage: UsageCounts, cached: int, stream: TokenStream) -> None:
        """Prompt-cache books: the tenant's ledger, and bounded-label totals."""
        m = self.state.metrics
        if usage.retention != "none":
            m.prompt_cache_retentions.labels(usage.retention).inc()
            m.prompt_cache_write_tokens.inc(usage.cache_write_tokens)
        self.state.cache_ledger.record(
            self.tenant,
            read_tokens=cached,
            breakpoints=stream.placed.breakpoints,
            retention=usage.retention,
            written_tokens=usage.cache_write_tokens,
        )
