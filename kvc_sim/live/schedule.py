"""When each request of a live replay leaves the client: open-loop arrivals, bounded
concurrency.

Timing
    Request ``i`` *arrives* ``(timestamp_i - timestamp_0) / speed * time_scale`` wall
    seconds after the start (``time_scale``: wall seconds per trace second, the sim
    engine's meaning; ``speed``: ``kvc bench replay --speed``). Arrivals never wait for
    answers (open loop). At most ``max_in_flight`` requests are outstanding; an arrival
    beyond that waits in a FIFO client queue, and that wait is part of its latency (its
    TTFT is measured from its arrival, not from when it was sent). What a request needs
    before it can leave (its prompt, its encoded body: ``prepare``) is made before its
    arrival, while the dispatcher waits for it, so that work is not counted in its TTFT.

The clock is a parameter (``Clock``), so tests drive the dispatcher in virtual time.

Knobs: ``time_scale``, ``speed``, ``max_in_flight``. Complexity: O(R) for R requests,
plus one task per request in flight.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from kvc_sim.trace import TraceRequest

__all__ = ["Arrival", "Clock", "MonotonicClock", "arrivals", "dispatch"]


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale."""

    async def sleep_until(self, deadline: float) -> None:
        """Return once ``now() >= deadline`` (at once if it already is)."""


class MonotonicClock:
    """Wall time: ``time.perf_counter`` and ``asyncio.sleep``."""

    def now(self) -> float:
        return time.perf_counter()

    async def sleep_until(self, deadline: float) -> None:
        delay = deadline - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)


_: Clock = MonotonicClock()


@dataclass(frozen=True, slots=True)
class Arrival:
    request: TraceRequest
    offset_s: float  # wall seconds after the replay's start


def arrivals(requests: Sequence[TraceRequest], *, time_scale: float, speed: float) -> list[Arrival]:
    """Wall-clock arrival offsets of ``requests`` (in arrival order; see the docstring)."""
    if time_scale <= 0 or speed <= 0:
        raise ValueError("time_scale and speed must be > 0")
    if not requests:
        return []
    origin = min(r.arrival_s for r in requests)
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    return [Arrival(r, (r.arrival_s - origin) / speed * time_scale) for r in ordered]


P = TypeVar("P")


async def dispatch(
    plan: Sequence[Arrival],
    prepare: Callable[[Arrival], P],
    send: Callable[[Arrival, float, P], Awaitable[None]],
    *,
    clock: Clock,
    start: float,
    max_in_flight: int,
) -> None:
    """Run ``send(arrival, at, prepare(arrival))`` for every arrival at ``at = start +
    offset`` on ``clock``, at most ``max_in_flight`` at once; ``prepare`` runs before the
    wait for ``at`` (one arrival ahead). Return when every send has finished (if
    cancelled, the sends in flight are cancelled). ``send`` records its own failures: one
    that raises (or a ``prepare`` that raises) cancels the others.
    """
    if max_in_flight < 1:
        raise ValueError("max_in_flight must be >= 1")
    slots = asyncio.Semaphore(max_in_flight)

    async def run(arrival: Arrival, at: float, prepared: P) -> None:
        try:
            await send(arrival, at, prepared)
        finally:
            slots.release()

    async with asyncio.TaskGroup() as group:
        for arrival in plan:
            at = start + arrival.offset_s
            prepared = prepare(arrival)
            await clock.sleep_until(at)
            await slots.acquire()  # the client queue: FIFO, later arrivals wait behind
            group.create_task(run(arrival, at, prepared))
