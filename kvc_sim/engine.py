"""The discrete-event loop: a virtual clock and a heap of timed callbacks.

What it models
    Nothing by itself: it owns ``now_s`` (virtual seconds) and runs zero-argument
    callbacks in time order. Callbacks scheduled for the same instant run in the order
    they were scheduled (a sequence number breaks ties), so a replay is deterministic.
    Everything that needs a clock (``BlockPool``, lease deadlines) reads ``loop.clock``.

Knobs
    ``run(until_s=)`` stops before the first event later than ``until_s``.

Complexity
    ``at``/``after`` O(log E) and ``run`` O(E log E) for E pending events.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

__all__ = ["EventLoop"]

Callback = Callable[[], None]


class EventLoop:
    """Virtual time; never reads the wall clock."""

    __slots__ = ("_heap", "_seq", "events_run", "now_s")

    def __init__(self, start_s: float = 0.0) -> None:
        self.now_s = start_s
        self._heap: list[tuple[float, int, Callback]] = []
        self._seq = 0
        self.events_run = 0

    def clock(self) -> float:
        return self.now_s

    def at(self, time_s: float, callback: Callback) -> None:
        """Run ``callback`` at ``time_s`` (never in the past: clamped to now)."""
        self._seq += 1
        heapq.heappush(self._heap, (max(time_s, self.now_s), self._seq, callback))

    def after(self, delay_s: float, callback: Callback) -> None:
        self.at(self.now_s + delay_s, callback)

    @property
    def pending(self) -> int:
        return len(self._heap)

    def run(self, until_s: float | None = None) -> None:
        heap = self._heap
        pop = heapq.heappop
        while heap:
            if until_s is not None and heap[0][0] > until_s:
                self.now_s = until_s
                return
            time_s, _, callback = pop(heap)
            self.now_s = time_s
            self.events_run += 1
            callback()
