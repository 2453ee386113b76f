"""The fault suite: real processes on loopback, killed and restarted the way production
kills them, each fault bounded in time. What must hold:

* conductor SIGKILL mid-stream: the agents hold no lock after the lease; a new
  conductor serves;
* decode agent SIGKILL mid-stream: the client's stream ends with an error event and
  [DONE]; the agent restarted on its port is used again within 5 s;
* prefill agent SIGKILL in the middle of a prefill (its Tx open), or dead before the
  conductor noticed: no token was sent, the request is retried on the other prefill
  node and succeeds;
* SIGTERM with a stream longer than ``shutdown_timeout_s``: the stream ends with an
  error event and [DONE] (not a cut connection), the conductor exits 0;
* a rolling conductor restart under load (a load balancer that follows /ready): 0
  failed requests.

Redis outages and a Redis restarted empty, a role with no agent, stalled bodies and the
bounded inputs are integration tests (tests/integration/test_redis.py,
test_api_errors.py, test_fuzz_api.py).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvc.processes import free_port
from tests.system.test_processes import MODEL, spawn, stop, wait_ready

pytestmark = pytest.mark.system

LEASE_S = 3.0
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
        "max_tokens": 3000, "ignore_eos": True, "stream": True}  # fmt: skip
SHORT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@dataclass
class Agent:
    role: str
    port: int
    metrics_port: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    stream: bool = False  # also serve Generate on a token stream (--stream-port 0)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = spawn(
            ["agent", "--host", "127.0.0.1", "--threads", "1", "--role", self.role,
             "--port", str(self.port), "--metrics-port", str(self.metrics_port),
             *(("--stream-port", "0") if self.stream else ())],
            self.log,
        )  # fmt: skip

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def gauge(self, name: str) -> float:
        # The metrics server starts just after the gRPC one (which made the system ready).
        deadline = time.monotonic() + 15
        while True:
            try:
                text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
                break
            except httpx.ConnectError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        assert match is not None, name
        return float(match.group(1))


@dataclass
class Fleet:
    tmp: Path
    agents: list[Agent] = field(default_factory=list)
    conductors: list[tuple[subprocess.Popen[bytes], Path, str]] = field(default_factory=list)

    def agent(self, role: str, *, stream: bool = False) -> Agent:
        n = len(self.agents)
        log = self.tmp / f"agent-{n}-{role}.log"
        agent = Agent(role, free_port(), free_port(), log, stream=stream)
        agent.start()
        self.agents.append(agent)
        return agent

    def conductor(self, *extra: str) -> str:
        port = free_port()
        log = self.tmp / f"conductor-{len(self.conductors)}.log"
        proc = spawn(
            ["conductor", "--port", str(port), "--agents",
             ",".join(a.address for a in self.agents), "--lease-s", str(LEASE_S), *extra],
            log,
        )  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        self.conductors.append((proc, log, base))
        wait_ready(base, self.procs(), self.logs())
        # Ready means one prefill and one decode node: wait for every agent, or a test
        # that kills one may find the conductor not knowing the others yet.
        live = sum(a.proc is not None and a.proc.poll() is None for a in self.agents)
        eventually(lambda: usable_agents(base) >= live, 30, "agents not all usable")
        return base

    def procs(self) -> list[subprocess.Popen[bytes]]:
        agents = [a.proc for a in self.agents if a.proc is not None and a.proc.poll() is None]
        return [*agents, *(p for p, _, _ in self.conductors if p.poll() is None)]

    def logs(self) -> list[Path]:
        agents = [a.log for a in self.agents if a.proc is not None and a.proc.poll() is None]
        return [*agents, *(log for p, log, _ in self.conductors if p.poll() is None)]


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    try:
        yield f
    finally:
        for proc in f.procs():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def usable_agents(base: str) -> int:
    """Agents the conductor can use now (/ready lists them: no keys are configured)."""
    try:
        agents = httpx.get(f"{base}/ready", timeout=2).json().get("agents") or []
    except (httpx.HTTPError, ValueError):
        return 0
    return sum(bool(a.get("usable")) for a in agents)


def eventually(check: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until ``check()`` held (it must, within ``timeout_s``)."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout_s, what
        time.sleep(0.05)
    return time.monotonic() - started


class Stream:
    """A streamed chat completion read in a thread: its data lines and whether it ended."""

    def __init__(self, base: str, body: dict[str, Any] = LONG) -> None:
        self.lines: list[str] = []
        self.first = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, args=(base, body), daemon=True)
        self._thread.start()

    def _read(self, base: str, body: dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line.removeprefix("data: "))
                        self.first.set()
        except httpx.HTTPError as exc:
            self.error = exc
        finally:
            self.first.set()

    def join(self) -> list[str]:
        self._thread.join(120)
        assert not self._thread.is_alive()
        return self.lines


def assert_ends_with_an_error_and_done(lines: list[str]) -> dict[str, Any]:
    assert lines[-1] == "[DONE]", lines[-3:]
    error: dict[str, Any] = json.loads(lines[-2])["error"]
    assert error["message"]
    return error


def no_locks(agent: Agent) -> bool:
    return agent.gauge("node_agent_open_transactions") == 0 and (
        agent.gauge("node_agent_kv_locked_blocks") == 0
    )


@pytest.mark.parametrize("token_stream", [False, True], ids=["grpc", "token-stream"])
def test_conductor_sigkill_mid_stream_leaves_no_lock_and_a_new_conductor_serves(
    fleet: Fleet, token_stream: bool
) -> None:
    prefill, decode = fleet.agent("prefill"), fleet.agent("decode", stream=token_stream)
    base = fleet.conductor()
    stream = Stream(base)
    assert stream.first.wait(60)
    fleet.conductors[0][0].send_signal(signal.SIGKILL)
    stream.join()
    assert stream.error is not None or stream.lines[-1] != "[DONE]"  # the conductor died
    eventually(lambda: no_locks(prefill) and no_locks(decode), LEASE_S + 5, "locks held")
    assert decode.gauge("node_agent_running_requests") == 0
    new = fleet.conductor()
    assert httpx.post(f"{new}/v1/chat/completions", json=SHORT, timeout=60).status_code == 200


@pytest.mark.parametrize("token_stream", [False, True], ids=["grpc", "token-stream"])
def test_decode_agent_sigkill_mid_stream_is_a_clean_error_and_its_restart_is_used(
    fleet: Fleet, token_stream: bool
) -> None:
    """Also with the decode agent's token stream: its restart comes back on a new
    stream port, which the conductor follows at its next poll."""
    fleet.agent("prefill")
    decode = fleet.agent("decode", stream=token_stream)
    base = fleet.conductor("--agent-poll-interval-s", "0.5")
    stream = Stream(base)
    assert stream.first.wait(60)
    decode.kill()
    error = assert_ends_with_an_error_and_done(stream.join())
    assert error["type"] == "server_error"
    refused = httpx.post(f"{base}/v1/chat/completions", json=SHORT, timeout=60)
    assert refused.status_code == 503  # no decode node: not a 429
    decode.start()  # the same port, a new process
    wait_ready(base, fleet.procs(), fleet.logs())  # once it serves, within 5 s:
    started = time.monotonic()
    eventually(
        lambda: (
            httpx.post(f"{base}/v1/chat/completions", json=SHORT, timeout=60).status_code == 200
        ),
        5.0,
        "the restarted agent was not used again within 5 s",
    )
    assert time.monotonic() - started < 5.0


def test_prefill_agent_sigkill_before_any_token_retries_on_the_other(fleet: Fleet) -> None:
    doomed, other = fleet.agent("prefill"), fleet.agent("prefill")
    fleet.agent("decode")
    base = fleet.conductor()
    doomed.kill()  # dead, but the conductor has not noticed yet
    for _ in range(4):  # whichever it picks first, every request is served
        r = httpx.post(f"{base}/v1/chat/completions", json=SHORT, timeout=60)
        assert r.status_code == 200, (r.text, fleet.conductors[0][1].read_text()[-3000:])
    assert other.gauge("node_agent_open_transactions") == 0


def test_sigterm_past_the_shutdown_deadline_ends_the_stream_with_an_error_and_done(
    fleet: Fleet,
) -> None:
    fleet.agent("both")
    base = fleet.conductor("--drain-delay-s", "0", "--shutdown-timeout-s", "1")
    stream = Stream(base)
    assert stream.first.wait(60)
    proc = fleet.conductors[0][0]
    proc.send_signal(signal.SIGTERM)
    error = assert_ends_with_an_error_and_done(stream.join())
    assert "shutting down" in error["message"]
    assert stream.error is None  # ended by the server, not a cut connection
    assert proc.wait(timeout=30) == 0
    eventually(lambda: no_locks(fleet.agents[0]), LEASE_S + 5, "locks held")


def test_rolling_conductor_restart_under_load_fails_no_request(fleet: Fleet) -> None:
    """Two conductors behind a load balancer that sends only to the ready ones; one is
    restarted (SIGTERM, a new process) while requests keep coming."""
    fleet.agent("prefill")
    fleet.agent("decode")
    bases = [fleet.conductor("--drain-delay-s", "1.5"), fleet.conductor("--drain-delay-s", "1.5")]
    ready = dict.fromkeys(bases, True)
    results: list[int] = []
    done = threading.Event()

    def balancer() -> None:  # a readiness probe every 100 ms, as a load balancer's
        while not done.is_set():
            for b in list(ready):
                try:
                    ready[b] = httpx.get(f"{b}/ready", timeout=1).status_code == 200
                except httpx.HTTPError:
                    ready[b] = False
            time.sleep(0.1)

    def client(i: int) -> None:
        while not done.is_set():
            targets = [b for b, ok in ready.items() if ok]
            if not targets:
                time.sleep(0.05)
                continue
            try:
                r = httpx.post(f"{targets[i % len(targets)]}/v1/chat/completions", json=SHORT,
                               timeout=60)  # fmt: skip
                results.append(r.status_code)
            except httpx.HTTPError:
                results.append(-1)

    threads = [threading.Thread(target=balancer), *(threading.Thread(target=client, args=(i,))
               for i in range(4))]  # fmt: skip
    for t in threads:
        t.start()
    try:
        eventually(lambda: len(results) >= 10, 60, "no load before the restart")
        old_proc = fleet.conductors[0][0]
        old_proc.send_signal(signal.SIGTERM)
        assert old_proc.wait(timeout=60) == 0
        del ready[bases[0]]
        ready[fleet.conductor("--drain-delay-s", "1.5")] = False  # the replacement
        served_before = len(results)
        eventually(lambda: len(results) >= served_before + 10, 60, "no load after it")
    finally:
        done.set()
        for t in threads:
            t.join(60)
    assert len(results) > 20
    assert set(results) == {200}, {code: results.count(code) for code in set(results)}
    stop(fleet.procs())


def test_prefill_agent_sigkill_mid_prefill_retries_on_the_other(fleet: Fleet) -> None:
    """The prefill node dies while it computes the prompt (its fused Tx is open): no
    token was sent, so the conductor places the request again and it succeeds."""
    prefills = [fleet.agent("prefill"), fleet.agent("prefill")]
    fleet.agent("decode")
    base = fleet.conductor()
    words = " ".join(f"w{i}" for i in range(1080))  # ~3,950 tokens: a long prefill
    body = {"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": 4}
    result: dict[str, Any] = {}

    def ask() -> None:
        result["resp"] = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)

    asker = threading.Thread(target=ask)
    asker.start()
    victim = None
    deadline = time.monotonic() + 30
    while victim is None and time.monotonic() < deadline and asker.is_alive():
        for agent in prefills:
            if agent.gauge("node_agent_open_transactions") > 0:
                victim = agent
                break
    assert victim is not None, "no prefill was seen in flight"
    victim.kill()
    asker.join(120)
    resp = result["resp"]
    assert resp.status_code == 200, resp.text
    survivor = prefills[1] if victim is prefills[0] else prefills[0]
    assert survivor.gauge("node_agent_open_transactions") == 0
