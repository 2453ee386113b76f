"""Live replay: a recorded stream -> LiveResult -> the simulator's record and summary; the
arrival schedule in virtual time."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from kvc_sim.live.client import CompletionTarget, completions_url, send_completion
from kvc_sim.live.records import LiveResult, live_figures, to_record
from kvc_sim.live.schedule import Arrival, arrivals, dispatch
from kvc_sim.metrics import SimResult, summarize, top_decile_mean
from kvc_sim.trace import TraceRequest

REQ = TraceRequest("r000001", 3.0, 1000, 4, (1, 2))


class FakeClock:
    """Virtual time: ``sleep_until`` lets ready tasks run, then jumps there; tests move it
    with ``t``."""

    def __init__(self) -> None:
        self.t = 100.0
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    async def sleep_until(self, deadline: float) -> None:
        self.sleeps.append(deadline)
        await asyncio.sleep(0)
        self.t = max(self.t, deadline)


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


def text_chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"object": "text_completion", "choices": [
        {"index": 0, "text": text, "finish_reason": finish}]}  # fmt: skip


USAGE = {"choices": [], "usage": {"prompt_tokens": 1001, "completion_tokens": 4,
         "total_tokens": 1005, "prompt_tokens_details": {"cached_tokens": 512}}}  # fmt: skip


def transport_for(
    clock: FakeClock, events: list[tuple[float, bytes]], status: int = 200, **kw: Any
) -> httpx.MockTransport:
    """A server that answers with ``events`` (clock time, bytes), moving the clock."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True
        assert body["max_tokens"] == 4
        assert request.headers["x-kvc-slo-ttft-ms"] == "500"

        async def stream() -> AsyncIterator[bytes]:
            for at, data in events:
                clock.t = at
                yield data

        return httpx.Response(status, content=stream(), **kw)

    return httpx.MockTransport(handler)


async def send(clock: FakeClock, transport: httpx.MockTransport) -> LiveResult:
    target = CompletionTarget(
        url="http://server/v1/completions", model="m", headers={"X-Kvc-Slo-Ttft-Ms": "500"}
    )
    async with httpx.AsyncClient(transport=transport) as client:
        body = target.encode("prompt", 4)
        return await send_completion(
            client, target, REQ, body, 4, clock=clock, origin=90.0, arrival=100.0
        )


async def test_a_recorded_stream_gives_ttft_tbt_and_hit_ratio_in_trace_time() -> None:
    clock = FakeClock()
    clock.t = 101.0  # sent one second after its arrival (it waited in the client queue)
    events = [
        (102.0, sse(text_chunk(" a"))),
        (102.5, sse(text_chunk(" b"))),
        (103.5, sse(text_chunk(" c"))),
        (103.75, sse(text_chunk(" d", "length"))),
        (103.75, sse(USAGE)),
        (103.75, sse("[DONE]")),
    ]
    result = await send(clock, transport_for(clock, events))
    assert result.completed
    assert result.status == 200
    assert result.finish_reason == "length"
    assert result.arrival_s == 10.0
    assert result.sent_s == 11.0
    assert result.chunk_times_s == (12.0, 12.5, 13.5, 13.75)
    assert (result.prompt_tokens, result.completion_tokens, result.cached_tokens) == (1001, 4, 512)

    record = to_record(result, time_scale=2.0)  # wall seconds are twice trace seconds
    assert record.outcome == "completed"
    assert record.reject_reason is None
    assert record.arrival_s == 5.0
    assert record.ttft_s == 1.0  # (12 - 10) / 2: the queueing counts
    assert record.tbt_s == pytest.approx(top_decile_mean([0.5, 1.0, 0.25]) / 2) == 0.5
    assert (record.input_tokens, record.output_tokens, record.cached_tokens) == (1001, 4, 512)

    summary = summarize(SimResult((record,), (), 0, 0, 7.0, 0, 0.0), 1.5, 0.4, (0.4, 1.0))
    assert summary.hit_ratio == 512 / 1001
    assert summary.ttft_p50_s == 1.0
    assert summary.tbt_p90_s == 0.5
    assert summary.effective_capacity_by_tbt == {"0.4": 0.0, "1": 1.0}
    assert summary.completed == 1
    assert summary.rejected == 0


async def test_a_429_records_its_retry_after_code_and_reason() -> None:
    clock = FakeClock()
    body = {"error": {"message": "slow down", "type": "requests", "param": None,
                      "code": "rate_limit_exceeded"}}  # fmt: skip
    transport = transport_for(
        clock, [(100.5, json.dumps(body).encode())], status=429,
        headers={"Retry-After": "2", "X-Kvc-Reject-Reason": "overloaded"},
    )  # fmt: skip
    result = await send(clock, transport)
    assert not result.completed
    assert (result.status, result.retry_after_s, result.error_code) == (
        429,
        2.0,
        "rate_limit_exceeded",
    )
    assert result.error_message == "slow down"
    record = to_record(result, time_scale=1.0)
    assert record.outcome == "rejected"
    assert record.reject_reason == "overloaded"
    assert record.ttft_s is None
    assert record.cached_tokens == 0
    figures = live_figures([result], 1.0)
    assert figures["rejected_429"] == 1
    assert figures["retry_after_s_mean"] == 2.0
    assert figures["status_counts"] == {"429": 1}
    assert figures["not_served_by_reason"] == {"overloaded": 1}


