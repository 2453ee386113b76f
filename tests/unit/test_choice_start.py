"""Starting the n choices of one request: nothing started outlives a failure or a
cancellation (the dispatcher is a stand-in: only its ``start`` is used)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest

from conductor.api.admission import _start_choices
from conductor.core.scheduler import Slo
from conductor.errors import RateLimited
from conductor.generation import GenerationRequest
from conductor.state import AppState
from kvc.sampling import Sampling


class FakeStream:
    def __init__(self) -> None:
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True


def request() -> GenerationRequest:
    return GenerationRequest("r", "t", (1, 2, 3), Sampling(seed=7), Slo(1.0, 1.0))


def state_with(start: Any) -> AppState:
    return cast(AppState, SimpleNamespace(dispatcher=SimpleNamespace(start=start)))


async def test_choices_start_with_their_own_ids_and_seeds() -> None:
    seen: list[GenerationRequest] = []

    async def start(req: GenerationRequest) -> FakeStream:
        seen.append(req)
        return FakeStream()

    streams = await _start_choices(state_with(start), request(), 3)
    assert len(streams) == 3
    assert [r.request_id for r in seen] == ["r", "r.1", "r.2"]
    assert [r.sampling.seed for r in seen] == [7, 8, 9]


async def test_a_failing_choice_closes_the_started_and_cancels_the_pending() -> None:
    started: list[FakeStream] = []
    pending_cancelled = asyncio.Event()

    async def start(req: GenerationRequest) -> FakeStream:
        if req.request_id == "r.1":
            raise RateLimited("no room", retry_after_s=1.0, reason="no_decode_node")
        if req.request_id == "r.2":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                pending_cancelled.set()
                raise
        stream = FakeStream()
        started.append(stream)
        return stream

    with pytest.raises(RateLimited):
        await _start_choices(state_with(start), request(), 3)
    assert pending_cancelled.is_set()
    assert [s.closed for s in started] == [True]


async def test_a_cancelled_request_closes_the_choices_that_had_started() -> None:
    started: list[FakeStream] = []
    waiting = asyncio.Event()

    async def start(req: GenerationRequest) -> FakeStream:
        if req.request_id == "r.1":
            waiting.set()
            await asyncio.Event().wait()
        stream = FakeStream()
        started.append(stream)
        return stream

    task = asyncio.ensure_future(_start_choices(state_with(start), request(), 2))
    await waiting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [s.closed for s in started] == [True]
