"""A request whose Tx is open while it waits for its first token (a prefix pull, then a
prefill queued behind others) keeps the Tx alive: the dispatcher renews its lease every
half lease (``TxExtend``), so only a conductor that died lets it lapse (seen live: prefills
queued behind a hot holder's lends outlived a fixed lease and failed at commit)."""

from __future__ import annotations

import asyncio

from tests.conftest import AgentFactory, ConductorFactory, assert_no_locks, wait_until
from tests.integration.test_block_migration import alloc, keys_of, tx_open

KEPT = [*range(100, 164), 5]
WITNESS = [*range(400, 464), 5]


async def test_an_open_tx_outlives_its_lease_while_the_request_waits(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    a = await start_agent("both")
    async with conductor([a]) as c:
        agent = c.state.fleet.get(a.address)
        await agent.stub.TxAllocate(alloc("kept", keys_of(KEPT), lease_s=0.4))
        await agent.stub.TxAllocate(alloc("witness", keys_of(WITNESS), lease_s=0.4))
        keeper = asyncio.create_task(c.state.dispatcher._keep_lease(agent, "kept", 0.4))
        try:
            await wait_until(lambda: not tx_open(a, "witness"))  # a first lease has run out
            assert tx_open(a, "kept")
            assert not keeper.done()
        finally:
            keeper.cancel()
        # Nobody renews it any more: it lapses like any other.
        await wait_until(lambda: not tx_open(a, "kept"))
        # A keeper whose tx is gone stops by itself.
        await c.state.dispatcher._keep_lease(agent, "kept", 0.1)
    assert_no_locks(a)
