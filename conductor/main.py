"""Run the conductor under uvicorn with a rolling-update friendly shutdown.

SIGTERM (or Ctrl-C): ``/ready`` turns 503 at once, the process keeps serving for
``drain_delay_s`` so load balancers stop sending new requests, then uvicorn closes the
listener and lets in-flight requests (and their transactions) finish, up to 30 s. A
second signal stops at once. The process exits 0 after a graceful stop.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

import uvicorn
from fastapi import FastAPI

from conductor.app import create_app
from conductor.settings import ConductorSettings

log = logging.getLogger("conductor")

_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_delay_s: float) -> None:
        super().__init__(config)
        self._app = app
        self._drain_delay_s = drain_delay_s
        self._drain_until: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_until is None and self._drain_delay_s > 0:
            self._drain_until = time.monotonic() + self._drain_delay_s
            state = getattr(self._app.state, "conductor", None)
            if state is not None:
                state.draining = True  # /ready answers 503 from now on
            log.info("draining for %.1f s before closing", self._drain_delay_s)
            return
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM go to ``handle_exit`` while serving. Unlike uvicorn's own,
        the signal is not raised again after a graceful shutdown (that exits -15): a
        drained conductor exits 0 like the agents."""
        if threading.current_thread() is not threading.main_thread():
            yield  # signals can only be handled on the main thread
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_until is not None and time.monotonic() >= self._drain_until:
            self.should_exit = True
        return await super().on_tick(counter)


def serve(settings: ConductorSettings, log_level: str) -> None:
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level.lower(),
        timeout_keep_alive=settings.keepalive_timeout_s,
        timeout_graceful_shutdown=30,
    )
    GracefulServer(config, app, settings.drain_delay_s).run()
