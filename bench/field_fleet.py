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
    started, watched and stopped by ``kvc_cli.supervisor.Supervisor`` (own sessions, a log
    file each, SIGTERM then SIGKILL to every group, parent-death signal), the same
    supervision as ``kvc fleet up``.

CPU seconds
    ``cpu_seconds(pid)`` is user + system time of a process and every live descendant, read
    from ``/proc`` (Linux); the benchmark samples it just before and just after the replay, so
    start-up (imports, calibration) is not counted.

Knobs: ``PEERS`` (pins). Complexity: O(processes) per sample.
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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

__all__ = [
    "PEERS",
    "PeerSpec",
    "cpu_seconds",
    "ensure_peer",
    "http_ok",
    "parse_proc_stat",
    "run_client",
    "sum_cpu",
]

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


def http_ok(url: str, check: Callable[[httpx.Response], bool] | None = None) -> bool:
    """Whether ``GET url`` answers 200 (and ``check`` accepts the response)."""
    try:
        response = httpx.get(url, timeout=2.0)
    except httpx.HTTPError:
        return False
    return response.status_code == 200 and (check is None or check(response))


def sum_cpu(pids: Iterable[int]) -> float:
    return sum(cpu_seconds(pid) for pid in pids)


def run_client(argv: Sequence[str], log: Path, timeout_s: float) -> tuple[int, float, float]:
    """Run a client to its end (own session, output appended to ``log``, SIGKILLed at
    ``timeout_s``); its exit code, wall seconds and CPU seconds (from wait4)."""
    started = time.perf_counter()
    with log.open("ab") as out:
        out.write(f"$ {shlex.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            list(argv), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )

    def kill() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout_s, kill)
    timer.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:  # Ctrl-C included: the client runs in its own session
        kill()
        proc.wait()
        raise
    finally:
        timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, time.perf_counter() - started, usage.ru_utime + usage.ru_stime
