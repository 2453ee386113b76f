"""System tier: ``kvc conductor --workers N`` — several conductor processes on one port.

Real processes on loopback: an agent (embedded engine) and a conductor supervisor with
two workers sharing the HTTP port (SO_REUSEPORT). Every request on a fresh connection
lands on either worker; ``/metrics`` from whichever answers sums both, also after a
worker was killed (its counts never go backwards) and restarted; SIGTERM stops them all
with exit 0. A port another program holds is a crash loop that ends in exit 1.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conductor.main import CRASHES_TO_GIVE_UP, STARTUP_FAILED
from kvc.processes import free_port
from tests.system.test_faults import eventually
from tests.system.test_processes import port_open, spawn, stop, wait_ready

pytestmark = pytest.mark.system

MODEL = "tiny-llama"
_SUCCESS = re.compile(
    r'^conductor_requests_total\{endpoint="completions",outcome="success"\} (\S+)$', re.MULTILINE
)


def worker_pids(supervisor: int) -> set[int]:
    """The supervisor's worker processes (not multiprocessing's resource tracker)."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == supervisor and b"spawn_main" in cmdline:
            pids.add(int(stat.parent.name))
    return pids


class Workers:
    def __init__(self, tmp: Path) -> None:
        http_port, agent_port = free_port(), free_port()
        self.base = f"http://127.0.0.1:{http_port}"
        self.logs = [tmp / "agent.log", tmp / "conductor.log"]
        agent = [
            "agent", "--host", "127.0.0.1", "--port", str(agent_port), "--threads", "1",
            "--role", "both", "--no-calibrate", "--stream-port", "0",
        ]  # fmt: skip
        conductor = [
            "conductor", "--port", str(http_port), "--workers", "2",
            "--agents", f"127.0.0.1:{agent_port}", "--drain-delay-s", "0",
        ]  # fmt: skip
        # The agent first: each worker polls it when it starts (and serves when it did).
        self.procs = [spawn(agent, self.logs[0])]
        eventually(lambda: port_open(agent_port), 120, "the agent listens")
        self.procs.append(spawn(conductor, self.logs[1]))

    @property
    def supervisor(self) -> int:
        return self.procs[1].pid

    def complete(self) -> int:
        """One completion on a connection of its own: its status."""
        body = {"model": MODEL, "prompt": "one two three", "max_tokens": 4}
        headers = {"Connection": "close"}
        r = httpx.post(f"{self.base}/v1/completions", json=body, headers=headers, timeout=60)
        return r.status_code

    def served(self) -> float:
        text = httpx.get(f"{self.base}/metrics", headers={"Connection": "close"}).text
        found = _SUCCESS.search(text)
        assert found is not None, text[:2000]
        return float(found.group(1))


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    system = Workers(tmp_path)
    try:
        wait_ready(system.base, system.procs, system.logs)
        yield system
    finally:
        for proc in system.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_workers_share_the_port_and_metrics_sum_them(workers: Workers) -> None:
    first = worker_pids(workers.supervisor)
    assert len(first) == 2

    assert [workers.complete() for _ in range(10)] == [200] * 10
    # Whichever worker answers the scrape, it counts both workers' requests.
    assert {workers.served() for _ in range(6)} == {10.0}

    killed = min(first)
    (kept,) = first - {killed}
    os.kill(killed, signal.SIGKILL)
    eventually(
        lambda: len(worker_pids(workers.supervisor) - {killed}) == 2, 60, "a worker restarted"
    )
    assert kept in worker_pids(workers.supervisor)

    assert [workers.complete() for _ in range(4)] == [200] * 4
    # The killed worker's counts stay in the sum (a counter never goes backwards).
    assert {workers.served() for _ in range(6)} == {14.0}

    codes = stop(workers.procs)
    said = workers.logs[1].read_text().splitlines()
    assert codes == [0, 0], [line for line in said if "WARNING" in line or "ERROR" in line]
    assert worker_pids(workers.supervisor) == set()


def test_a_port_held_elsewhere_is_a_crash_loop_that_ends_in_exit_1(tmp_path: Path) -> None:
    with socket.socket() as held:  # a listener without SO_REUSEPORT: nobody can share it
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        log = tmp_path / "conductor.log"
        proc = spawn(["conductor", "--port", str(port), "--workers", "2"], log)
        try:
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
    text = log.read_text()
    assert code == 1, text[-3000:]
    assert text.count("exited with") >= CRASHES_TO_GIVE_UP
    assert "stopping them all" in text


def test_workers_need_a_fixed_port(tmp_path: Path) -> None:
    log = tmp_path / "conductor.log"
    started = time.monotonic()
    proc = spawn(["conductor", "--port", "0", "--workers", "2"], log)
    assert proc.wait(timeout=60) == 2
    assert "workers > 1 share one fixed port" in log.read_text()
    assert time.monotonic() - started < 60


def test_one_conductor_that_never_serves_exits_3(tmp_path: Path) -> None:
    """Not 0: an orchestrator must see that it failed (uvicorn's own exit code for it)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        log = tmp_path / "conductor.log"
        proc = spawn(["conductor", "--port", str(held.getsockname()[1])], log)
        assert proc.wait(timeout=60) == STARTUP_FAILED, log.read_text()[-3000:]
