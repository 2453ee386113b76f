"""Generate over an agent's token stream (``--stream-port``): the conductor prefers it
when the agent offers one, and it behaves as the gRPC call does — the same answers, the
same errors, cancellation that aborts the fused transaction, deadlines, mTLS and the
role check. The same for the calls a conductor makes of every agent all the time
(``GetInfo``, ``Snapshot``, ``WatchEvents``), with a fall back to gRPC where the listener
is gone or the agent does not list them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from pathlib import Path
from typing import Any

import grpc
import pytest

from conductor.adapters.agents import AgentFleet
from conductor.adapters.shadow import ShadowSync
from conductor.adapters.token_stream import StreamCall, TokenStreamClient
from conductor.core.prefix_index import NodeId, PrefixIndex
from kvc.block_keys import KEY_LAYOUT, compute_block_keys
from kvc.stream_frames import (
    CALL,
    ERROR,
    GENERATE,
    KEEPALIVE_IDLE_S,
    MESSAGE,
    FrameReader,
    call_frame,
    frame,
    parse_error,
)
from kvc.v1 import node_agent_pb2 as pb
from node_agent.server import AgentServer
from tests.conftest import (
    MODEL,
    AgentFactory,
    ConductorFactory,
    assert_no_locks,
    chat_body,
    rpc_status,
    shadow_of,
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
    tx = pb.TxAllocateRequest(
        key_layout=KEY_LAYOUT, tx_id="c", tenant="t", block_keys=keys, lease_s=30
    )
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
    # GetInfo is open to peer agents; the block table's snapshot and events are not.
    info = await peer.unary("GetInfo", pb.GetInfoRequest(), pb.NodeInfo.FromString, deadline_s=5)
    assert info.node_id == agent.service.node_info.node_id
    snapshot = peer.unary(
        "Snapshot", pb.SnapshotRequest(), pb.SnapshotResponse.FromString, deadline_s=5
    )
    assert await rpc_status(snapshot) == grpc.StatusCode.PERMISSION_DENIED
    watch = peer.stream("WatchEvents", pb.WatchEventsRequest(), pb.EventBatch.FromString)
    assert await rpc_status(watch.read()) == grpc.StatusCode.PERMISSION_DENIED
    peer.close()
    with pytest.raises(ValueError, match="refusing plaintext"):
        TokenStreamClient("10.0.0.1:1", None, "loopback")
    plain = TokenStreamClient(address, None, "loopback")  # no certificate: no handshake
    unavailable = grpc.StatusCode.UNAVAILABLE
    assert await rpc_status(plain.generate(request, timeout=5).read()) == unavailable
    plain.close()
    assert_no_locks(agent)


STREAM_METHODS = ["GetInfo", "Prefill", "Snapshot", "WatchEvents"]


async def commit_blocks(agent: AgentServer, tx_id: str, n_blocks: int) -> list[int]:
    """A committed Tx of ``n_blocks`` fresh blocks (over gRPC); their keys."""
    tokens = [7 + i for i in range(n_blocks * 32)]
    keys = [int(k) for k in compute_block_keys(tokens, tenant="t", model=MODEL, block_size=32)]
    fleet = AgentFleet([agent.address], model=MODEL, rpc_timeout_s=5.0)
    try:
        stub = fleet.handles()[0].stub
        tx = pb.TxAllocateRequest(
            key_layout=KEY_LAYOUT, tx_id=tx_id, tenant="t", block_keys=keys, lease_s=30.0
        )
        await stub.TxAllocate(tx, timeout=5.0)
        await stub.TxCommit(pb.TxCommitRequest(tx_id=tx_id), timeout=5.0)
    finally:
        await fleet.aclose()
    return keys


async def test_info_snapshot_and_events_over_the_stream(start_agent: AgentFactory) -> None:
    agent = await start_agent("both", stream_port=0, capacity_blocks=64)
    assert list(agent.service.node_info.stream_methods) == STREAM_METHODS
    assert agent.token_stream is not None
    client = TokenStreamClient(agent.service.node_info.stream_address, None, "loopback")
    info = await client.unary("GetInfo", pb.GetInfoRequest(), pb.NodeInfo.FromString, deadline_s=5)
    assert info == agent.service.node_info
    snap = await client.unary(
        "Snapshot", pb.SnapshotRequest(), pb.SnapshotResponse.FromString, deadline_s=5
    )
    assert snap.node == info
    assert snap.epoch == info.epoch
    # Both ends keep the line alive (TCP keepalive), as gRPC's channels do: a peer that
    # vanished fails a waiting stream instead of leaving it waiting for ever.
    kept = client._idle[0].transport
    assert kept is not None
    ends = [kept, *(c._transport for c in agent.token_stream._connections)]
    for end in ends:
        assert end is not None
        sock = end.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE_S
    request = pb.WatchEventsRequest(epoch=snap.epoch, from_seq=snap.seq + 1)
    call = client.stream("WatchEvents", request, pb.EventBatch.FromString)
    keys = await commit_blocks(agent, "tx-w", 3)
    stored: list[int] = []
    seqs: list[int] = []
    while stored != keys:
        batch = await asyncio.wait_for(call.read(), 10)
        assert isinstance(batch, pb.EventBatch)
        assert batch.epoch == snap.epoch
        assert not batch.resync_required
        seqs += [ev.seq for ev in batch.events]
        stored += [k for ev in batch.events if ev.HasField("stored") for k in ev.stored.block_keys]
    assert seqs == list(range(snap.seq + 1, snap.seq + 1 + len(seqs)))  # none lost, in order
    assert agent.token_stream.calls == 1  # the watch, waiting for the next batch
    call.cancel()
    with pytest.raises(asyncio.CancelledError):  # as a cancelled gRPC call's read
        await call.read()
    await wait_until(lambda: agent.token_stream is not None and agent.token_stream.calls == 0)
    client.close()


async def test_a_method_the_stream_lacks_is_unimplemented_and_the_line_stays(
    start_agent: AgentFactory,
) -> None:
    agent = await start_agent("both", stream_port=0)
    host, _, port = agent.service.node_info.stream_address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    frames = FrameReader(1 << 20)

    async def answer() -> list[tuple[int, bytes]]:
        got: list[tuple[int, bytes]] = []
        while not got:
            got = frames.feed(await asyncio.wait_for(reader.read(65536), 10))
        return got

    writer.write(frame(CALL, bytes((99,))))
    [(kind, payload)] = await answer()
    assert kind == ERROR
    code, details, _ = parse_error(payload)
    assert code == grpc.StatusCode.UNIMPLEMENTED.value[0]
    assert "99" in details
    writer.write(call_frame("GetInfo", b""))  # the same connection serves the next call
    got = await answer()
    while len(got) < 2:
        got += await answer()
    assert got[0][0] == MESSAGE
    assert pb.NodeInfo.FromString(got[0][1]).node_id == agent.service.node_info.node_id
    writer.write(frame(GENERATE, b"\xff\xff"))  # a request that does not parse
    [(kind, payload)] = await answer()
    assert kind == ERROR
    assert parse_error(payload)[0] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    writer.close()
    await writer.wait_closed()


async def test_a_conductor_follows_over_the_stream_and_falls_back_to_grpc(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both", stream_port=0, capacity_blocks=64)
    server = agent.token_stream
    assert server is not None
    async with conductor([agent]) as c:
        state = c.app.state.conductor
        handle = state.fleet.handles()[0]
        await state.fleet.refresh_one(handle)  # the first poll (gRPC) named the methods
        assert handle.stream_for("GetInfo") is handle.stream is not None
        await wait_until(lambda: server.calls == 1)  # the shadow's watch, over the stream
        r = await c.client.post("/v1/chat/completions", json=chat_body("Follow me " * 20))
        assert r.status_code == 200, r.text
        node = NodeId(agent.address)
        keys = await commit_blocks(agent, "tx-f", 2)
        await wait_until(lambda: state.index.match(keys).get(node) == len(keys))
        metrics = (await c.client.get("/metrics")).text
        assert 'conductor_agent_calls_total{code="OK",method="GetInfo"}' in metrics
        assert 'conductor_agent_calls_total{code="OK",method="Snapshot"}' in metrics
        # The listener goes (the agent's gRPC port stays): polls and shadow sessions ask
        # over gRPC.
        await server.stop(grace_s=0)
        await state.fleet.refresh_one(handle)
        assert handle.usable, handle.last_error
        index = PrefixIndex()
        stop = asyncio.Event()
        session = asyncio.create_task(ShadowSync(state.fleet, index)._sync_once(handle, node, stop))
        await wait_until(lambda: index.position(node) is not None)
        assert not session.done()  # following, over gRPC
        stop.set()
        await asyncio.wait_for(session, 5.0)
    assert_no_locks(agent)


async def test_a_disaggregated_prefill_runs_over_the_stream(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    prefill = await start_agent("prefill", stream_port=0)
    decode = await start_agent("decode", stream_port=0)
    servers = [a.token_stream for a in (prefill, decode)]
    async with conductor([prefill, decode]) as c:
        await wait_until(lambda: all(s is not None and s.calls == 1 for s in servers))  # watches
        r = await c.client.post("/v1/chat/completions", json=chat_body("Split me " * 30))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        # The prefill node's stream served one more call than its watch: the Prefill
        # (its connection kept for the next); the decode node's, the Generate.
        assert [s.connections for s in servers if s is not None] == [2, 2]
        metrics = (await c.client.get("/metrics")).text
        assert 'conductor_agent_calls_total{code="OK",method="Prefill"} 1.0' in metrics
    assert_no_locks(prefill)
    assert_no_locks(decode)


async def test_agents_that_list_no_methods_are_followed_over_grpc(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    """An agent from before ``stream_methods``: Generate over its stream, the rest gRPC."""
    agent = await start_agent("both", stream_port=0)
    del agent.service.node_info.stream_methods[:]
    server = agent.token_stream
    assert server is not None
    async with conductor([agent]) as c:
        handle = c.app.state.conductor.fleet.handles()[0]
        assert handle.stream is not None
        assert handle.stream_for("GetInfo") is None
        r = await c.client.post("/v1/chat/completions", json=chat_body(stream=True))
        assert r.status_code == 200, r.text
        assert streamed_text(r.text)
        await wait_until(lambda: c.app.state.conductor.index.position(NodeId(agent.address)))
        assert server.calls == 0  # no watch there
        assert server.connections >= 1  # the Generate's, kept for the next one
    assert_no_locks(agent)


async def test_the_deadline_holds_while_connecting() -> None:
    """A listener that never completes the handshake (its accept queue full, as a host
    that drops packets) would keep a connect waiting for minutes: the call's deadline
    ends it as gRPC's does."""
    listener = socket.socket()
    held: list[socket.socket] = []
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        for _ in range(4):  # fill the accept queue: later handshakes go unanswered
            peer = socket.socket()
            peer.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                peer.connect(("127.0.0.1", port))
            held.append(peer)
        client = TokenStreamClient(f"127.0.0.1:{port}", None, "loopback")
        started = asyncio.get_running_loop().time()
        call = client.unary("GetInfo", pb.GetInfoRequest(), pb.NodeInfo.FromString, deadline_s=0.3)
        code = await asyncio.wait_for(rpc_status(call), 10)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert asyncio.get_running_loop().time() - started < 5
        client.close()
    finally:
        for peer in held:
            peer.close()
        listener.close()


