"""The conductor retries TxCommit and TxAbort (idempotent by tx_id) when their reply is lost.

Between the conductor's ``AgentFleet`` and a real agent sits a lossy link: a gRPC server
in the test process that relays Tx calls to the agent and loses the first replies (the
agent acted; the caller sees UNAVAILABLE, or nothing until its deadline passes).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import grpc
import pytest

from conductor.adapters.agents import AgentFleet
from kvc.block_keys import KEY_LAYOUT, compute_block_keys
from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from kvc.wire import SERVICE_NAME
from node_agent.server import AgentServer
from tests.conftest import MODEL, AgentFactory, assert_no_locks

T = TypeVar("T")
Context = grpc.aio.ServicerContext[Any, Any]
TIMEOUT_S = 0.5


class LossyLink:
    """Relays Tx calls to a real agent; the first ``lose`` replies of each method are lost:
    replaced by ``code``, or (DEADLINE_EXCEEDED) held past the caller's deadline."""

    def __init__(self, agent: pb_grpc.NodeAgentAsyncStub) -> None:
        self.agent = agent
        self.lose = 0
        self.code = grpc.StatusCode.UNAVAILABLE
        self.calls: Counter[str] = Counter()

    async def _relay(self, method: str, reply: Awaitable[T], context: Context) -> T:
        self.calls[method] += 1
        try:
            result = await reply
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")
        if self.calls[method] <= self.lose:
            if self.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                await asyncio.sleep(TIMEOUT_S * 4)  # the caller gives up first
            await context.abort(self.code, f"{method} reply {self.calls[method]} lost")
        return result

    def handler(self) -> grpc.GenericRpcHandler:
        """The NodeAgent service's Tx methods, relayed."""

        def relay(
            method: str, request_type: Any, response_type: Any
        ) -> grpc.RpcMethodHandler[Any, Any]:
            async def handle(request: Any, context: Context) -> Any:
                return await self._relay(method, getattr(self.agent, method)(request), context)

            return grpc.unary_unary_rpc_method_handler(
                handle,
                request_deserializer=request_type.FromString,
                response_serializer=response_type.SerializeToString,
            )

        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "TxAllocate": relay("TxAllocate", pb.TxAllocateRequest, pb.TxAllocateResponse),
                "TxCommit": relay("TxCommit", pb.TxCommitRequest, pb.TxCommitResponse),
                "TxAbort": relay("TxAbort", pb.TxAbortRequest, pb.TxAbortResponse),
            },
        )


class Setup:
    """A real agent behind a lossy link, reached through the conductor's ``AgentFleet``."""

    def __init__(self, agent: AgentServer, link: LossyLink, port: int) -> None:
        self.agent = agent
        self.link = link
        self.observed: list[tuple[str, str]] = []  # (method, status) of every attempt
        self.fleet = AgentFleet(
            [f"127.0.0.1:{port}"],
            model=MODEL,
            rpc_timeout_s=TIMEOUT_S,
            observe_call=lambda method, code: self.observed.append((method.rsplit("/")[-1], code)),
        )
        self.stub = self.fleet.handles()[0].stub


@pytest.fixture
async def setup(start_agent: AgentFactory) -> AsyncIterator[Setup]:
    agent = await start_agent("both", capacity_blocks=64)
    async with grpc.aio.insecure_channel(agent.address) as to_agent:
        link = LossyLink(pb_grpc.NodeAgentStub(to_agent))
        server = grpc.aio.server(handlers=[link.handler()])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        s = Setup(agent, link, port)
        try:
            yield s
        finally:
            await s.fleet.aclose()
            await server.stop(None)


def allocate_request(tx_id: str) -> pb.TxAllocateRequest:
    keys = compute_block_keys(list(range(4 * 32)), tenant="t", model=MODEL, block_size=32)
    return pb.TxAllocateRequest(
        key_layout=KEY_LAYOUT, tx_id=tx_id, tenant="t", block_keys=list(keys), lease_s=30.0
    )


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
async def test_commit_and_abort_are_retried_when_replies_are_lost(
    setup: Setup, code: grpc.StatusCode
) -> None:
    stub = setup.stub
    await stub.TxAllocate(allocate_request("tx-commit"), timeout=TIMEOUT_S)
    await stub.TxAllocate(allocate_request("tx-abort"), timeout=TIMEOUT_S)
    setup.link.lose, setup.link.code = 2, code
    commit = await stub.TxCommit(pb.TxCommitRequest(tx_id="tx-commit"), timeout=TIMEOUT_S)
    assert commit.stored_blocks == 4  # the agent's first answer, repeated (idempotent)
    aborted = await stub.TxAbort(pb.TxAbortRequest(tx_id="tx-abort"), timeout=TIMEOUT_S)
    assert aborted.tx_id == "tx-abort"
    assert setup.link.calls == {"TxAllocate": 2, "TxCommit": 3, "TxAbort": 3}
    # Every attempt is counted in conductor_agent_calls_total.
    assert setup.observed[2:] == [
        ("TxCommit", code.name),
        ("TxCommit", code.name),
        ("TxCommit", "OK"),
        ("TxAbort", code.name),
        ("TxAbort", code.name),
        ("TxAbort", "OK"),
    ]
    assert_no_locks(setup.agent)
    assert setup.agent.service.pool.stats().cached_blocks == 4


async def test_retries_are_bounded(setup: Setup) -> None:
    await setup.stub.TxAllocate(allocate_request("tx-1"), timeout=TIMEOUT_S)
    setup.link.lose = 10
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await setup.stub.TxCommit(pb.TxCommitRequest(tx_id="tx-1"), timeout=TIMEOUT_S)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert setup.link.calls["TxCommit"] == 3
    assert_no_locks(setup.agent)  # the first attempt committed


async def test_other_calls_and_other_failures_are_not_retried(setup: Setup) -> None:
    setup.link.lose = 1
    with pytest.raises(grpc.aio.AioRpcError) as lost:
        await setup.stub.TxAllocate(allocate_request("tx-1"), timeout=TIMEOUT_S)
    assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
    assert setup.link.calls["TxAllocate"] == 1
    setup.link.lose = 0
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await setup.stub.TxCommit(pb.TxCommitRequest(tx_id="no-such-tx"), timeout=TIMEOUT_S)
    assert unknown.value.code() not in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    )
    assert setup.link.calls["TxCommit"] == 1
    await setup.stub.TxAbort(pb.TxAbortRequest(tx_id="tx-1"), timeout=TIMEOUT_S)
    assert_no_locks(setup.agent)
