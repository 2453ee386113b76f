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
import contextlib
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

    @property
    def pending(self) -> int:
        """Jobs waiting for the thread (the I/O backlog; the one running not counted)."""
        with self._lock:
            return len(self._urgent) + len(self._background)

    def submit(
        self,
        work: Callable[[], T],
        done: Callable[[T | None, BaseException | None], None],
        *,
        urgent: bool = False,
    ) -> None:
        if self._closed:  # after shutdown (a last clear): at once, on the caller's thread
            InlineRunner().submit(work, done)
            return
        with self._lock:
            (self._urgent if urgent else self._background).append((work, done))
        # One turn of the thread per job; each turn takes the next urgent job if any.
        self._executor.submit(self._next).add_done_callback(self._finished)

    def _next(self) -> tuple[Callable[[Any, BaseException | None], None], Any]:
        with self._lock:
            work, done = self._urgent.popleft() if self._urgent else self._background.popleft()
        try:
            return done, (work(), None)
        except Exception as exc:  # handed to done, which decides
            return done, (None, exc)

    def _finished(self, future: Future[tuple[Any, Any]]) -> None:
        done, (result, error) = future.result()
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody to tell
            self._loop.call_soon_threadsafe(done, result, error)

    def close(self) -> None:
        """Finish what was submitted (pending writes), then stop the thread."""
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