async def test_an_error_event_or_a_cut_stream_is_not_served() -> None:
    clock = FakeClock()
    error = {"error": {"message": "node died", "type": "server_error", "code": "upstream_error"}}
    events = [(101.0, sse(text_chunk(" a"))), (101.5, sse(error))]
    result = await send(clock, transport_for(clock, events))
    assert not result.completed
    assert to_record(result, 1.0).reject_reason == "upstream_error"

    cut = await send(clock, transport_for(clock, [(102.0, sse(text_chunk(" a")))]))
    assert cut.client_error == "stream_cut"
    assert to_record(cut, 1.0).reject_reason == "client:stream_cut"


async def test_a_refused_connection_is_a_client_error() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    result = await send(FakeClock(), httpx.MockTransport(refuse))
    assert result.status is None
    assert result.client_error == "connect_error"
    assert live_figures([result], 1.0)["client_errors"] == 1


def test_completions_url_accepts_a_base_url_with_or_without_v1() -> None:
    want = "http://h:8000/v1/completions"
    assert completions_url("http://h:8000") == want
    assert completions_url("http://h:8000/") == want
    assert completions_url("http://h:8000/v1/") == want
    assert completions_url(want) == want
    assert completions_url("https://h/api/v1") == "https://h/api/v1/completions"
    for bad in ("h:8000", "ftp://h/v1", "localhost", "http://"):
        with pytest.raises(ValueError, match="http"):
            completions_url(bad)


def test_arrival_offsets_are_trace_time_over_speed_times_scale() -> None:
    reqs = [TraceRequest(f"r{i}", t, 10, 1, (i,)) for i, t in enumerate([5.0, 4.0, 6.5])]
    plan = arrivals(reqs, time_scale=3.0, speed=2.0)
    assert [a.request.request_id for a in plan] == ["r1", "r0", "r2"]
    assert [a.offset_s for a in plan] == [0.0, 1.5, 3.75]
    with pytest.raises(ValueError, match="> 0"):
        arrivals(reqs, time_scale=0.0, speed=1.0)


async def test_dispatch_sends_at_arrival_times_and_queues_beyond_the_bound() -> None:
    clock = FakeClock()
    reqs = [TraceRequest(f"r{i}", float(i), 10, 1, (i,)) for i in range(4)]
    plan = arrivals(reqs, time_scale=1.0, speed=1.0)
    release = {r.request_id: asyncio.Event() for r in reqs}
    started: list[tuple[str, float, float]] = []  # (id, scheduled arrival, sent at)
    prepared: list[tuple[str, float]] = []  # (id, clock when its body was made)
    in_flight = 0
    peak = 0

    def prepare(arrival: Arrival) -> str:
        prepared.append((arrival.request.request_id, clock.now()))
        return "body of " + arrival.request.request_id

    async def send_one(arrival: Arrival, at: float, body: str) -> None:
        nonlocal in_flight, peak
        assert body == "body of " + arrival.request.request_id
        in_flight += 1
        peak = max(peak, in_flight)
        started.append((arrival.request.request_id, at, clock.now()))
        await release[arrival.request.request_id].wait()
        in_flight -= 1

    task = asyncio.create_task(
        dispatch(plan, prepare, send_one, clock=clock, start=clock.now(), max_in_flight=2)
    )
    for _ in range(10):
        await asyncio.sleep(0)
    # r0 and r1 were sent at their arrivals; r2 arrived at 102 and waits for a slot
    assert started == [("r0", 100.0, 100.0), ("r1", 101.0, 101.0)]
    # Each body was made before its arrival: r1's and r2's while the previous waited.
    assert prepared == [("r0", 100.0), ("r1", 100.0), ("r2", 101.0)]
    assert clock.sleeps == [100.0, 101.0, 102.0]
    clock.t = 102.5
    release["r0"].set()
    for _ in range(10):
        await asyncio.sleep(0)
    assert started[2] == ("r2", 102.0, 102.5)  # sent late; its arrival stays 102
    release["r1"].set()
    release["r2"].set()
    release["r3"].set()
    await task
    assert [s[0] for s in started] == ["r0", "r1", "r2", "r3"]
    assert started[3][1] == 103.0
    assert peak == 2


def test_live_figures_rates_and_queueing_in_trace_time() -> None:
    def done(i: int, arrival: float, sent: float, finish: float) -> LiveResult:
        return LiveResult(
            request=TraceRequest(f"r{i}", arrival, 10, 2, (i,)), arrival_s=arrival,
            sent_s=sent, max_tokens=2, status=200, chunk_times_s=(finish - 1, finish),
            first_token_s=finish - 1, finish_s=finish, finish_reason="length",
            prompt_tokens=11, completion_tokens=1, cached_tokens=0,
        )  # fmt: skip

    results = [done(0, 0.0, 0.0, 4.0), done(1, 2.0, 4.0, 8.0), done(2, 4.0, 4.0, 6.0)]
    figures = live_figures(results, time_scale=2.0)
    assert figures["wall_s"] == 8.0
    assert figures["trace_s"] == 4.0
    assert figures["achieved_request_rate_per_s"] == 2 / 4 * 2
    assert figures["client_queue_s_max"] == 1.0  # 2 wall seconds = 1 trace second
    assert figures["completed_with_fewer_tokens"] == 3
    assert math.isclose(figures["completed_rate_per_s"], 3 / 8 * 2)


async def test_a_bare_numeric_error_code_reads_as_the_status() -> None:
    clock = FakeClock()
    body = {"error": {"message": "too long", "type": "BadRequestError", "code": 400}}
    result = await send(clock, transport_for(clock, [(100.1, json.dumps(body).encode())], 400))
    assert result.error_code == "400"
    assert to_record(result, 1.0).reject_reason == "http_400"
