"""Processes of the field benchmark (``bench.field_routers``): the peers' routers installed on
demand, the simulated engines, our conductor with one agent per engine, each started on
loopback, measured and stopped.

Peers
    ``vllm-router`` and ``smg`` are pinned (``PEERS``) and installed, on first use, each in
    its own virtual environment under ``.peers/<name>/`` (git-ignored; ``make test`` never
    touches them): their dependencies must not meet ours. A marker file records the pinned
    requirement, so a changed pin reinstalls. An install that fails is reported, not raised:
    the benchmark skips that peer's targets and says why.

Processes
    ``Processes`` starts each child in its own session (its own process group), its output in
    a log file; ``stop_all`` sends SIGTERM to every group, waits ``grace_s`` for all of them,
    then SIGKILLs the groups still there. Children also get SIGTERM if this process dies
    (Linux parent-death signal), so an interrupted benchmark leaves no fleet behind.

CPU seconds
    ``cpu_seconds(pid)`` is user + system time of a process and every live descendant, read
    from ``/proc`` (Linux); the benchmark samples it just before and just after the replay, so
    start-up (imports, calibration) is not counted.

Knobs: ``PEERS`` (pins), ``grace_s``. Complexity: O(processes) per sample.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

__all__ = [
    "PEERS",
    "PeerSpec",
    "Processes",
    "cpu_seconds",
    "ensure_peer",
    "free_ports",
    "http_ok",
    "label_value",
    "metric_samples",
    "parse_proc_stat",
    "sum_cpu",
]

_PR_SET_PDEATHSIG = 1
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True, slots=True)
class PeerSpec:
    name: str  # the venv's folder under .peers/
    requirement: str  # what pip installs (pinned)
    executable: str  # console script in the venv's bin/


PEERS: dict[str, PeerSpec] = {
    "vllm-router": PeerSpec("vllm-router", "vllm-router==0.1.17", "vllm-router"),
    "smg": PeerSpec("smg", "smg==1.13.0", "smg"),
}


def ensure_peer(spec: PeerSpec, peers_dir: Path, timeout_s: float = 900.0) -> Path | str:
    """The peer's executable, installed first if needed; or why it cannot be had."""
    venv = peers_dir / spec.name
    exe = venv / "bin" / spec.executable
    marker = venv / ".kvc-installed"
    if exe.is_file() and marker.is_file() and marker.read_text().strip() == spec.requirement:
        return exe
    log = peers_dir / f"{spec.name}-install.log"
    peers_dir.mkdir(parents=True, exist_ok=True)
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(venv)],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", spec.requirement],
    ]
    with log.open("w") as out:
        for step in steps:
            try:
                done = subprocess.run(
                    step, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, check=False
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                return f"installing {spec.requirement} failed ({exc}); log: {log}"
            if done.returncode != 0:
                return (
                    f"installing {spec.requirement} failed (exit {done.returncode} from "
                    f"{' '.join(step[:3])} ...); log: {log}"
                )
    if not exe.is_file():
        return f"{spec.requirement} installed no {spec.executable!r} console script; log: {log}"
    marker.write_text(spec.requirement + "\n")
    return exe


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free on ``host`` now (held open together while chosen)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket()
            socks.append(sock)
            sock.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for sock in socks:
            sock.close()


def parse_proc_stat(text: str) -> tuple[int, float]:
    """``(ppid, user + system seconds)`` from the text of ``/proc/PID/stat``.

    The command name (field 2) is in parentheses and may hold spaces or parentheses itself,
    so fields are counted from the last ``)``: state, ppid, ..., utime (14), stime (15).
    """
    rest = text[text.rindex(")") + 2 :].split()
    ppid = int(rest[1])
    utime, stime = int(rest[11]), int(rest[12])
    return ppid, (utime + stime) / _CLK_TCK


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out.extend(int(p) for p in (task / "children").read_text().split())
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants (0 once all are gone)."""
    total = 0.0
    todo = [pid]
    while todo:
        current = todo.pop()
        try:
            _, seconds = parse_proc_stat(Path(f"/proc/{current}/stat").read_text())
        except (OSError, ValueError, IndexError):
            continue
        total += seconds
        todo.extend(_children(current))
    return total


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def metric_samples(text: str, name: str) -> list[tuple[str, float]]:
    """Every sample of metric ``name`` in Prometheus text: ``(labels text, value)``."""
    out: list[tuple[str, float]] = []
    for line in text.splitlines():
        found = _SAMPLE.match(line)
        if found and found[1] == name:
            with contextlib.suppress(ValueError):
                out.append((found[2] or "", float(found[3])))
    return out


def label_value(labels: str, key: str) -> str | None:
    """The value of label ``key`` in a sample's ``{a="x",b="y"}`` text (None when absent)."""
    for part in labels.strip("{}").split(","):
        name, _, value = part.partition("=")
        if name.strip() == key:
            return value.strip().strip('"')
    return None


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(slots=True)
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path


class Processes:
    """Children started in their own process groups, logs in ``log_dir``; stopped together."""

    def __init__(self, log_dir: Path, grace_s: float = 10.0) -> None:
        self.log_dir = log_dir
        self.grace_s = grace_s
        self.children: list[Child] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    def spawn(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Child:
        log = self.log_dir / f"{name}.log"
        with log.open("ab") as out:
            out.write(f"$ {' '.join(argv)}\n".encode())
            out.flush()
            proc = subprocess.Popen(
                list(argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # only prctl: safe between fork and exec
            )
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    def exited(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def wait_until(self, ready: Callable[[], bool], what: str, timeout_s: float) -> None:
        """Poll ``ready`` until true; raise with the dead child's log tail if one exits."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if (dead := self.exited()) is not None:
                tail = dead.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(
                    f"{dead.name} exited with code {dead.proc.returncode} while waiting for "
                    f"{what}; its log ({dead.log}) ends:\n{tail}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{what}: not ready after {timeout_s:.0f} s (logs: {self.log_dir})"
                )
            time.sleep(0.25)

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


def http_ok(url: str, check: Callable[[httpx.Response], bool] | None = None) -> bool:
    """Whether ``GET url`` answers 200 (and ``check`` accepts the response)."""
    try:
        response = httpx.get(url, timeout=2.0)
    except httpx.HTTPError:
        return False
    return response.status_code == 200 and (check is None or check(response))


def sum_cpu(pids: Iterable[int]) -> float:
    return sum(cpu_seconds(pid) for pid in pids)
