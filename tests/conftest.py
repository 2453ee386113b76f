"""Shared fixtures: real node agents on loopback (port 0) and the conductor app in-process."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from conductor.app import create_app
from conductor.settings import ConductorSettings
from conductor.state import AppState
from kvc.processes import free_port
from kvc.roles import NodeRole
from kvc.tls import write_bundle
from kvc.v1 import node_agent_pb2 as pb
from node_agent.kv import KvLayout
from node_agent.main import build_engine
from node_agent.server import AgentServer
from node_agent.settings import AgentSettings
from node_agent.transfer.transport import GrpcKvTransport, KvRequest, KvTransport


class DelegatingTransport:
    """A KV transport passing everything to a real ``GrpcKvTransport``: a fault test
    overrides the one method its fault lives in."""

    def __init__(self) -> None:
        self._real = GrpcKvTransport()

    def send(
        self, data: bytes, *, layout: KvLayout, num_tokens: int, chunk_bytes: int
    ) -> AsyncIterator[pb.KvChunk]:
        return self._real.send(data, layout=layout, num_tokens=num_tokens, chunk_bytes=chunk_bytes)

    def receive(
        self, address: str, request: KvRequest, *, timeout_s: float | None = None
    ) -> AsyncGenerator[pb.KvChunk, None]:
        return self._real.receive(address, request, timeout_s=timeout_s)

    async def lend(
        self, address: str, request: pb.LendBlocksRequest, *, timeout_s: float | None = None
    ) -> pb.LendBlocksResponse:
        return await self._real.lend(address, request, timeout_s=timeout_s)

    async def aclose(self) -> None:
        await self._real.aclose()


MODEL = "tiny-llama"


@dataclass
class Conductor:
    app: FastAPI
    client: httpx.AsyncClient

    @property
    def state(self) -> AppState:
        state: AppState = self.app.state.conductor
        return state


AgentFactory = Callable[..., Awaitable[AgentServer]]
ConductorFactory = Callable[..., contextlib.AbstractAsyncContextManager[Conductor]]


@pytest.fixture
async def start_agent() -> AsyncIterator[AgentFactory]:
    """Start real agents (grpc.aio on 127.0.0.1:0); all are stopped at teardown."""
    started: list[AgentServer] = []

    async def start(
        role: NodeRole = "both", *, transport: KvTransport | None = None, **overrides: Any
    ) -> AgentServer:
        """An agent with these settings; ``transport`` replaces its KV transport (faults)."""
        overrides.setdefault("calibrate", False)  # tests/*/test_agent_calibration.py
        # Transfers between in-process agents stream (the path between hosts, with its
        # chunk checks); tests/integration/test_kv_shm.py opts into same-host files.
        overrides.setdefault("kv_shm_dir", "")
        overrides.setdefault("load_interval_s", 0.05)
        settings = AgentSettings(role=role, port=0, **overrides)
        server = AgentServer(settings, build_engine(settings), transport=transport)
        await server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        await server.stop(grace_s=0.5)


@pytest.fixture(scope="session")
def tls_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA and a conductor and an agent certificate (``kvc certs``), as a deployment
    mounts them: ca.pem, conductor.pem, conductor-key.pem, agent.pem, agent-key.pem; and
    agent certificates naming nodes ``node-a`` and ``node-b`` (agent-node-a.pem, ...)."""
    out = tmp_path_factory.mktemp("tls")
    write_bundle(out, nodes=("node-a", "node-b"))
    return out


def tls_settings(folder: Path, stem: str) -> dict[str, str]:
    """The settings of a process using ``folder``'s ``<stem>.pem`` and key, and its CA."""
    return {
        "tls_cert_file": str(folder / f"{stem}.pem"),
        "tls_key_file": str(folder / f"{stem}-key.pem"),
        "tls_ca_file": str(folder / "ca.pem"),
    }


@pytest.fixture
def conductor() -> ConductorFactory:
    """The real conductor app with its lifespan, reached through httpx's ASGI transport."""

    @contextlib.asynccontextmanager
    async def make(agents: list[AgentServer], **overrides: Any) -> AsyncIterator[Conductor]:
        settings = ConductorSettings(agents=[a.address for a in agents], **overrides)
        app = create_app(settings, poll_agents=False)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://conductor", timeout=60.0
            ) as client:
                yield Conductor(app=app, client=client)

    return make


class InTestServer(uvicorn.Server):
    """uvicorn for a test: the test process keeps its own signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def served(config: uvicorn.Config) -> AsyncIterator[uvicorn.Server]:
    """Serve ``config`` on its loopback port for the block."""
    server = InTestServer(config)
    task = asyncio.create_task(server.serve())
    await wait_until(lambda: server.started or task.done())
    assert not task.done(), task  # it failed to start: the task says why
    try:
        yield server
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def over_http(app: FastAPI) -> AsyncIterator[str]:
    """The app (its lifespan already running) on a real loopback port: its base URL, for
    clients that bring their own HTTP stack (the ``anthropic`` SDK)."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning")
    async with served(config):
        yield f"http://127.0.0.1:{port}"


