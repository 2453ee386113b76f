"""Child processes of ``kvc demo``, ``kvc fleet up`` and the benchmarks, and the guarantee
that they stop.

``spawn`` starts ``python -m kvc_cli ARGS`` (the same interpreter), ``spawn_argv`` any
program. Each child runs in its own session (process group), so a terminal's Ctrl-C
reaches only the supervisor, which then stops them all; its output goes to
``log_dir/NAME.log`` when the supervisor has a ``log_dir`` (headed by the command line),
else to the supervisor's own output. On Linux each child also gets SIGTERM when the
supervisor itself dies (the parent-death signal), so a killed supervisor leaves no
orphans. ``stop_all`` sends SIGTERM to every child's group still running, waits up to
``grace_s`` for all of them together, then SIGKILLs the groups left.

``wait_ready`` polls readiness probes until every one answers, a child exits, a stop is
asked for or a deadline passes (returns why not); ``wait_until`` is the same for one probe,
raising with the tail of a dead child's log. ``stop_on_signals`` turns Ctrl-C / SIGTERM
into that stop.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from kvc.processes import die_with_parent

__all__ = ["Child", "Supervisor", "stop_on_signals"]


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


@dataclass(frozen=True, slots=True)
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path | None  # None: the supervisor's own output

    def log_tail(self, chars: int = 3000) -> str:
        if self.log is None:
            return "(its output went to the supervisor's)"
        return self.log.read_text(errors="replace")[-chars:]


class Supervisor:
    """Starts child processes and guarantees they are stopped."""

    def __init__(self, grace_s: float, log_dir: Path | None = None) -> None:
        self.grace_s = grace_s
        self.log_dir = log_dir
        self.children: list[Child] = []
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)

    def spawn(self, name: str, args: Sequence[str]) -> Child:
        """Start ``python -m kvc_cli ARGS``."""
        return self.spawn_argv(name, [sys.executable, "-m", "kvc_cli", *args])

    def spawn_argv(
        self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None
    ) -> Child:
        """Start any program in its own session (see the module docstring)."""
        log = None if self.log_dir is None else self.log_dir / f"{name}.log"
        with contextlib.ExitStack() as files:
            out = None
            if log is not None:
                out = files.enter_context(log.open("ab"))  # the child keeps its own copy
                out.write(f"$ {shlex.join(argv)}\n".encode())
                out.flush()
            proc = subprocess.Popen(
                list(argv),
                stdout=out,
                stderr=subprocess.STDOUT if out is not None else None,
                stdin=subprocess.DEVNULL,
                env=None if env is None else dict(env),
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    def exited(self) -> Child | None:
        """The first child that has exited by itself; None while all run."""
        return next((c for c in self.children if c.proc.poll() is not None), None)

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
                return f"the {dead.name} exited with code {dead.proc.returncode}"
            pending = [probe for probe in pending if not probe()]
            if not pending:
                return None
            if stop.is_set():
                return "stopped"
            if time.monotonic() > deadline:
                return "the system did not become ready in time"
            stop.wait(interval_s)

    def wait_until(self, ready: Callable[[], bool], what: str, timeout_s: float) -> None:
        """Poll ``ready`` until true; RuntimeError (with a dead child's log) otherwise."""
        failure = self.wait_ready([ready], threading.Event(), timeout_s, interval_s=0.25)
        if failure is None:
            return
        dead = self.exited()
        if dead is not None:
            raise RuntimeError(
                f"{dead.name} exited with code {dead.proc.returncode} while waiting for "
                f"{what}; its log ({dead.log}) ends:\n{dead.log_tail()}"
            )
        raise RuntimeError(f"{what}: not ready after {timeout_s:.0f} s (logs: {self.log_dir})")

    def stop_all(self) -> None:
        live = [c for c in self.children if c.proc.poll() is None]
        for child in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for child in live:
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.proc.pid, signal.SIGKILL)
                child.proc.wait()
        self.children.clear()
