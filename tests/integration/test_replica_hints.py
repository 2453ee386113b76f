"""Replica-aware eviction live: conductors push each agent that asks for it
(``replica_aware_eviction``) which of its cached blocks another node also holds
(``ReplicaHints``), and the agent's pool drops those on eviction instead of demoting them,
so its host tier keeps the fleet's last copies — the rule the simulator evaluates
(``ClusterConfig.replica_aware_eviction``), fed over the wire instead of by its own shadow.
"""

from __future__ import annotations

import grpc
import pytest

from conductor.core.prefix_index import NodeId
from kvc.block_keys import BlockKey
from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from node_agent.blocks.types import KvMedium
from node_agent.server import AgentServer
from tests.conftest import AgentFactory, ConductorFactory, assert_no_locks, wait_until
from tests.integration.test_block_migration import BS, cache_prompt, keys_of

SHARED = [*range(300, 300 + 2 * BS), 5]  # 2 blocks both nodes cache
OWN = [*range(600, 600 + 2 * BS), 5]  # 2 blocks only the hinted node caches
BLOCK_BYTES = BS * 2048  # tiny-llama: 2 KiB of KV per token


def _hinted(agent: AgentServer) -> set[int]:
    """Of the test's keys, those the agent was told another node holds."""
    hints = agent.service.replica_hints
    return {k for k in (*keys_of(SHARED), *keys_of(OWN)) if hints.count(BlockKey(k))}


async def test_blocks_held_elsewhere_are_dropped_and_last_copies_demoted(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    a = await start_agent(
        "both", capacity_blocks=6, host_tier_bytes=16 * BLOCK_BYTES, replica_aware_eviction=True
    )
    b = await start_agent("both", capacity_blocks=16)
    assert a.service.node_info.replica_hints
    assert not b.service.node_info.replica_hints
    a_channel = grpc.aio.insecure_channel(a.address)
    b_channel = grpc.aio.insecure_channel(b.address)
    a_stub, b_stub = pb_grpc.NodeAgentStub(a_channel), pb_grpc.NodeAgentStub(b_channel)
    try:
        await cache_prompt(a_stub, SHARED, "a-shared")
        await cache_prompt(a_stub, OWN, "a-own")
        await cache_prompt(b_stub, SHARED, "b-shared")
        async with conductor([a, b], replica_hints_interval_s=0.05) as c:
            await wait_until(lambda: c.state.index.node_key_count(NodeId(b.address)) >= 2)
            await wait_until(lambda: _hinted(a) == set(keys_of(SHARED)))
            # Other prompts push all four blocks out of A's 6-block pool.
            for n in range(2):
                filler = [*range(1000 + 200 * n, 1000 + 200 * n + 3 * BS), 5]
                await cache_prompt(a_stub, filler, f"a-fill{n}")
            pool = a.service.pool
            cached = {int(k) for k in pool.cached_keys()}
            host = {int(k) for k in pool.tier_keys(KvMedium.HOST)}
            assert not (set(keys_of(SHARED)) | set(keys_of(OWN))) & cached
            assert set(keys_of(OWN)) <= host  # the fleet's last copies: demoted
            assert not set(keys_of(SHARED)) & host  # B has them: dropped
            # A no longer holds them: the next push takes them back.
            await wait_until(lambda: not _hinted(a))
    finally:
        await a_channel.close()
        await b_channel.close()
    assert_no_locks(a, b)


async def test_hints_for_another_epoch_are_not_applied_and_off_nodes_refuse(
    start_agent: AgentFactory,
) -> None:
    a = await start_agent("both", host_tier_bytes=4 * BLOCK_BYTES, replica_aware_eviction=True)
    off = await start_agent("both")
    key = keys_of(SHARED)[0]
    async with grpc.aio.insecure_channel(a.address) as channel:
        stub = pb_grpc.NodeAgentStub(channel)
        epoch = a.service.node_info.epoch
        stale = await stub.ReplicaHints(
            pb.ReplicaHintsRequest(epoch="an-old-epoch", reset=True, replicated=[key])
        )
        assert (stale.applied, stale.epoch, stale.hinted_keys) == (False, epoch, 0)
        ok = await stub.ReplicaHints(
            pb.ReplicaHintsRequest(epoch=epoch, reset=True, replicated=[key, key + 1])
        )
        assert (ok.applied, ok.hinted_keys) == (True, 2)
        change = await stub.ReplicaHints(
            pb.ReplicaHintsRequest(epoch=epoch, unreplicated=[key + 1], replicated=[key + 2])
        )
        assert change.hinted_keys == 2
        assert a.service.replica_hints.count(BlockKey(key + 2)) == 1
        assert a.service.replica_hints.count(BlockKey(key + 1)) == 0
        too_many = a.service.pool.capacity_blocks * 2 + 1
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.ReplicaHints(
                pb.ReplicaHintsRequest(epoch=epoch, reset=True, replicated=range(too_many))
            )
        assert exc.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert len(a.service.replica_hints) == 2  # a refused push changes nothing
    async with grpc.aio.insecure_channel(off.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await pb_grpc.NodeAgentStub(channel).ReplicaHints(
                pb.ReplicaHintsRequest(epoch=off.service.node_info.epoch, replicated=[key])
            )
        assert "donate_before_evict are off" in (exc.value.details() or "")
