"""The event loop the long-running ``kvc`` services run on.

uvloop (libuv) when it is installed — it is a dependency on Linux and macOS — and
asyncio's own loop otherwise. uvicorn already picks uvloop for the HTTP services
(``loop="auto"``); this gives the node agent, a grpc.aio server with an httpx client,
the same loop. Measured per request in ``bench.hot_path`` (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["run_event_loop"]

T = TypeVar("T")


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on uvloop's loop when available."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it builds
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
