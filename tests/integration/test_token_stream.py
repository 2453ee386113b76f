"""Generate over an agent's token stream (``--stream-port``): the conductor prefers it
when the agent offers one, and it behaves as the gRPC call does — the same answers, the
same errors, cancellation that aborts the fused transaction, deadlines, mTLS and the
role check."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from conductor.adapters.token_stream import StreamCall, TokenStreamClient
from kvc.block_keys import compute_block_keys
from kvc.v1 import node_agent_pb2 as pb
from node_agent.server import AgentServer
from tests.conftest import (
    MODEL,
    AgentFactory,
    ConductorFactory,
    assert_no_locks,
    chat_body,
    rpc_status,
    tls_settings,
    wait_until,
)


def streamed_text(body: str) -> str:
    text = ""
    for block in body.split("\n\n"):
        if block.startswith("data: {"):
            for choice in json.loads(block[len("data: ") :])["choices"]:
                text += choice["delta"].get("content") or ""
    return text


async def drain(call: StreamCall) -> None:
    while await call.read() is not grpc.aio.EOF:
        pass


def uses_stream(agent: AgentServer) -> bool:
    return agent.token_stream is not None and agent.token_stream.connections > 0


async def test_the_same_answers_as_over_grpc(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both", stream_port=0)
    assert agent.service.node_info.stream_address.startswith("127.0.0.1:")
    answers: dict[bool, tuple[str, str]] = {}
    for token_stream in (False, True):
        async with conductor([agent], token_stream=token_stream) as c:
            whole = await c.client.post("/v1/chat/completions", json=chat_body("Tell me"))
            assert whole.status_code == 200, whole.text
            body = chat_body("Tell me", stream=True)
            streamed = await c.client.post("/v1/chat/completions", json=body)
            assert streamed.status_code == 200, streamed.text
            answers[token_stream] = (
                whole.json()["choices"][0]["message"]["content"],
                streamed_text(streamed.text),
            )
            assert uses_stream(agent) is token_stream
        await wait_until(lambda: agent.token_stream is not None and not uses_stream(agent))
    assert answers[True] == answers[False]
    assert answers[True][0] == answers[True][1]
    assert_no_locks(agent)


async def test_errors_are_the_grpc_calls_errors(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    """A request the node cannot hold is refused the same way on both transports."""
    agent = await start_agent("both", stream_port=0, capacity_blocks=4)
    results: list[tuple[int, Any]] = []
    for token_stream in (False, True):
        async with conductor([agent], token_stream=token_stream) as c:
            r = await c.client.post("/v1/chat/completions", json=chat_body("word " * 400))
            results.append((r.status_code, r.json()["error"]["code"]))
    assert results[0] == results[1]
    assert results[0][0] in (429, 503)
    assert_no_locks(agent)


async def test_a_cancelled_call_aborts_its_generation_and_transaction(
    start_agent: AgentFactory,
) -> None:
    agent = await start_agent("both", stream_port=0)
    client = TokenStreamClient(agent.service.node_info.stream_address, None, "loopback")
    prompt = [1 + i for i in range(2 * 32 + 3)]
    keys = [int(k) for k in compute_block_keys(prompt[:-1], tenant="t", model=MODEL, block_size=32)]
    tx = pb.TxAllocateRequest(tx_id="c", tenant="t", block_keys=keys, lease_s=30)
    request = pb.GenerateRequest(
        request_id="c",
        tenant="t",
        tx_id="c",
        tx=tx,
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
    )
    call = client.generate(request, timeout=30)
    first = await call.read()
    assert first.token_ids
    assert agent.service.busy() != (0, 0)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):  # as a cancelled gRPC call's read
        await call.read()
    await wait_until(lambda: agent.service.busy() == (0, 0))
    assert_no_locks(agent)
    # A deadline ends the call the same way, with gRPC's status.
    request.request_id = request.tx_id = request.tx.tx_id = "d"
    call = client.generate(request, timeout=0.05)
    assert await rpc_status(drain(call)) == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_until(lambda: agent.service.busy() == (0, 0))
    assert_no_locks(agent)
    client.close()


async def test_over_mtls_with_the_role_check(
    start_agent: AgentFactory, conductor: ConductorFactory, tls_bundle: Path
) -> None:
    agent = await start_agent("both", stream_port=0, **tls_settings(tls_bundle, "agent"))
    async with conductor([agent], **tls_settings(tls_bundle, "conductor")) as c:
        r = await c.client.post("/v1/chat/completions", json=chat_body(stream=True))
        assert r.status_code == 200, r.text
        assert streamed_text(r.text)
        assert uses_stream(agent)
    from kvc.tls import TlsFiles

    def files(stem: str) -> TlsFiles:
        found = TlsFiles.from_settings(*tls_settings(tls_bundle, stem).values())
        assert found is not None
        return found

    address = agent.service.node_info.stream_address
    request = pb.GenerateRequest(request_id="x", prompt_token_ids=[1, 2, 3])
    peer = TokenStreamClient(address, files("agent"), "loopback")
    call = peer.generate(request, timeout=10)
    assert await rpc_status(call.read()) == grpc.StatusCode.PERMISSION_DENIED
    peer.close()
    with pytest.raises(ValueError, match="refusing plaintext"):
        TokenStreamClient("10.0.0.1:1", None, "loopback")
    plain = TokenStreamClient(address, None, "loopback")  # no certificate: no handshake
    unavailable = grpc.StatusCode.UNAVAILABLE
    assert await rpc_status(plain.generate(request, timeout=5).read()) == unavailable
    plain.close()
    assert_no_locks(agent)
