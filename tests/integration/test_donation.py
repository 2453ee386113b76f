"""Donate before evict live: an agent with ``donate_before_evict`` that drops a hot block
no other node holds sends it to a peer that holds the block's parent and has a colder
victim (``DonateBlock``); conductors tell it which blocks are held elsewhere and who its
peers are (``ReplicaHints`` with donees). The rule the simulator evaluates
(``ClusterConfig.donate_before_evict``), over the wire."""

from __future__ import annotations

import zlib

import grpc
import pytest

from conductor.core.prefix_index import NodeId
from kvc.block_keys import BlockKey
from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from node_agent.server import AgentServer
from node_agent.transfer.transport import layout_to_pb
from tests.conftest import AgentFactory, ConductorFactory, assert_no_locks, wait_until
from tests.integration.test_block_migration import BS, alloc, cache_prompt, cached_state, keys_of

ROOT = [*range(300, 300 + BS)]
PROMPT = [*ROOT, *range(700, 700 + BS), 5]  # two blocks: ROOT's, then one only A holds
B_WARM = [*ROOT, 7]  # B holds ROOT's block, the parent of A's second one
BLOCK_BYTES = BS * 2048  # tiny-llama: 2 KiB of KV per token


def donations(agent: AgentServer, direction: str, outcome: str) -> float:
    labels = {"direction": direction, "outcome": outcome}
    value = agent.service.metrics.registry.get_sample_value("node_agent_kv_donations_total", labels)
    return value or 0.0


async def test_a_last_copy_goes_to_the_peer_holding_its_parent_and_is_reused_there(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    a = await start_agent("both", capacity_blocks=4, donate_before_evict=True)
    b = await start_agent("both", capacity_blocks=16, donate_before_evict=True)
    assert a.service.node_info.donate_before_evict
    root, child = (BlockKey(k) for k in keys_of(PROMPT))
    a_channel = grpc.aio.insecure_channel(a.address)
    b_channel = grpc.aio.insecure_channel(b.address)
    a_stub, b_stub = pb_grpc.NodeAgentStub(a_channel), pb_grpc.NodeAgentStub(b_channel)
    try:
        await cache_prompt(b_stub, B_WARM, "b-warm")
        await cache_prompt(a_stub, PROMPT, "a-1")
        await cache_prompt(a_stub, PROMPT, "a-2")  # a hit: both blocks are hot on A
        content = cached_state(a)[child]
        assert content is not None
        sent = content.to_bytes()  # type: ignore[attr-defined]
        async with conductor([a, b], replica_hints_interval_s=0.05) as c:
            hints = a.service.replica_hints
            await wait_until(lambda: hints.count(root) == 1 and b.address in hints.donees)
            assert hints.count(child) == 0  # the last copy
            assert hints.donees[b.address] == 0.0  # B has free blocks
            # Other prompts push both of PROMPT's blocks out of A's 4-block pool.
            for n in range(2):
                filler = [*range(1000 + 100 * n, 1000 + 100 * n + 2 * BS), 5]
                await cache_prompt(a_stub, filler, f"f{n}")
            assert not {root, child} & set(a.service.pool.cached_keys())
            await wait_until(lambda: child in b.service.pool.cached_keys())
            got = cached_state(b)[child]
            assert got.to_bytes() == sent  # type: ignore[union-attr]
            assert donations(a, "given", "accepted") == 1  # the child; ROOT is held on B
            assert donations(b, "taken", "accepted") == 1
            # The shadow follows B's BlockStored: B holds the whole prefix now.
            await wait_until(lambda: c.state.index.match([root, child]).get(NodeId(b.address)) == 2)
        reuse = await b_stub.TxAllocate(alloc("b-reuse", keys_of(PROMPT)))
        assert reuse.reused_blocks == 2
        await b_stub.TxAbort(pb.TxAbortRequest(tx_id="b-reuse"))
        load = b.service.load_update()
        assert load.eviction_tail_used_unix_s == 0.0  # still a free block
    finally:
        await a_channel.close()
        await b_channel.close()
    assert_no_locks(a, b)


async def test_donate_block_checks_what_it_is_given_and_off_nodes_refuse(
    start_agent: AgentFactory,
) -> None:
    b = await start_agent("both", capacity_blocks=2, donate_before_evict=True)
    off = await start_agent("both")
    layout = b.service.state.engine.info.kv_layout
    data = bytes(BS * layout.bytes_per_token)
    root, child = keys_of(PROMPT)

    def request(**fields: object) -> pb.DonateBlockRequest:
        msg = pb.DonateBlockRequest(
            key=root, tenant="t", idle_s=1.0, hops=1, layout=layout_to_pb(layout),
            num_tokens=BS, data=data, crc32=zlib.crc32(data),
        )  # fmt: skip
        for name, value in fields.items():
            setattr(msg, name, value)
        return msg

    async with grpc.aio.insecure_channel(b.address) as channel:
        stub = pb_grpc.NodeAgentStub(channel)
        bad_crc = await stub.DonateBlock(request(crc32=1))
        assert not bad_crc.accepted
        assert "checksum" in bad_crc.reason
        for idle_s in (float("nan"), float("inf"), -1.0):
            odd = await stub.DonateBlock(request(idle_s=idle_s))
            assert not odd.accepted
            assert "idle_s" in odd.reason
        short = await stub.DonateBlock(request(num_tokens=BS + 1))
        assert not short.accepted
        orphan = await stub.DonateBlock(request(key=child, has_parent=True, parent_key=root))
        assert not orphan.accepted  # its parent is not here: it could never be reused
        assert (await stub.DonateBlock(request())).accepted
        assert not (await stub.DonateBlock(request())).accepted  # held already
        assert (
            await stub.DonateBlock(request(key=child, has_parent=True, parent_key=root))
        ).accepted
        # Full now, and its victim (idle 0 s) is more recent than a block idle 60 s.
        stale = await stub.DonateBlock(request(key=root + 1, idle_s=60.0))
        assert not stale.accepted
        assert b.service.load_update().eviction_tail_used_unix_s > 0
    assert donations(b, "taken", "accepted") == 2
    assert donations(b, "taken", "refused") == 8
    async with grpc.aio.insecure_channel(off.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await pb_grpc.NodeAgentStub(channel).DonateBlock(request())
        assert "donate_before_evict is off" in (exc.value.details() or "")
    assert_no_locks(b, off)
