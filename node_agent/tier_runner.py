"""Where the agent's KV-tier copies and disk I/O run: one I/O thread, off the event loop.

``LowerTiers`` keeps its bookkeeping on the event loop and hands each copy (device to
host, host to device), file write, read and removal to ``ThreadRunner.submit``; the work
runs in submission order on one thread (so a file's write, reads and removal never
overlap), and its completion comes back to the loop (``call_soon_threadsafe``), where
``LowerTiers`` applies it. A transaction then finds what it promotes already on the
device (``prefetch``), and an eviction that demotes hundreds of blocks costs the loop
bookkeeping, not copies: token streams of other requests keep flowing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from kvc.block_keys import BlockKey
from node_agent.blocks.tiers import InlineRunner, LowerTiers

__all__ = ["ThreadRunner", "prefetch"]

T = TypeVar("T")

log = logging.getLogger("node_agent.tiers")


class ThreadRunner:
    """Runs tier work on one thread; ``done`` on the event loop that made it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tiers")
        self._closed = False

    def submit(
        self, work: Callable[[], T], done: Callable[[T | None, BaseException | None], None]
    ) -> None:
        if self._closed:  # after shutdown (a last clear): at once, on the caller's thread
            InlineRunner().submit(work, done)
            return

        def finished(future: Future[T]) -> None:
            error = future.exception()
            result = None if error is not None else future.result()
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody to tell
                self._loop.call_soon_threadsafe(done, result, error)

        self._executor.submit(work).add_done_callback(finished)

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
