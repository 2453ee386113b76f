"""Where the agent's KV-tier copies and disk I/O run: one I/O thread, off the event loop.

``LowerTiers`` keeps its bookkeeping on the event loop and hands each copy (device to
host, host to device), file write, read and removal to ``ThreadRunner.submit``; the work
runs on one thread (so a file's write, reads and removal never overlap), and its
completion comes back to the loop (``call_soon_threadsafe``), where ``LowerTiers``
applies it. Two lanes, each in submission order: urgent work (a transaction's
promotions, on a request's path) runs before any queued background work (demotion
copies, file writes and removals). Seen on an H200 with an 8B model: 1 GiB of demotions
per long prompt queued faster than the disk wrote them, and a promotion waiting behind
that backlog in one queue took 5.9 s instead of tens of milliseconds. A transaction
then finds what it promotes already on the device (``prefetch``), and an eviction that
demotes hundreds of blocks costs the loop bookkeeping, not copies: token streams of
other requests keep flowing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from kvc.block_keys import BlockKey
from node_agent.blocks.tiers import InlineRunner, LowerTiers

__all__ = ["ThreadRunner", "prefetch"]

T = TypeVar("T")

log = logging.getLogger("node_agent.tiers")


_Job = tuple[Callable[[], Any], Callable[[Any, BaseException | None], None]]


class ThreadRunner:
    """Runs tier work on one thread, urgent work first; ``done`` on the event loop that
    made it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tiers")
        self._closed = False
        self._lock = threading.Lock()
        self._urgent: deque[_Job] = deque()
        self._background: deque[_Job] = deque()
        self._unfinished = 0  # submitted, completion not yet handed to ``done``

    @property
    def pending(self) -> int:
        """Jobs whose completion has not reached ``done`` yet (the I/O backlog, the one
        running included). A ``done`` that submits more work (a failed write's file
        removal) does so before its own job stops counting: 0 means idle."""
        with self._lock:
            return self._unfinished

    def submit(
        self,
        work: Callable[[], T],
        done: Callable[[T | None, BaseException | None], None],
        *,
        urgent: bool = False,
    ) -> None:
        with self._lock:
            closed = self._closed
            if not closed:
                (self._urgent if urgent else self._background).append((work, done))
                self._unfinished += 1
        if closed:  # after shutdown (a last clear): at once, on the caller's thread
            InlineRunner().submit(work, done)
            return
        # One turn of the thread per job; each turn takes the next urgent job if any.
        try:
            self._executor.submit(self._next).add_done_callback(self._finished)
        except RuntimeError:  # shut down between the check and here: this turn, inline
            self._deliver(*self._next())

    def _next(self) -> tuple[Callable[[Any, BaseException | None], None], Any, Any]:
        with self._lock:
            work, done = self._urgent.popleft() if self._urgent else self._background.popleft()
        try:
            return done, work(), None
        except BaseException as exc:  # handed to done, which decides; a waiter never hangs
            return done, None, exc

    def _finished(self, future: Future[tuple[Any, Any, Any]]) -> None:
        done, result, error = future.result()
        try:
            self._loop.call_soon_threadsafe(self._deliver, done, result, error)
        except RuntimeError:  # the loop closed: nobody to tell
            with self._lock:
                self._unfinished -= 1

    def _deliver(
        self, done: Callable[[Any, BaseException | None], None], result: Any, error: Any
    ) -> None:
        try:
            done(result, error)
        finally:
            with self._lock:
                self._unfinished -= 1

    def close(self) -> None:
        """Finish what was submitted (pending writes), then stop the thread; work
        submitted from then on runs at once on the caller's thread."""
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=True)


async def prefetch(lower: LowerTiers, keys: Sequence[BlockKey]) -> None:
    """Stage the lower-tier blocks among ``keys`` on the device before a transaction
    promotes them (returns at once when there are none)."""
    ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def done() -> None:
        if not ready.done():
            ready.set_result(None)

    if lower.prefetch(keys, done):
        await ready
