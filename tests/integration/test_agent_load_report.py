"""What an agent's block counts mean on the wire: ``free_blocks`` is strictly free,
``allocatable_blocks`` is free plus evictable (a warm cache full of unlocked cached
blocks can still take any request); ``NodeInfo.max_running_requests`` is its slot count."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest

from kvc.block_keys import KEY_LAYOUT, BlockKey, compute_block_keys
from kvc.models import DEFAULT_MODEL_DIR
from kvc.tokenization import ChatTokenizer
from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from node_agent.engines.base import CacheStored
from node_agent.engines.vllm.adapter import VllmEngineAdapter
from node_agent.engines.vllm.config import VllmConfig
from node_agent.main import start_engine
from node_agent.server import AgentServer
from node_agent.settings import AgentSettings
from tests.conftest import MODEL, AgentFactory, wait_until

CAPACITY = 16


def keys_for(n_blocks: int, offset: int) -> list[int]:
    tokens = [(offset + i) % 2000 for i in range(n_blocks * 32)]
    return list(compute_block_keys(tokens, tenant="t", model=MODEL, block_size=32))


@pytest.fixture
async def agent(start_agent: AgentFactory) -> AgentServer:
    return await start_agent("decode", capacity_blocks=CAPACITY, max_running=5)


@pytest.fixture
async def stub(agent: AgentServer) -> AsyncIterator[pb_grpc.NodeAgentAsyncStub]:
    async with grpc.aio.insecure_channel(agent.address) as channel:
        yield pb_grpc.NodeAgentStub(channel)


async def _fill_with_cached_blocks(stub: pb_grpc.NodeAgentAsyncStub) -> None:
    """Commit CAPACITY blocks: the pool is full, every block cached and unlocked."""
    for i in range(CAPACITY // 4):
        tx = f"fill-{i}"
        await stub.TxAllocate(
            pb.TxAllocateRequest(
                key_layout=KEY_LAYOUT,
                tx_id=tx,
                tenant="t",
                block_keys=keys_for(4, offset=97 * i),
                lease_s=30,
            )
        )
        await stub.TxCommit(pb.TxCommitRequest(tx_id=tx))


async def _streamed_load(
    stub: pb_grpc.NodeAgentAsyncStub, free: int, allocatable: int
) -> pb.LoadUpdate:
    """The first LoadUpdate on WatchEvents with these counts (the stream is replayed)."""
    call = stub.WatchEvents(pb.WatchEventsRequest(from_seq=1), timeout=10.0)
    try:
        async for batch in call:
            for event in batch.events:
                load = event.load
                if event.HasField("load") and (
                    (load.free_blocks, load.allocatable_blocks) == (free, allocatable)
                ):
                    return load
    finally:
        call.cancel()
    raise AssertionError("the event stream ended")


async def test_a_warm_pool_reports_its_evictable_blocks_as_allocatable(
    agent: AgentServer, stub: pb_grpc.NodeAgentAsyncStub
) -> None:
    info = await stub.GetInfo(pb.GetInfoRequest())
    assert info.max_running_requests == 5
    idle = (await stub.Snapshot(pb.SnapshotRequest())).load
    assert (idle.free_blocks, idle.allocatable_blocks) == (CAPACITY, CAPACITY)

    await _fill_with_cached_blocks(stub)
    snap = await stub.Snapshot(pb.SnapshotRequest())
    assert len(snap.cached_keys) == CAPACITY
    assert snap.load.free_blocks == 0
    assert snap.load.allocatable_blocks == CAPACITY
    streamed = await _streamed_load(stub, free=0, allocatable=CAPACITY)
    assert streamed.kv_usage_ratio == 1.0

    # An allocation on the full pool evicts; its answer counts what the next could get.
    new = keys_for(2, offset=77_000)
    reply = await stub.TxAllocate(
        pb.TxAllocateRequest(
            key_layout=KEY_LAYOUT, tx_id="fresh", tenant="t", block_keys=new, lease_s=30
        )
    )
    assert reply.new_blocks == 2
    assert reply.free_blocks == 0
    assert reply.allocatable_blocks == CAPACITY - 2  # its own two are locked
    await stub.TxCommit(pb.TxCommitRequest(tx_id="fresh"))
    assert (await stub.Snapshot(pb.SnapshotRequest())).load.allocatable_blocks == CAPACITY

    # Locked blocks are neither free nor allocatable.
    locked = await stub.TxAllocate(
        pb.TxAllocateRequest(
            key_layout=KEY_LAYOUT, tx_id="lock", tenant="t", block_keys=new, lease_s=30
        )
    )
    assert locked.reused_blocks == 2
    assert locked.allocatable_blocks == CAPACITY - 2
    await stub.TxAbort(pb.TxAbortRequest(tx_id="lock"))


METRICS = """\
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",enable_prefix_caching="True",num_gpu_blocks="17"} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.25
"""


def _stand_in_vllm(request: httpx.Request) -> httpx.Response:
    path = request.url.path
    if path == "/health":
        return httpx.Response(200)
    if path == "/v1/models":
        return httpx.Response(200, json={"data": [{"id": MODEL, "max_model_len": 2048}]})
    if path == "/metrics":
        return httpx.Response(200, text=METRICS)
    return httpx.Response(500, text=json.dumps({"error": {"message": "not here"}}))


async def test_a_vllm_mirror_is_bounded_by_vllms_own_kv_usage() -> None:
    """The mirror knows vLLM's cached blocks, not those its running requests hold:
    vLLM's KV usage (which counts its evictable blocks as free) bounds the count."""
    settings = AgentSettings(
        port=0, engine="vllm", vllm_url="http://vllm", load_interval_s=0.05, calibrate=False
    )
    engine = VllmEngineAdapter(
        VllmConfig.from_settings(settings),
        ChatTokenizer.from_dir(DEFAULT_MODEL_DIR),
        transport=httpx.MockTransport(_stand_in_vllm),
    )
    settings = await start_engine(engine, settings)
    assert settings.capacity_blocks == CAPACITY
    server = AgentServer(settings, engine)
    await server.start()
    try:
        service = server.service
        await service.events.apply_engine_cache_events(
            [CacheStored(tuple(BlockKey(k) for k in keys_for(CAPACITY, offset=5)), None)]
        )
        await wait_until(lambda: engine.load().kv_usage_ratio == 0.25)  # polled
        load = service.load_update()
        assert load.free_blocks == 0
        assert load.allocatable_blocks == CAPACITY * 3 // 4  # vLLM: 25% in use
    finally:
        await server.stop(grace_s=0.5)
