"""Run the conductor under uvicorn with a rolling-update friendly shutdown.

SIGTERM (or Ctrl-C): ``/ready`` turns 503 at once, the process keeps serving for
``drain_delay_s`` so load balancers stop sending new requests, then uvicorn closes the
listener and lets in-flight requests (and their transactions) finish, up to
``shutdown_timeout_s``; a generation still running then ends with an error event and
[DONE] (a non-streamed one with a 503), never a cut connection. A second signal skips
the drain delay. The process exits 0 after a graceful stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI
from prometheus_client import multiprocess

from conductor.app import create_app
from conductor.errors import ServiceUnavailable
from conductor.http_server import uvicorn_config
from conductor.metrics import MULTIPROCESS_DIR_ENV
from conductor.settings import ConductorSettings
from kvc.logs import setup_logging
from kvc.processes import die_with_parent

log = logging.getLogger("conductor")

_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulServer(uvicorn.Server):
    """uvicorn with the conductor's shutdown: on SIGTERM, not ready for
    ``drain_delay_s`` (load balancers stop sending), then no new connections and up to
    ``shutdown_timeout_s`` for requests in flight; a generation still running then
    ends with an error (a stream: an error event and [DONE]) instead of a cut
    connection. A second signal skips the drain delay."""

    def __init__(
        self,
        config: uvicorn.Config,
        app: FastAPI,
        drain_delay_s: float,
        shutdown_timeout_s: float,
    ) -> None:
        super().__init__(config)
        self._app = app
        self._drain_delay_s = drain_delay_s
        self._shutdown_timeout_s = shutdown_timeout_s
        self._drain_until: float | None = None
        self._deadline_armed = False

    def _state(self) -> Any:
        return getattr(self._app.state, "conductor", None)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_until is None and self._drain_delay_s > 0:
            self._drain_until = time.monotonic() + self._drain_delay_s
            state = self._state()
            if state is not None:
                state.draining = True  # /ready answers 503 from now on
            log.info("draining for %.1f s before closing", self._drain_delay_s)
            return
        self._arm_deadline()
        super().handle_exit(sig, frame)

    def _arm_deadline(self) -> None:
        """Once closing starts: end what still runs after ``shutdown_timeout_s``."""
        if self._deadline_armed:
            return
        self._deadline_armed = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a signal outside the loop's callbacks
            loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(loop.call_later, self._shutdown_timeout_s, self._interrupt)

    def _interrupt(self) -> None:
        state = self._state()
        if state is None:
            return
        error = ServiceUnavailable(
            "The conductor is shutting down and ended this generation; retry.",
            retry_after_s=1.0,
        )
        count = state.dispatcher.interrupt_streams(error)
        if count:
            log.warning("shutdown deadline: ended %d generation(s) still running", count)

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

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        settle_garbage_collector()

    async def on_tick(self, counter: int) -> bool:
        if self._drain_until is not None and time.monotonic() >= self._drain_until:
            self._arm_deadline()
            self.should_exit = True
        return await super().on_tick(counter)


# Young-generation threshold once serving: the default (700 allocations) ran a collection
# every few requests.
GC_YOUNG_THRESHOLD = 20_000


def settle_garbage_collector() -> None:
    """Once started: what start-up built (modules, the app, the tokenizer's tables —
    ~110k tracked objects) is frozen out of every later collection, and young
    collections run after 20,000 net allocations instead of 700. Measured with 1,750
    requests through the hot-path benchmark: 0.174 s in the collector before, 0.021 s
    after (docs/benchmarks.md)."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def serve(settings: ConductorSettings, log_level: str) -> int:
    """Serve until stopped; returns the process's exit code. ``workers`` > 1: that many
    worker processes share the port (``WorkerSupervisor``)."""
    if settings.workers > 1:
        return WorkerSupervisor(settings, log_level).run()
    app = create_app(settings)
    config = uvicorn_config(settings, app, log_level)
    server = GracefulServer(config, app, settings.drain_delay_s, settings.shutdown_timeout_s)
    server.run()
    return 0 if server.started else STARTUP_FAILED


# The exit code of a conductor that never started serving (uvicorn's own).
STARTUP_FAILED = 3


