"""The conductor's shadow of one real agent: a session follows the agent's event stream
into the prefix index, and setting the stop event ends it at once — by cancelling the
stream's call, which ends the pending read (no task per batch races it)."""

from __future__ import annotations

import asyncio

from conductor.adapters.agents import AgentFleet
from conductor.adapters.shadow import ShadowSync
from conductor.core.prefix_index import NodeId, PrefixIndex
from kvc.block_keys import compute_block_keys
from kvc.v1 import node_agent_pb2 as pb
from tests.conftest import MODEL, AgentFactory, wait_until


async def test_a_session_follows_new_blocks_and_ends_when_stopped(
    start_agent: AgentFactory,
) -> None:
    agent = await start_agent("both", capacity_blocks=64)
    fleet = AgentFleet([agent.address], model=MODEL, rpc_timeout_s=5.0)
    try:
        handle = fleet.handles()[0]
        node = NodeId(handle.address)
        index = PrefixIndex()
        stop = asyncio.Event()
        session = asyncio.create_task(ShadowSync(fleet, index)._sync_once(handle, node, stop))
        await wait_until(lambda: index.position(node) is not None)
        keys = list(compute_block_keys(list(range(3 * 32)), tenant="t", model=MODEL, block_size=32))
        request = pb.TxAllocateRequest(tx_id="tx-s", tenant="t", block_keys=keys, lease_s=30.0)
        await handle.stub.TxAllocate(request, timeout=5.0)
        await handle.stub.TxCommit(pb.TxCommitRequest(tx_id="tx-s"), timeout=5.0)
        await wait_until(lambda: index.match(keys).get(node) == len(keys))
        assert not session.done()  # waiting on the stream for the next batch
        stop.set()
        await asyncio.wait_for(session, 5.0)  # ended: neither cancelled nor failed
        assert not session.cancelled()
        assert session.exception() is None
    finally:
        await fleet.aclose()
