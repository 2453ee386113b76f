"""``kvc demo``: one conductor and two agents (prefill, decode) on loopback.

Each component runs as its own process, exactly as in production, on the
embedded engine with the tiny model shipped in the package. The supervisor waits
until the conductor reports ready, prints how to use it, and on Ctrl-C / SIGTERM
stops every process it started (SIGTERM, then SIGKILL after a grace period;
kvc_cli.supervisor).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from dataclasses import dataclass

import httpx

from kvc.processes import port_free
from kvc_cli.supervisor import Supervisor, stop_on_signals


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


def run_demo(opts: DemoOptions) -> int:
    ports = [opts.port, opts.prefill_port, opts.decode_port]
    ports += [p for p in (opts.prefill_metrics_port, opts.decode_metrics_port) if p]
    if len(set(ports)) != len(ports):
        print(f"kvc demo: ports must differ, got {ports}", file=sys.stderr)
        return 2
    for port in ports:
        if not port_free(opts.host, port):
            print(f"kvc demo: {opts.host}:{port} is already in use", file=sys.stderr)
            return 2
    with stop_on_signals() as stop:
        sup = Supervisor(opts.grace_s)
        try:
            return _run(opts, sup, stop)
        finally:
            sup.stop_all()
            print("kvc demo: stopped", file=sys.stderr, flush=True)


def _ready(base: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{base}/ready", timeout=2.0).status_code == 200
    return False


def _run(opts: DemoOptions, sup: Supervisor, stop: threading.Event) -> int:
    level = ["--log-level", opts.log_level]
    agent_ports = (
        ("prefill", opts.prefill_port, opts.prefill_metrics_port),
        ("decode", opts.decode_port, opts.decode_metrics_port),
    )
    for role, port, metrics_port in agent_ports:
        sup.spawn(
            f"{role} agent",
            [
                *level, "agent", "--role", role, "--host", opts.host, "--port", str(port),
                "--stream-port", "0", "--node-id", f"demo-{role}",
                "--metrics-port", str(metrics_port),
            ],
        )  # fmt: skip
    agents = f"{opts.host}:{opts.prefill_port},{opts.host}:{opts.decode_port}"
    sup.spawn(
        "conductor",
        [
            *level, "conductor", "--host", opts.host, "--port", str(opts.port),
            "--agents", agents, "--drain-delay-s", "0",
        ],
    )  # fmt: skip
    base = f"http://{opts.host}:{opts.port}"
    failure = sup.wait_ready([lambda: _ready(base)], stop, opts.startup_timeout_s)
    if failure == "stopped":
        return 0
    if failure is not None:
        print(f"kvc demo: {failure}", file=sys.stderr)
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
        f"  gRPC between these processes is plaintext on loopback: a deployment uses mTLS\n"
        f"  (docs/security.md).\n"
        f"  Press Ctrl-C to stop.\n",
        flush=True,
    )
    while not stop.is_set():
        if (dead := sup.exited()) is not None:
            code = dead.proc.returncode
            print(f"kvc demo: the {dead.name} exited with code {code}", file=sys.stderr)
            return 1
        stop.wait(0.5)
    return 0
