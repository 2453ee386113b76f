"""Child processes of ``kvc demo`` and ``kvc fleet up``, and the guarantee that they stop.

Each child is ``python -m kvc_cli ARGS`` (the same interpreter), started in order; the
supervisor notices when one exits by itself, and ``stop_all`` sends SIGTERM to every
child still running, waits up to ``grace_s`` for all of them together, then SIGKILLs the
rest. On Linux each child also gets SIGTERM when the supervisor itself dies (the
parent-death signal), so a killed supervisor leaves no orphans.

``wait_ready`` polls readiness probes until every one answers, a child exits, a stop is
asked for or a deadline passes; ``stop_on_signals`` turns Ctrl-C / SIGTERM into that stop.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import IO

__all__ = ["Supervisor", "port_free", "stop_on_signals"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> Callable[[], None] | None:
    if not sys.platform.startswith("linux"):
        return None

    def setup() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    return setup


def port_free(host: str, port: int) -> bool:
    """Whether a TCP server could bind ``host:port`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """An event set by SIGINT or SIGTERM while the block runs (handlers restored after)."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class Supervisor:
    """Starts child processes and guarantees they are stopped."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []

    def spawn(self, name: str, args: Sequence[str], log: IO[bytes] | None = None) -> None:
        """Start ``python -m kvc_cli ARGS``; its output goes to ``log`` (default: ours)."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvc_cli", *args],
            preexec_fn=_die_with_parent(),
            stdout=log,
            stderr=subprocess.STDOUT if log is not None else None,
        )
        self.children.append((name, proc))

    def exited(self) -> tuple[str, int] | None:
        """The first child that has exited, with its exit code; None while all run."""
        for name, proc in self.children:
            code = proc.poll()
            if code is not None:
                return name, code
        return None

    def wait_ready(
        self,
        probes: Sequence[Callable[[], bool]],
        stop: threading.Event,
        timeout_s: float,
        interval_s: float = 0.5,
    ) -> str | None:
        """Poll until every probe is true. None when ready; otherwise why not."""
        deadline = time.monotonic() + timeout_s
        pending = list(probes)
        while True:
            if (dead := self.exited()) is not None:
                return f"the {dead[0]} exited with code {dead[1]}"
            pending = [probe for probe in pending if not probe()]
            if not pending:
                return None
            if stop.is_set():
                return "stopped"
            if time.monotonic() > deadline:
                return "the system did not become ready in time"
            stop.wait(interval_s)

    def stop_all(self) -> None:
        for _, proc in self.children:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for _, proc in self.children:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
