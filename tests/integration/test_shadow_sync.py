"""The conductor's shadow of one real agent: a session follows the agent's event stream
into the prefix index, and setting the stop event ends it at once — by cancelling the
stream's call, which ends the pending read (no task per batch races it)."""

from __future__ import annotations

import asyncio

from kvc.block_keys import KEY_LAYOUT, compute_block_keys
from kvc.v1 import node_agent_pb2 as pb
from tests.conftest import MODEL, AgentFactory, shadow_of, wait_until


async def test_a_session_follows_new_blocks_and_ends_when_stopped(
    start_agent: AgentFactory,
) -> None:
    agent = await start_agent("both", capacity_blocks=64)
    async with shadow_of(agent) as follow:
        handle, node, index, stop = follow.handle, follow.node, follow.index, follow.stop
        session = follow.start()
        await wait_until(lambda: index.position(node) is not None)
        keys = list(compute_block_keys(list(range(3 * 32)), tenant="t", model=MODEL, block_size=32))
        request = pb.TxAllocateRequest(
            key_layout=KEY_LAYOUT, tx_id="tx-s", tenant="t", block_keys=keys, lease_s=30.0
        )
        await handle.stub.TxAllocate(request, timeout=5.0)
        await handle.stub.TxCommit(pb.TxCommitRequest(tx_id="tx-s"), timeout=5.0)
        await wait_until(lambda: index.match(keys).get(node) == len(keys))
        assert not session.done()  # waiting on the stream for the next batch
        stop.set()
        await asyncio.wait_for(session, 5.0)  # ended: neither cancelled nor failed
        assert not session.cancelled()
        assert session.exception() is None
