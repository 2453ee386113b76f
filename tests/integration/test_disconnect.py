"""A client that disconnects mid-stream cancels the engine work and leaks nothing.

The conductor runs under a real uvicorn server on 127.0.0.1:0 so the disconnect is a
real closed socket, as a browser tab or a killed script produces.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
import uvicorn

from conductor.app import create_app
from conductor.settings import ConductorSettings
from node_agent.server import AgentServer
from tests.conftest import AgentFactory, assert_no_locks, chat_body, wait_until
from tests.integration.test_metrics import request_counts


@pytest.fixture
async def served(start_agent: AgentFactory) -> AsyncIterator[tuple[str, list[AgentServer]]]:
    agents = [await start_agent("prefill"), await start_agent("decode")]
    app = create_app(ConductorSettings(port=0, agents=[a.address for a in agents]))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    task = asyncio.create_task(server.serve())
    await wait_until(lambda: server.started)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", agents
    server.should_exit = True
    await task


async def test_disconnect_mid_stream_stops_generation(
    served: tuple[str, list[AgentServer]],
) -> None:
    base, (prefill, decode) = served
    body = chat_body(max_tokens=4000, ignore_eos=True, stream=True)
    async with (
        httpx.AsyncClient(base_url=base, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.aiter_lines()
        for _ in range(6):  # a few chunks: the decode is under way
            await anext(lines)
        assert decode.engine.load().running_requests == 1
    # The connection is closed: the decode stops at once. Running its 4000 tokens to the
    # end would take several seconds (≈ 1 ms per token on this CPU), far over the bound.
    await wait_until(lambda: decode.engine.load().running_requests == 0, timeout_s=1.5)
    assert_no_locks(prefill, decode)
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        metrics = (await client.get("/metrics")).text
    assert "conductor_requests_in_flight 0.0" in metrics
    assert 'conductor_requests_total{endpoint="chat_completions",outcome="cancelled"} 1.0' in (
        metrics
    )
    assert request_counts(metrics) == {("chat_completions", "cancelled"): 1}  # once, only