async def rpc_status(call: Any) -> grpc.StatusCode:
    """The status a unary or server-streaming gRPC call ends with (it must fail)."""

    async def run() -> None:
        if hasattr(call, "__aiter__"):
            async for _ in call:
                pass
        else:
            await call

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await run()
    code: grpc.StatusCode = info.value.code()
    return code


def chat_body(content: str = "Hello there!", **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12,
        "temperature": 0,
    }
    body.update(extra)
    return body


def completion_body(prompt: str = "Once upon a time", **extra: Any) -> dict[str, Any]:
    """A legacy completion request: greedy, 12 tokens, unless ``extra`` says otherwise."""
    return {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, **extra}


async def streamed_events(client: httpx.AsyncClient, path: str, body: Any) -> list[Any]:
    """POST ``body`` with ``stream: true`` and return its SSE data events as JSON,
    ``[DONE]`` left out."""
    events: list[Any] = []
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def tool_result_turns(call_id: str, name: str, arguments: str, result: str) -> list[dict[str, Any]]:
    """The two messages that answer a tool call: the assistant's call, then its result."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]


def metric_value(exposition: str, series: str) -> float:
    """The value of one unlabelled series (``name``) in a Prometheus text exposition."""
    return next(
        float(line.split()[-1]) for line in exposition.splitlines() if line.startswith(f"{series} ")
    )


def assert_no_locks(*agents: AgentServer) -> None:
    """The invariant every request must leave behind: nothing locked, no open Tx."""
    for agent in agents:
        stats = agent.service.pool.stats()
        assert stats.locked_blocks == 0, stats
        assert stats.open_txs == 0, stats
        agent.service.pool.check_invariants()


async def wait_until(
    predicate: Callable[[], bool], timeout_s: float = 10.0, poll_s: float = 0.02
) -> None:
    """Wait for a condition another task makes true (shadow sync, lease expiry).

    ``poll_s=0`` yields to the loop between checks without sleeping, to catch a state
    that a handler on the same loop holds only briefly."""
    import asyncio

    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - no event to wait on across processes
            await asyncio.sleep(poll_s)


async def loop_turn() -> None:
    """Return once every callback queued with ``call_soon`` before this call has run (the
    loop runs them first in, first out): one deterministic step of the loop, for code
    that defers work to the end of a turn (write coalescing), not a wait for time."""
    import asyncio

    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    loop.call_soon(done.set_result, None)
    await done


class RedisServer:
    """A real redis-server on a free loopback port (Debian package ``redis-server``),
    without persistence: a restart comes back empty."""

    def __init__(self, binary: str, port: int, folder: Any) -> None:
        self.binary = binary
        self.port = port
        self.folder = folder
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc: Any = None
        self.start()

    def start(self) -> None:
        import socket
        import subprocess
        import time

        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.folder)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def restart_empty(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def redis_server(tmp_path: Any) -> Any:
    import shutil

    binary = shutil.which("redis-server")
    assert binary, "redis-server is not installed: run `make system-deps`"
    port = free_port()
    server = RedisServer(binary, port, tmp_path)
    yield server
    server.stop()


@dataclass
class ShadowSession:
    """A conductor's shadow of one agent, from a fleet of its own (no info polled yet)."""

    fleet: Any  # conductor.adapters.agents.AgentFleet
    handle: Any  # its one AgentHandle
    node: Any  # conductor.core.prefix_index.NodeId
    index: Any  # the PrefixIndex the session fills
    shadow: Any  # conductor.adapters.shadow.ShadowSync
    stop: asyncio.Event

    def start(self) -> asyncio.Task[None]:
        """One session (``ShadowSync._sync_once``), running until it ends."""
        return asyncio.create_task(self.shadow._sync_once(self.handle, self.node, self.stop))


@contextlib.asynccontextmanager
async def shadow_of(agent: AgentServer) -> AsyncIterator[ShadowSession]:
    """A ``ShadowSession`` of ``agent``; its fleet closed at the end."""
    from conductor.adapters.agents import AgentFleet
    from conductor.adapters.shadow import ShadowSync
    from conductor.core.prefix_index import NodeId, PrefixIndex

    fleet = AgentFleet([agent.address], model=MODEL, rpc_timeout_s=5.0)
    try:
        handle = fleet.handles()[0]
        index = PrefixIndex()
        yield ShadowSession(
            fleet, handle, NodeId(handle.address), index, ShadowSync(fleet, index), asyncio.Event()
        )
    finally:
        await fleet.aclose()