async def test_a_session_begun_over_grpc_moves_to_the_stream(start_agent: AgentFactory) -> None:
    """A shadow session that began before the agent's info named its stream (the agent
    was not up at the conductor's first poll) runs over gRPC; once the info says so, it
    ends after its next batch (an idle agent sends none: it stays until one comes) and
    the next session follows over the stream."""
    agent = await start_agent("both", stream_port=0)
    server = agent.token_stream
    assert server is not None
    async with shadow_of(agent) as follow:
        session = follow.start()
        await wait_until(lambda: follow.index.position(follow.node) is not None)
        assert server.calls == 0  # no info yet: over gRPC
        assert not session.done()
        await follow.fleet.refresh_one(follow.handle)  # the info names the stream now
        await commit_blocks(agent, "tx-m", 1)  # a batch of events
        await asyncio.wait_for(session, 5.0)  # ended cleanly after it
        assert session.exception() is None
        session = follow.start()
        await wait_until(lambda: server.calls == 1)  # the next one: over the stream
        follow.stop.set()
        await asyncio.wait_for(session, 5.0)


async def test_a_session_fallen_back_to_grpc_returns_to_the_stream(
    start_agent: AgentFactory,
) -> None:
    """A session that fell back to gRPC because the listener was gone stays there while
    the listener is away, and ends after its next batch once a call over the stream is
    answered again (the GetInfo poll): the next session follows over the stream."""
    agent = await start_agent("both", stream_port=0)
    server = agent.token_stream
    assert server is not None
    async with shadow_of(agent) as follow:
        await follow.fleet.refresh_one(follow.handle)  # the info names the stream
        address = follow.handle.info.stream_address if follow.handle.info else ""
        host, _, port = address.rpartition(":")
        answered = follow.handle.stream_answered_s  # that GetInfo: over the stream
        await server.stop(grace_s=0)
        session = follow.start()
        await wait_until(lambda: follow.index.position(follow.node) is not None)
        assert server.calls == 0  # the snapshot fell back, and the watch is over gRPC
        assert follow.handle.stream_answered_s == answered
        await commit_blocks(agent, "tx-b1", 1)  # a batch while the listener is away
        await wait_until(lambda: follow.index.stats().keys == 1 or session.done())
        assert not session.done(), "no answer over the stream yet: it stays on gRPC"
        await server.start(host.strip("[]"), int(port), None)  # the listener is back
        await follow.fleet.refresh_one(follow.handle)  # answered over the stream
        assert follow.handle.stream_answered_s > answered
        await commit_blocks(agent, "tx-b2", 2)  # one more block: a batch
        await asyncio.wait_for(session, 5.0)  # ended cleanly after that batch
        assert session.exception() is None
        session = follow.start()
        await wait_until(lambda: server.calls == 1)  # its watch runs over the stream
        follow.stop.set()
        await asyncio.wait_for(session, 5.0)
    assert_no_locks(agent)
