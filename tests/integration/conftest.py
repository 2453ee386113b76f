"""Fixtures of the integration tier: one "both" agent (64 blocks) and a stub on it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from node_agent.server import AgentServer
from tests.conftest import AgentFactory


@pytest.fixture
async def agent(start_agent: AgentFactory) -> AgentServer:
    return await start_agent("both", capacity_blocks=64)


@pytest.fixture
async def stub(agent: AgentServer) -> AsyncIterator[pb_grpc.NodeAgentAsyncStub]:
    async with grpc.aio.insecure_channel(agent.address) as channel:
        yield pb_grpc.NodeAgentStub(channel)
