"""Process helpers shared by every ``kvc`` process that starts others."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Final

__all__ = ["die_with_parent", "free_port", "free_ports", "port_free"]

_PR_SET_PDEATHSIG = 1

# Listening ports for children are chosen *below* the kernel's ephemeral range. A port
# from ``bind(port 0)`` lies inside that range, so between choosing it and the child's
# own bind any outgoing connection on the machine (a gRPC channel, an HTTP client) may
# take it as its source port, and the child dies with "Address already in use".
_PORT_FLOOR: Final = 10_000
_EPHEMERAL_DEFAULT: Final = 32_768
_RANGE_FILE: Final = "/proc/sys/net/ipv4/ip_local_port_range"


def die_with_parent() -> None:
    """Linux: this process gets SIGTERM (a graceful stop) when its parent dies, even by
    SIGKILL. Only prctl: safe between fork and exec (a ``preexec_fn``)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux), 32768 where unknown."""
    try:
        return int(Path(_RANGE_FILE).read_text(encoding="ascii").split()[0])
    except (OSError, ValueError, IndexError):
        return _EPHEMERAL_DEFAULT


def port_free(host: str, port: int, *, reuse_addr: bool = True) -> bool:
    """Whether a TCP server could bind ``host:port`` now. With ``reuse_addr`` off the test
    is stricter than any server's: a connection in TIME_WAIT on the port counts as busy."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if reuse_addr:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class _PortPicker:
    """Hands out ports from ``[floor, ephemeral low)``, walking forward from an offset
    drawn from the process id (two processes choosing at once start far apart) and never
    handing the same port out twice in one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._low = _PORT_FLOOR
        self._high = _ephemeral_low()
        span = max(self._high - self._low, 1)
        self._next = self._low + (os.getpid() * 7919) % span

    def take(self, count: int, host: str, consecutive: bool) -> list[int]:
        if self._high - self._low < 4 * max(count, 16):  # an unusual kernel range: no room
            return _kernel_ports(count, host)
        width = count if consecutive else 1
        picked: list[int] = []
        with self._lock:
            for _ in range(self._high - self._low):
                start = self._next
                if start + width > self._high:
                    start = self._low
                self._next = start + width
                run = range(start, start + width)
                if all(port_free(host, port, reuse_addr=False) for port in run):
                    picked.extend(run)
                    if len(picked) == count:
                        return picked
        raise OSError(f"no {count} free port(s) on {host} in [{self._low}, {self._high})")


def _kernel_ports(count: int, host: str) -> list[int]:
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket()
            socks.append(sock)
            sock.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in socks:
            sock.close()


_PICKER: Final = _PortPicker()


def free_ports(count: int, host: str = "127.0.0.1", *, consecutive: bool = False) -> list[int]:
    """``count`` distinct ports free on ``host`` now, for a child process to listen on;
    with ``consecutive`` they are one run ``[p, p + count)``. They lie below the kernel's
    ephemeral range, so no outgoing connection can take one before the child binds it."""
    if count < 1:
        raise ValueError(f"count must be at least 1, not {count}")
    return _PICKER.take(count, host, consecutive)


def free_port(host: str = "127.0.0.1") -> int:
    """One port free on ``host`` now, below the ephemeral range (see :func:`free_ports`)."""
    return free_ports(1, host)[0]
