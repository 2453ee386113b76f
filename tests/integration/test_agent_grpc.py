"""The node agent's gRPC contract, exercised over a real channel on loopback."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvc.block_keys import KEY_LAYOUT, compute_block_keys
from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from kvc.wire import ERROR_INFO_KEY, SERVICE_NAME
from node_agent.server import AgentServer
from tests.conftest import MODEL, AgentFactory, assert_no_locks, wait_until


def keys_for(n_blocks: int, tenant: str = "t", offset: int = 0) -> list[int]:
    tokens = [(offset + i) % 2000 for i in range(n_blocks * 32)]
    return list(compute_block_keys(tokens, tenant=tenant, model=MODEL, block_size=32))


def alloc(tx_id: str, keys: list[int], lease_s: float = 30.0) -> pb.TxAllocateRequest:
    return pb.TxAllocateRequest(
        key_layout=KEY_LAYOUT, tx_id=tx_id, tenant="t", block_keys=keys, lease_s=lease_s
    )


async def test_info_and_health(agent: AgentServer, stub: pb_grpc.NodeAgentAsyncStub) -> None:
    from grpc_health.v1 import health_pb2

    info = await stub.GetInfo(pb.GetInfoRequest())
    assert info.model == MODEL
    assert info.role == pb.NODE_ROLE_BOTH
    assert info.block_size == 32
    assert info.capacity_blocks == 64
    assert info.kv_layout.bytes_per_token > 0
    assert info.epoch == agent.service.epoch
    async with grpc.aio.insecure_channel(agent.address) as channel:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        for service in ("", "kvc.v1.NodeAgent"):
            resp = await check(health_pb2.HealthCheckRequest(service=service))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_draining_agent_is_not_ready_but_alive(
    agent: AgentServer, stub: pb_grpc.NodeAgentAsyncStub
) -> None:
    """What the chart's probes rely on: readiness asks ``kvc.v1.NodeAgent`` (NOT_SERVING
    while draining), liveness asks ``""`` (SERVING until the process stops)."""
    from grpc_health.v1 import health_pb2

    serving = health_pb2.HealthCheckResponse.SERVING
    async with grpc.aio.insecure_channel(agent.address) as channel:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )

        async def status(service: str) -> int:
            resp = await check(health_pb2.HealthCheckRequest(service=service))
            return int(resp.status)

        await stub.Drain(pb.DrainRequest())
        assert await status(SERVICE_NAME) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await status("") == serving
        await stub.Drain(pb.DrainRequest(resume=True))
        assert await status(SERVICE_NAME) == serving


async def test_tx_lifecycle_and_idempotency(
    agent: AgentServer, stub: pb_grpc.NodeAgentAsyncStub
) -> None:
    keys = keys_for(4)
    first = await stub.TxAllocate(alloc("tx-1", keys))
    again = await stub.TxAllocate(alloc("tx-1", keys))
    assert list(first.handles) == list(again.handles)
    assert first.new_blocks == 4
    assert first.reused_blocks == 0
    assert agent.service.pool.stats().locked_blocks == 4
    commit = await stub.TxCommit(pb.TxCommitRequest(tx_id="tx-1"))
    assert commit.stored_blocks == 4
    assert (await stub.TxCommit(pb.TxCommitRequest(tx_id="tx-1"))).stored_blocks == 4
    reuse = await stub.TxAllocate(alloc("tx-2", [*keys, *keys_for(1, offset=7)]))
    assert reuse.reused_blocks == 4
    assert reuse.new_blocks == 1
    aborted = await stub.TxAbort(pb.TxAbortRequest(tx_id="tx-2"))
    assert aborted.freed_blocks == 1
    assert_no_locks(agent)
    assert agent.service.pool.stats().cached_blocks == 4


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (
            pb.TxAllocateRequest(
                key_layout=KEY_LAYOUT, tx_id="", tenant="t", block_keys=[1], lease_s=5
            ),
            "INVALID_ARGUMENT",
        ),
        (
            pb.TxAllocateRequest(
                key_layout=KEY_LAYOUT, tx_id="x", tenant="t", block_keys=[], lease_s=5
            ),
            "INVALID_ARGUMENT",
        ),
        (
            pb.TxAllocateRequest(
                key_layout=KEY_LAYOUT, tx_id="x", tenant="t", block_keys=[1], lease_s=0
            ),
            "INVALID_ARGUMENT",
        ),
        (
            pb.TxAllocateRequest(
                key_layout=KEY_LAYOUT, tx_id="x", tenant="t", block_keys=[1], lease_s=1e9
            ),
            "INVALID_ARGUMENT",
        ),
        (
            pb.TxAllocateRequest(
                key_layout=KEY_LAYOUT, tx_id="x", tenant="t", block_keys=[1, 1], lease_s=5
            ),
            "INVALID_ARGUMENT",
        ),
    ],
)
async def test_allocate_rejects_malformed_input(
    agent: AgentServer,
    stub: pb_grpc.NodeAgentAsyncStub,
    request_: pb.TxAllocateRequest,
    code: str,
) -> None:
    before = agent.service.pool.stats()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.TxAllocate(request_)
    assert info.value.code().name == code
    assert agent.service.pool.stats() == before


async def test_unknown_tx_is_not_found(stub: pb_grpc.NodeAgentAsyncStub) -> None:
    for call in (
        stub.TxCommit(pb.TxCommitRequest(tx_id="nope")),
        stub.TxAbort(pb.TxAbortRequest(tx_id="nope")),
        stub.TxExtend(pb.TxExtendRequest(tx_id="nope", lease_s=5.0)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_capacity_exhausted_reports_counts_and_changes_nothing(
    agent: AgentServer, stub: pb_grpc.NodeAgentAsyncStub
) -> None:
    before = agent.service.pool.stats()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.TxAllocate(alloc("big", keys_for(65)))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = dict(info.value.trailing_metadata() or ())
    err = pb.ErrorInfo.FromString(details[ERROR_INFO_KEY])
    assert (err.needed_blocks, err.free_blocks) == (65, 64)
    assert agent.service.pool.stats() == before


async def test_structured_output_is_refused_by_the_embedded_engine(
    agent: AgentServer, stub: pb_grpc.NodeAgentAsyncStub
) -> None:
    """A conductor that did not check the node's engine still gets a refusal it maps to
    422, never JSON-mode text that is not JSON."""
    sampling = pb.SamplingParams(max_tokens=4, response_format='{"type":"json_object"}')
    request = pb.GenerateRequest(
        request_id="j", tenant="t", prompt_token_ids=[1, 2, 3], sampling=sampling
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Generate(request).read()
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    details = dict(info.value.trailing_metadata() or ())
    assert pb.ErrorInfo.FromString(details[ERROR_INFO_KEY]).reason == "unsupported"
    assert "structured output" in (info.value.details() or "")
    assert_no_locks(agent)


async def test_lease_expiry_aborts_by_itself(
    agent: AgentServer, stub: pb_grpc.NodeAgentAsyncStub
) -> None:
    await stub.TxAllocate(alloc("short", keys_for(3), lease_s=0.2))
    assert agent.service.pool.stats().locked_blocks == 3
    async with asyncio.timeout(10):
        # Poll with a deadline: the agent's own housekeeping loop must expire it.
        while agent.service.pool.stats().open_txs:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    assert_no_locks(agent)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.TxCommit(pb.TxCommitRequest(tx_id="short"))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_a_renewed_lease_outlives_the_first(
    agent: AgentServer, stub: pb_grpc.NodeAgentAsyncStub
) -> None:
    """``TxExtend`` (a conductor after a slow prefix pull): the tx stays open past its
    first lease and commits; a lease beyond the agent's maximum is refused; an expired
    tx cannot be renewed."""
    # A witness with the same first lease: once it has expired, so would have "renewed".
    await stub.TxAllocate(alloc("renewed", keys_for(3), lease_s=0.3))
    await stub.TxAllocate(alloc("witness", keys_for(2, offset=20), lease_s=0.3))
    renewed = await stub.TxExtend(pb.TxExtendRequest(tx_id="renewed", lease_s=30.0))
    assert 29.0 < renewed.lease_remaining_s <= 30.0
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.TxExtend(pb.TxExtendRequest(tx_id="renewed", lease_s=1e9))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await wait_until(lambda: agent.service.pool.stats().open_txs == 1)  # witness expired
    committed = await stub.TxCommit(pb.TxCommitRequest(tx_id="renewed"))
    assert committed.stored_blocks == 3
    await stub.TxAllocate(alloc("lapsed", keys_for(2, offset=10), lease_s=0.2))
    await wait_until(lambda: agent.service.pool.stats().open_txs == 0)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.TxExtend(pb.TxExtendRequest(tx_id="lapsed", lease_s=30.0))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert_no_locks(agent)


async def test_snapshot_and_event_stream(
    agent: AgentServer, stub: pb_grpc.NodeAgentAsyncStub
) -> None:
    snap = await stub.Snapshot(pb.SnapshotRequest())
    assert snap.epoch == agent.service.epoch
    assert list(snap.cached_keys) == []
    keys = keys_for(2)
    await stub.TxAllocate(alloc("tx-e", keys))
    await stub.TxCommit(pb.TxCommitRequest(tx_id="tx-e"))
    watch = stub.WatchEvents(pb.WatchEventsRequest(epoch=snap.epoch, from_seq=snap.seq + 1))
    stored: list[int] = []
    seqs: list[int] = []
    async with asyncio.timeout(10):
        async for batch in watch:
            assert not batch.resync_required
            for ev in batch.events:
                seqs.append(ev.seq)
                if ev.WhichOneof("kind") == "stored":
                    stored.extend(ev.stored.block_keys)
            if stored:
                break
    watch.cancel()
    assert stored == keys
    assert seqs == sorted(seqs)
    assert seqs[0] == snap.seq + 1
    snap2 = await stub.Snapshot(pb.SnapshotRequest())
    assert sorted(snap2.cached_keys) == sorted(keys)


async def test_waiting_streams_wake_on_new_events_and_one_leaving_spares_the_rest(
    agent: AgentServer, stub: pb_grpc.NodeAgentAsyncStub
) -> None:
    snap = await stub.Snapshot(pb.SnapshotRequest())
    request = pb.WatchEventsRequest(epoch=snap.epoch, from_seq=snap.seq + 1)
    leaving, staying = stub.WatchEvents(request), stub.WatchEvents(request)
    # Both caught up and waiting on the agent before anything is published.
    await wait_until(lambda: len(agent.service.events._waiters) == 2)
    leaving.cancel()
    await wait_until(lambda: len(agent.service.events._waiters) == 1)
    keys = keys_for(3, offset=7)
    await stub.TxAllocate(alloc("tx-w", keys))
    await stub.TxCommit(pb.TxCommitRequest(tx_id="tx-w"))
    stored: list[int] = []
    async with asyncio.timeout(10):
        async for batch in staying:
            stored.extend(k for ev in batch.events for k in ev.stored.block_keys)
            if stored:
                break
    staying.cancel()
    assert stored == keys


async def test_watch_with_another_epoch_must_resync(stub: pb_grpc.NodeAgentAsyncStub) -> None:
    batches = [b async for b in stub.WatchEvents(pb.WatchEventsRequest(epoch="old", from_seq=1))]
    assert len(batches) == 1
    assert batches[0].resync_required


async def test_fetch_unknown_staged_kv_is_not_found(stub: pb_grpc.NodeAgentAsyncStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.FetchKv(pb.FetchKvRequest(request_id="never", stage_handle="nope")):
            pass
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as info:  # the client's id names nothing
        async for _ in stub.FetchKv(pb.FetchKvRequest(request_id="never")):
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_prefill_checks_keys_against_the_prompt(
    start_agent: AgentFactory,
) -> None:
    prefill = await start_agent("prefill")
    async with grpc.aio.insecure_channel(prefill.address) as channel:
        stub = pb_grpc.NodeAgentStub(channel)
        prompt = list(range(10, 10 + 70))
        keys = compute_block_keys(prompt[:-1], tenant="t", model=MODEL, block_size=32)
        await stub.TxAllocate(alloc("p1", list(keys)))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Prefill(
                pb.PrefillRequest(
                    request_id="r1", tenant="other-tenant", tx_id="p1", prompt_token_ids=prompt
                )
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        resp = await stub.Prefill(
            pb.PrefillRequest(request_id="r1", tenant="t", tx_id="p1", prompt_token_ids=prompt)
        )
        assert resp.computed_tokens == 69
        chunks = [
            c
            async for c in stub.FetchKv(
                pb.FetchKvRequest(request_id="r1", stage_handle=resp.stage_handle, tenant="t")
            )
        ]
        total = sum(len(c.data) for c in chunks)
        assert total == chunks[0].total_bytes == 69 * prefill.engine.info.kv_layout.bytes_per_token
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Generate(pb.GenerateRequest(request_id="g", prompt_token_ids=[1, 2])).read()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # wrong role
        await stub.TxAbort(pb.TxAbortRequest(tx_id="p1"))
    assert_no_locks(prefill)


async def test_racing_allocations_never_double_allocate(
    agent: AgentServer, stub: pb_grpc.NodeAgentAsyncStub
) -> None:
    """Many clients race TxAllocate for overlapping prefixes; nothing deadlocks or leaks."""
    shared = keys_for(4, offset=100)
    refused: list[grpc.StatusCode] = []

    async def client(i: int) -> None:
        own = keys_for(2, offset=1000 + 64 * i)
        try:
            await stub.TxAllocate(alloc(f"race-{i}", [*shared, *own]))
        except grpc.aio.AioRpcError as exc:
            refused.append(exc.code())
            return
        if i % 2:
            await stub.TxCommit(pb.TxCommitRequest(tx_id=f"race-{i}"))
        else:
            await stub.TxAbort(pb.TxAbortRequest(tx_id=f"race-{i}"))

    async with asyncio.timeout(30):
        await asyncio.gather(*(client(i) for i in range(40)))
    assert set(refused) <= {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert_no_locks(agent)
    pool = agent.service.pool
    cached = pool.cached_keys()
    assert len(cached) == len(set(cached))
    assert set(shared) <= set(cached)


async def test_kvc_probe_reports_agent_health(agent: AgentServer) -> None:
    from kvc_cli.probe import probe

    assert await asyncio.to_thread(probe, f"grpc://{agent.address}")
    await agent.stop(grace_s=0.1)
    assert not await asyncio.to_thread(probe, f"grpc://{agent.address}", 1.0)


async def test_a_prompt_whose_kv_never_fits_the_staging_area_is_rejected_not_busy(
    start_agent: AgentFactory,
) -> None:
    """A busy answer tells the conductor to retry; a prompt larger than the whole staging
    area would be retried for ever, so it is refused as such, before any compute."""
    per_token = 2048  # tiny-llama's KV per token
    prefill = await start_agent("prefill", max_staged_bytes=40 * per_token)
    async with grpc.aio.insecure_channel(prefill.address) as channel:
        stub = pb_grpc.NodeAgentStub(channel)
        prompt = list(range(10, 10 + 70))  # 69 tokens of KV: more than the 40 that fit
        keys = compute_block_keys(prompt[:-1], tenant="t", model=MODEL, block_size=32)
        await stub.TxAllocate(alloc("p1", list(keys)))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Prefill(
                pb.PrefillRequest(request_id="r1", tenant="t", tx_id="p1", prompt_token_ids=prompt)
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_staged_bytes" in (info.value.details() or "")
        await stub.TxAbort(pb.TxAbortRequest(tx_id="p1"))
    assert_no_locks(prefill)
    # By default the area holds the longest prompt the node can prefill (the 512 MiB floor).
    default = await start_agent("prefill")
    assert default.service.staging.max_bytes == 512 * 1024 * 1024
