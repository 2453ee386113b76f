"""What one live request left behind (``LiveResult``, wall clock) and its translation into
the simulator's ``RequestRecord`` (trace time), plus the live-only figures of a run.

Translation (``to_record``)
    * times: wall seconds since the replay's start divided by ``time_scale``, so they
      compare with the simulator's virtual seconds; ``arrival_s`` is the request's
      scheduled arrival (the trace timestamp / speed), never the moment it was sent.
    * ``completed``: HTTP 200 and a stream that ended with a ``finish_reason`` and no
      error. Anything else is ``rejected`` (refused or failed, nothing served): a 429,
      another status, a broken stream, a client-side error, a timeout. ``reject_reason``
      says which: the ``X-Kvc-Reject-Reason`` header, else the OpenAI error ``code``
      (unless it is a bare number, as vLLM sends), else ``http_STATUS``; client-side
      failures are ``client:KIND``.
    * ``ttft_s``: arrival → first chunk carrying text (or the finish, if no text came).
      ``tbt_s``: ``metrics.top_decile_mean`` of the gaps between consecutive text chunks
      (None with fewer than two chunks). A server that sends several tokens in one chunk,
      or holds back tokens without text, yields fewer, longer gaps.
    * tokens: ``usage.prompt_tokens`` (special tokens the engine adds included) and
      ``usage.prompt_tokens_details.cached_tokens`` (0 when absent), falling back to the
      trace's input length when the server sends no usage; output tokens from
      ``usage.completion_tokens``, else the number of text chunks.
    * no live equivalent: nodes (None), migrated tokens (0), prefill GPU seconds (0.0;
      the summary writes these figures as null).

Complexity: O(chunks) per request, O(R) per run.
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvc_sim.metrics import RequestRecord, percentile, top_decile_mean
from kvc_sim.trace import TraceRequest

__all__ = ["LiveResult", "live_figures", "to_record"]


@dataclass(frozen=True, slots=True)
class LiveResult:
    """One request as the client saw it; every time is wall seconds since the start."""

    request: TraceRequest
    arrival_s: float  # scheduled arrival
    sent_s: float  # left the client queue
    max_tokens: int  # asked for: the trace's output length, capped (at least 1)
    status: int | None = None  # None: no HTTP response (connect error, timeout)
    chunk_times_s: tuple[float, ...] = ()  # chunks that carried text
    first_token_s: float | None = None
    finish_s: float | None = None  # the stream ended (or the error response was read)
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    retry_after_s: float | None = None
    error_code: str | None = None  # OpenAI error ``code`` (else ``type``)
    reject_reason: str | None = None  # the X-Kvc-Reject-Reason header
    prefill_node: str | None = None  # X-Kvc-Prefill-Node (a conductor with --placement-headers)
    decode_node: str | None = None  # X-Kvc-Decode-Node
    client_error: str | None = None  # timeout, connect_error, bad_stream, stream_cut, ...
    error_message: str | None = None

    @property
    def completed(self) -> bool:
        return (
            self.status == 200
            and self.finish_reason is not None
            and self.client_error is None
            and self.error_code is None
        )

    @property
    def reason(self) -> str | None:
        """Why it was not served (None when it was)."""
        if self.completed:
            return None
        if self.client_error is not None:
            return f"client:{self.client_error}"
        if self.reject_reason:
            return self.reject_reason
        if self.error_code and not self.error_code.isdigit():  # vLLM's code is the status
            return self.error_code
        return f"http_{self.status}" if self.status is not None else "client:no_response"


def to_record(result: LiveResult, time_scale: float) -> RequestRecord:
    """The simulator's record of ``result``, in trace seconds (see the module docstring)."""
    if time_scale <= 0:
        raise ValueError("time_scale must be > 0")
    completed = result.completed
    ttft_s: float | None = None
    tbt_s: float | None = None
    if completed:
        first = result.first_token_s if result.first_token_s is not None else result.finish_s
        assert first is not None
        ttft_s = (first - result.arrival_s) / time_scale
        times = result.chunk_times_s
        gaps = [b - a for a, b in itertools.pairwise(times)]
        tbt_s = top_decile_mean(gaps) / time_scale if gaps else None
    return RequestRecord(
        request_id=result.request.request_id,
        arrival_s=result.arrival_s / time_scale,
        input_tokens=(
            result.prompt_tokens if result.prompt_tokens is not None
            else result.request.input_tokens
        ),
        output_tokens=(
            result.completion_tokens if result.completion_tokens is not None
            else len(result.chunk_times_s)
        ),
        outcome="completed" if completed else "rejected",
        reject_reason=result.reason,
        prefill_node=result.prefill_node,
        decode_node=result.decode_node,
        cached_tokens=(result.cached_tokens or 0) if completed else 0,
        migrated_tokens=0,
        prefill_s=0.0,
        ttft_s=ttft_s,
        tbt_s=tbt_s,
        finish_s=result.finish_s / time_scale if result.finish_s is not None else None,
    )  # fmt: skip


def live_figures(results: Sequence[LiveResult], time_scale: float) -> dict[str, Any]:
    """What only a live run has: statuses, 429s, errors, client queueing, rates.

    Durations are in trace seconds (wall / ``time_scale``) unless named ``wall``.
    """
    statuses = Counter(str(r.status) if r.status is not None else "none" for r in results)
    reasons = Counter(r.reason for r in results if r.reason is not None)
    retry_after = [r.retry_after_s for r in results if r.retry_after_s is not None]
    queued = [(r.sent_s - r.arrival_s) / time_scale for r in results]
    sent = sorted(r.sent_s for r in results)
    wall_s = max((r.finish_s or r.sent_s) for r in results) if results else 0.0
    window_s = sent[-1] - sent[0] if len(sent) > 1 else 0.0
    served = [r for r in results if r.completed]
    short = sum(
        1 for r in served if r.completion_tokens is not None and r.completion_tokens < r.max_tokens
    )
    return {
        "wall_s": wall_s,
        "trace_s": wall_s / time_scale,
        "achieved_request_rate_per_s": (len(sent) - 1) / window_s * time_scale
        if window_s > 0
        else None,
        "completed_rate_per_s": len(served) / wall_s * time_scale if wall_s > 0 else None,
        "status_counts": dict(sorted(statuses.items())),
        "rejected_429": sum(1 for r in results if r.status == 429),
        "retry_after_s_mean": statistics.fmean(retry_after) if retry_after else None,
        "not_served_by_reason": dict(reasons.most_common()),
        "client_errors": sum(1 for r in results if r.client_error is not None),
        "client_queue_s_p50": percentile(queued, 50),
        "client_queue_s_p99": percentile(queued, 99),
        "client_queue_s_max": max(queued) if queued else None,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in served),
        "cached_tokens": sum(r.cached_tokens or 0 for r in served),
        "completion_tokens": sum(r.completion_tokens or 0 for r in served),
        "completed_with_fewer_tokens": short,
    }