# ---------------------------------------------------------------------------- workers
# A worker that exits this many times within the window stops them all (a crash loop: a
# port held by another program, a model folder that cannot be read): exit 1, for the
# orchestrator to see, rather than restarting for ever.
CRASHES_TO_GIVE_UP = 5
CRASH_WINDOW_S = 60.0
RESTART_DELAY_S = 1.0


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` that other processes bind too (SO_REUSEPORT: the
    kernel spreads new connections over those listening). Not listening yet: uvicorn
    listens once the app has started, so no connection waits on a worker still starting."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def run_worker(settings: ConductorSettings, log_level: str, index: int, parent: int) -> None:
    """One worker process: a whole conductor on a shared-port socket."""
    os.setsid()  # Ctrl-C in a terminal reaches the supervisor alone; it forwards it once
    die_with_parent()
    if os.getppid() != parent:  # the supervisor died before that was in place
        os.kill(os.getpid(), signal.SIGTERM)
    setup_logging(log_level)
    sock = reuse_port_socket(settings.host, settings.port)  # fails fast: a port held
    log.info("worker %d (pid %d) on port %d", index, os.getpid(), settings.port)
    app = create_app(settings)
    config = uvicorn_config(settings, app, log_level)
    server = GracefulServer(config, app, settings.drain_delay_s, settings.shutdown_timeout_s)
    server.run(sockets=[sock])
    if not server.started:
        sys.exit(STARTUP_FAILED)


class WorkerSupervisor:
    """Runs ``workers`` conductor processes on one port and keeps them running.

    Each worker is a whole conductor (its own fleet view, shadow index, cost models,
    limits) listening on the shared port with SO_REUSEPORT; the kernel spreads new
    connections over them. The supervisor sets ``PROMETHEUS_MULTIPROC_DIR`` to a fresh
    folder so ``/metrics`` from any worker sums them all (``conductor.metrics``).

    SIGTERM/SIGINT are forwarded to every worker (the first starts their drain, a second
    ends it, as for one process); the supervisor exits 0 when all stopped cleanly. A
    worker that exits while not stopping is restarted after ``RESTART_DELAY_S``;
    ``CRASHES_TO_GIVE_UP`` exits within ``CRASH_WINDOW_S`` stop them all (exit 1).
    Workers get SIGTERM if the supervisor dies (Linux).
    """

    def __init__(self, settings: ConductorSettings, log_level: str) -> None:
        self._settings = settings.model_copy(update={"workers": 1})
        self._count = settings.workers
        self._log_level = log_level
        self._context = multiprocessing.get_context("spawn")
        self._procs: dict[int, BaseProcess] = {}
        self._crashes: deque[float] = deque()
        self._restarts: dict[int, float] = {}  # worker index -> when to start it again
        self._stopping = False
        self._failed = False

    def run(self) -> int:
        metrics_dir = tempfile.mkdtemp(prefix="kvc-conductor-metrics-")
        previous = os.environ.get(MULTIPROCESS_DIR_ENV)
        os.environ[MULTIPROCESS_DIR_ENV] = metrics_dir  # inherited by the workers
        handlers = {sig: signal.signal(sig, self._forward) for sig in _HANDLED_SIGNALS}
        try:
            log.info("starting %d conductor workers on port %d", self._count, self._settings.port)
            for index in range(self._count):
                self._start(index)
            self._watch()
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            for proc in self._procs.values():  # only after an error of our own
                proc.kill()
            if previous is None:
                os.environ.pop(MULTIPROCESS_DIR_ENV, None)
            else:
                os.environ[MULTIPROCESS_DIR_ENV] = previous
            shutil.rmtree(metrics_dir, ignore_errors=True)
        return 1 if self._failed else 0

    def _start(self, index: int) -> None:
        proc = self._context.Process(
            target=run_worker,
            args=(self._settings, self._log_level, index, os.getpid()),
            name=f"kvc-conductor-{index}",
        )
        proc.start()
        self._procs[index] = proc
        if self._stopping and proc.pid is not None:  # a signal came while it was starting
            os.kill(proc.pid, signal.SIGTERM)

    def _forward(self, sig: int, _frame: FrameType | None) -> None:
        if not self._stopping:
            log.info("stopping %d conductor workers", len(self._procs))
        self._stopping = True
        for proc in self._procs.values():
            if proc.pid is not None and proc.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)

    def _watch(self) -> None:
        while self._procs or (self._restarts and not self._stopping):
            now = time.monotonic()
            for index, due in list(self._restarts.items()):
                if self._stopping:
                    self._restarts.clear()
                elif due <= now:
                    del self._restarts[index]
                    self._start(index)
            by_sentinel = {proc.sentinel: index for index, proc in self._procs.items()}
            timeout = min([1.0, *(due - now for due in self._restarts.values())])
            for sentinel in wait(list(by_sentinel), timeout=max(0.0, timeout)):
                assert isinstance(sentinel, int)  # a process's sentinel is a descriptor
                index = by_sentinel[sentinel]
                proc = self._procs.pop(index)
                proc.join()
                if proc.pid is not None:  # its live gauges leave /metrics
                    multiprocess.mark_process_dead(proc.pid)  # type: ignore[no-untyped-call]
                self._ended(index, proc)

    def _ended(self, index: int, proc: BaseProcess) -> None:
        if self._stopping:
            # Ended by the signal forwarded to it: it was still starting (a serving worker
            # handles the signal and exits 0).
            stopped = proc.exitcode is not None and -proc.exitcode in _HANDLED_SIGNALS
            if proc.exitcode != 0 and not stopped:
                log.warning("worker %d exited with %s while stopping", index, proc.exitcode)
                self._failed = True
            return
        log.error("worker %d (pid %s) exited with %s", index, proc.pid, proc.exitcode)
        now = time.monotonic()
        self._crashes.append(now)
        while self._crashes and self._crashes[0] < now - CRASH_WINDOW_S:
            self._crashes.popleft()
        if len(self._crashes) >= CRASHES_TO_GIVE_UP:
            log.error(
                "workers exited %d times in %.0f s: stopping them all", len(self._crashes),
                CRASH_WINDOW_S,
            )  # fmt: skip
            self._failed = True
            self._forward(signal.SIGTERM, None)
            self._forward(signal.SIGTERM, None)  # no drain: nothing is healthy
            return
        self._restarts[index] = now + RESTART_DELAY_S  # the watch loop starts it then
