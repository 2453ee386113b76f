"""bench.profile_stages's wrappers account thread time per stage (plain functions,
coroutines by their steps, async generators) only while on; bench.request_profile sums
the processes' reports per request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from bench.profile_stages import Accounts, Stage, role_of, wrap_stages
from bench.request_profile import per_request, stage_rows


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class _Service:
    def __init__(self) -> None:
        self.suspended = asyncio.Event()
        self.resume = asyncio.Event()

    def plain(self, x: int) -> int:
        _spin(0.01)
        return x + 1

    async def coroutine(self) -> str:
        _spin(0.01)
        self.suspended.set()
        await self.resume.wait()  # suspended: what runs meanwhile is not charged here
        _spin(0.01)
        return "done"

    async def stream(self) -> AsyncIterator[int]:
        for i in range(3):
            _spin(0.005)
            yield i

    def fails(self) -> None:
        raise ValueError("boom")


async def test_stages_are_charged_their_thread_time_while_on() -> None:
    accounts = Accounts()
    stages = tuple(
        Stage(name, __name__, "_Service", name)
        for name in ("plain", "coroutine", "stream", "fails")
    )
    missing = wrap_stages((*stages, Stage("gone", __name__, "_Service", "renamed")), accounts)
    assert missing == ["gone"]
    service = _Service()
    assert service.plain(1) == 2  # off: nothing counted
    assert accounts.calls == {}
    accounts.on = True
    assert service.plain(1) == 2
    waiting = asyncio.ensure_future(service.coroutine())
    await service.suspended.wait()
    _spin(0.05)  # another task's work on the same thread, while it waits
    service.resume.set()
    assert await waiting == "done"
    assert [i async for i in service.stream()] == [0, 1, 2]
    with pytest.raises(ValueError, match="boom"):
        service.fails()
    assert accounts.calls == {"plain": 1, "coroutine": 1, "stream": 4, "fails": 1}
    assert 0.01 <= accounts.seconds["plain"] < 0.03
    assert 0.02 <= accounts.seconds["coroutine"] < 0.045  # the other task's 50 ms is not
    assert 0.015 <= accounts.seconds["stream"] < 0.04


def test_the_roles_come_from_the_service_command_line() -> None:
    assert role_of(["python", "-m", "kvc_cli", "conductor", "--agents", "a:1"]) == "conductor"
    assert role_of(["python", "-m", "kvc_cli", "agent", "--engine", "vllm"]) == "agent"
    assert role_of(["python", "-m", "kvc_cli", "sim-engine", "--engine-id", "e"]) is None


def test_reports_are_summed_per_role_and_divided_per_request() -> None:
    reports = [
        {"role": "conductor", "main_thread_s": 2.0,
         "stages": {"decide": {"calls": 1000, "seconds": 0.2}}},
        {"role": "agent", "main_thread_s": 1.0,
         "stages": {"tx commit": {"calls": 600, "seconds": 0.03}}},
        {"role": "agent", "main_thread_s": 0.5,
         "stages": {"tx commit": {"calls": 400, "seconds": 0.02}}},
    ]  # fmt: skip
    assert per_request(reports, "agent", 1000) == pytest.approx(
        {"main thread": 1500.0, "tx commit": 50.0}
    )
    rows = stage_rows(reports, 1000)
    by_stage = {(process, stage): (us, calls) for process, stage, us, calls in rows}
    assert by_stage[("conductor", "decide")] == pytest.approx((200.0, 1.0))
    assert by_stage[("agent", "tx commit")] == pytest.approx((50.0, 1.0))
    assert rows[0][:2] == ("conductor", "main thread (all of it)")
