"""``kvc demo``: one conductor and two agents (prefill, decode) on loopback.

Each component runs as its own process, exactly as in production, on the
embedded engine with the tiny model shipped in the package. The supervisor waits
until the conductor reports ready, prints how to use it, and on Ctrl-C / SIGTERM
stops every process it started (SIGTERM, then SIGKILL after a grace period).
Children also get SIGTERM if the supervisor itself dies (Linux parent-death signal).
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
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

import httpx

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class DemoOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_port: int = 50061
    decode_port: int = 50062
    prefill_metrics_port: int = 0  # 0: the agent serves no /metrics
    decode_metrics_port: int = 0
    log_level: str = "INFO"
    startup_timeout_s: float = 180.0
    grace_s: float = 10.0


def _die_with_parent() -> Callable[[], None] | None:
    if not sys.platform.startswith("linux"):
        return None

    def setup() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    return setup


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class Supervisor:
    """Starts child processes and guarantees they are stopped."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []

    def spawn(self, name: str, args: list[str]) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvc_cli", *args],
            preexec_fn=_die_with_parent(),
        )
        self.children.append((name, proc))

    def exited(self) -> tuple[str, int] | None:
        for name, proc in self.children:
            code = proc.poll()
            if code is not None:
                return name, code
        return None

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


def run_demo(opts: DemoOptions) -> int:
    ports = [opts.port, opts.prefill_port, opts.decode_port]
    ports += [p for p in (opts.prefill_metrics_port, opts.decode_metrics_port) if p]
    if len(set(ports)) != len(ports):
        print(f"kvc demo: ports must differ, got {ports}", file=sys.stderr)
        return 2
    for port in ports:
        if not _port_free(opts.host, port):
            print(f"kvc demo: {opts.host}:{port} is already in use", file=sys.stderr)
            return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    sup = Supervisor(opts.grace_s)
    level = ["--log-level", opts.log_level]
    try:
        agent_ports = (
            ("prefill", opts.prefill_port, opts.prefill_metrics_port),
            ("decode", opts.decode_port, opts.decode_metrics_port),
        )
        for role, port, metrics_port in agent_ports:
            sup.spawn(
                f"{role} agent",
                [
                    *level,
                    "agent",
                    "--role",
                    role,
                    "--host",
                    opts.host,
                    "--port",
                    str(port),
                    "--node-id",
                    f"demo-{role}",
                    "--metrics-port",
                    str(metrics_port),
                ],
            )
        agents = f"{opts.host}:{opts.prefill_port},{opts.host}:{opts.decode_port}"
        sup.spawn(
            "conductor",
            [
                *level,
                "conductor",
                "--host",
                opts.host,
                "--port",
                str(opts.port),
                "--agents",
                agents,
                "--drain-delay-s",
                "0",
            ],
        )
        base = f"http://{opts.host}:{opts.port}"
        deadline = time.monotonic() + opts.startup_timeout_s
        ready = False
        while not stop.is_set() and time.monotonic() < deadline:
            if (dead := sup.exited()) is not None:
                print(f"kvc demo: the {dead[0]} exited with code {dead[1]}", file=sys.stderr)
                return 1
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/ready", timeout=2.0).status_code == 200:
                    ready = True
                    break
            stop.wait(0.5)
        if stop.is_set():
            return 0
        if not ready:
            print("kvc demo: the system did not become ready in time", file=sys.stderr)
            return 1
        model = httpx.get(f"{base}/v1/models", timeout=5.0).json()["data"][0]["id"]
        agent_metrics = "".join(
            f"  {role} agent metrics: http://{opts.host}:{mport}/metrics\n"
            for role, _, mport in agent_ports
            if mport
        )
        print(
            f"\nkv-conductor is ready.\n"
            f"  OpenAI base URL: {base}/v1   (any API key; model {model!r})\n\n"
            f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f'    -d \'{{"model": "{model}", "stream": true, '
            f'"messages": [{{"role": "user", "content": "Hello!"}}]}}\'\n\n'
            f"  Metrics: {base}/metrics   Readiness: {base}/ready\n"
            f"{agent_metrics}"
            f"  Press Ctrl-C to stop.\n",
            flush=True,
        )
        while not stop.is_set():
            if (dead := sup.exited()) is not None:
                print(f"kvc demo: the {dead[0]} exited with code {dead[1]}", file=sys.stderr)
                return 1
            stop.wait(0.5)
        return 0
    finally:
        sup.stop_all()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print("kvc demo: stopped", file=sys.stderr, flush=True)
