"""The engine loop: runs ``EngineScheduler`` steps in scaled real time and feeds each
request's stream.

Loop
    ``schedule`` → wait until the step's end → ``complete`` → publish the step's KV
    events as one batch → hand each output to its request's queue. Idle, it waits for a
    new request (or the next expiry of held prefill KV). Held prefill KV past its
    deadline is freed at each turn.

Pacing
    A step ends ``plan.duration_s x time_scale`` wall seconds after the previous step's
    end when they run back to back (after ``now`` when the engine was idle): the work
    between two steps (completing one, delivering its tokens, publishing its events,
    scheduling the next) overlaps the next step, as a GPU engine's CPU work overlaps its
    kernels (vLLM's asynchronous scheduling). Work that overruns a whole step delays
    that step's end to ``now`` — a step is never shorter than its profile time measured
    from the previous end, and no deficit is caught up later. Without this, every step
    of an engine sharing a loaded machine lasted its profile time plus that work.

Streams
    ``submit`` returns a ``RequestStream`` (an unbounded queue, bounded in practice by
    ``max_tokens``): ``StreamItem``s with one token each, the last with the finish reason.
    ``abort`` (client gone) and ``stop`` (a stop string matched) end a request at once;
    its blocks are freed before the next step.

Knobs
    ``time_scale`` (0: steps back to back), ``sleep`` and ``clock`` (tests inject them).

Complexity
    One scheduler step per loop turn; O(outputs) delivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvc_sim.vllm_sim.events import KvCacheEvent
from kvc_sim.vllm_sim.scheduler import EngineRequest, EngineScheduler, FinishReason

log = logging.getLogger("kvc_sim.vllm_sim.runner")

__all__ = ["EngineRunner", "EventSink", "RequestStream", "StreamItem"]

EventSink = Callable[[float, Sequence[KvCacheEvent]], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class StreamItem:
    token_id: int
    finish_reason: FinishReason | None


class RequestStream:
    """One request's tokens as the engine emits them."""

    def __init__(self, request: EngineRequest) -> None:
        self.request = request
        self._queue: asyncio.Queue[StreamItem] = asyncio.Queue()

    def put(self, item: StreamItem) -> None:
        self._queue.put_nowait(item)

    async def get(self) -> StreamItem:
        return await self._queue.get()


class EngineRunner:
    """Drives the scheduler (see the module docstring)."""

    def __init__(
        self,
        scheduler: EngineScheduler,
        *,
        time_scale: float,
        events: EventSink | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.scheduler = scheduler
        self.time_scale = time_scale
        self._events = events
        self._sleep = sleep
        self._clock = clock
        self._wall_clock = wall_clock
        self._streams: dict[str, RequestStream] = {}
        self._wake = asyncio.Event()
        self.busy_s = 0.0  # profile seconds of steps run

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def submit(self, request: EngineRequest) -> RequestStream:
        self.scheduler.add(request)
        stream = RequestStream(request)
        self._streams[request.request_id] = stream
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """The client left: drop the request and its blocks."""
        self._streams.pop(request_id, None)
        self.scheduler.abort(request_id)

    def stop(self, request_id: str) -> None:
        """A stop string matched: the request ends as ``"stop"`` (held KV kept)."""
        self._streams.pop(request_id, None)
        self.scheduler.finish_stopped(request_id, self._clock())

    def release_held(self, request_id: str) -> int | None:
        tokens = self.scheduler.release_held(request_id)
        if tokens is not None:
            self._wake.set()  # room for waiting requests
        return tokens

    async def flush_events(self) -> None:
        """Publish events queued outside a step (a prefix-cache reset)."""
        events = self.scheduler.pool.take_events()
        if events and self._events is not None:
            await self._events(self._wall_clock(), events)

    async def run(self, stop: asyncio.Event) -> None:
        stopping = asyncio.ensure_future(stop.wait())
        end_s: float | None = None  # the previous step's end, when back to back
        try:
            while not stop.is_set():
                if self.scheduler.expire_held(self._clock()):
                    log.warning("prefill KV held for a decode engine expired unpulled")
                plan = self.scheduler.schedule()
                if plan is None:
                    end_s = None
                    await self._idle(stopping)
                    continue
                self.busy_s += plan.duration_s
                now = self._clock()
                begin = now if end_s is None else end_s
                end_s = max(now, begin + plan.duration_s * self.time_scale)
                await self._sleep(end_s - now)
                outputs = self.scheduler.complete(plan, self._clock())
                await self.flush_events()
                for output in outputs:
                    rid = output.request.request_id
                    stream = self._streams.get(rid)
                    if output.finish_reason is not None:
                        self._streams.pop(rid, None)
                    if stream is not None:
                        stream.put(StreamItem(output.token_id, output.finish_reason))
                if self.time_scale == 0:
                    await asyncio.sleep(0)  # let the HTTP side run between steps
        finally:
            stopping.cancel()

    async def _idle(self, stopping: asyncio.Future[Any]) -> None:
        """Wait for work: a new request, released blocks, a hold expiring, or stop."""
        self._wake.clear()
        expiry = self.scheduler.next_hold_expiry_s()  # waiting requests may need those blocks
        timeout = None if expiry is None else max(0.0, expiry - self._clock())
        wake: asyncio.Future[Any] = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait(
                {wake, stopping}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            wake.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await wake
