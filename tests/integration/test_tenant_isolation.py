"""The attacks of a caller on the agents' network, each now refused at the node: a
tenant that learns another's block keys can neither lock, read nor overwrite their KV,
and two requests that share a client-chosen request id never mix their KV."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from kvc.block_keys import KEY_LAYOUT, compute_block_keys
from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from tests.conftest import (
    MODEL,
    AgentFactory,
    ConductorFactory,
    assert_no_locks,
    chat_body,
    rpc_status,
)

BS = 32
VICTIM = "victim"
PROMPT = [10 + (7 * i + 3) % 1500 for i in range(3 * BS + 5)]


def victim_keys() -> list[int]:
    return [
        int(k) for k in compute_block_keys(PROMPT[:-1], tenant=VICTIM, model=MODEL, block_size=BS)
    ]


async def cache_for_victim(stub: pb_grpc.NodeAgentAsyncStub) -> pb.PrefillResponse:
    keys = victim_keys()
    tx = pb.TxAllocateRequest(
        key_layout=KEY_LAYOUT, tx_id="v", tenant=VICTIM, block_keys=keys, lease_s=30
    )
    return await stub.Prefill(
        pb.PrefillRequest(
            request_id="same-id", tenant=VICTIM, tx_id="v", prompt_token_ids=PROMPT, tx=tx
        )
    )


async def test_another_tenant_cannot_lock_read_or_overwrite_the_victims_blocks(
    start_agent: AgentFactory,
) -> None:
    agent = await start_agent("prefill", capacity_blocks=64)
    async with grpc.aio.insecure_channel(agent.address) as channel:
        stub = pb_grpc.NodeAgentStub(channel)
        await cache_for_victim(stub)
        keys = victim_keys()
        denied = grpc.StatusCode.PERMISSION_DENIED
        for mode in (pb.TX_MODE_LOCK_ONLY, pb.TX_MODE_ALLOCATE):
            steal = pb.TxAllocateRequest(
                key_layout=KEY_LAYOUT,
                tx_id=f"steal-{mode}",
                tenant="attacker",
                block_keys=keys,
                lease_s=600,
                mode=mode,
            )
            assert await rpc_status(stub.TxAllocate(steal)) == denied
        assert agent.service.pool.locked_by_tenant("attacker") == 0
        # The victim's own lock, then a read of it under another tenant's name.
        lock = pb.TxAllocateRequest(
            key_layout=KEY_LAYOUT,
            tx_id="v-lock",
            tenant=VICTIM,
            block_keys=keys,
            lease_s=30,
            mode=pb.TX_MODE_LOCK_ONLY,
        )
        grant = (await stub.TxAllocate(lock)).read_token
        read = pb.ReadBlocksRequest(tx_id="v-lock", tenant=VICTIM, block_keys=keys)
        assert await rpc_status(stub.ReadBlocks(read)) == denied  # a tx id alone reads nothing
        read = pb.ReadBlocksRequest(
            tx_id="v-lock", tenant="attacker", block_keys=keys, read_token=grant
        )
        assert await rpc_status(stub.ReadBlocks(read)) == denied
        read.tenant = VICTIM
        assert [c async for c in stub.ReadBlocks(read)]  # the owner still reads
        await stub.TxAbort(pb.TxAbortRequest(tx_id="v-lock"))
    assert_no_locks(agent)
    agent.service.pool.check_invariants()


async def test_staged_kv_is_claimed_by_its_handle_and_tenant_only(
    start_agent: AgentFactory,
) -> None:
    agent = await start_agent("prefill", capacity_blocks=64)
    async with grpc.aio.insecure_channel(agent.address) as channel:
        stub = pb_grpc.NodeAgentStub(channel)
        staged = await cache_for_victim(stub)
        assert len(staged.stage_handle) >= 20
        not_found = grpc.StatusCode.NOT_FOUND
        by_id = pb.FetchKvRequest(request_id="same-id", stage_handle="same-id", tenant=VICTIM)
        assert await rpc_status(stub.FetchKv(by_id)) == not_found
        other = pb.FetchKvRequest(stage_handle=staged.stage_handle, tenant="attacker")
        assert await rpc_status(stub.FetchKv(other)) == not_found
        own = pb.FetchKvRequest(stage_handle=staged.stage_handle, tenant=VICTIM)
        assert sum(len(c.data) for c in [c async for c in stub.FetchKv(own)]) > 0
        assert await rpc_status(stub.FetchKv(own)) == not_found  # single use
        assert agent.service.staging.nbytes == 0
    assert_no_locks(agent)


async def test_two_tenants_sharing_a_request_id_each_get_their_own_answer(
    start_agent: AgentFactory, conductor: ConductorFactory, tmp_path: Any
) -> None:
    """Once, the prefill node staged KV under the client's X-Request-Id: two tenants
    sending the same id got one answer computed from the other's KV (and a 502, and
    a leak of the staged bytes)."""
    tenants = tmp_path / "tenants.json"
    tenants.write_text('{"tenants": {"a": {"api_keys": ["sk-a"]}, "b": {"api_keys": ["sk-b"]}}}')
    prefill = await start_agent("prefill")
    decode = await start_agent("decode")
    # A long prompt for one tenant, a short one for the other a moment later: the
    # short prefill finishes right after the long one, while the long one's decode
    # node is still on its way to fetch (the window the collision needed).
    prompts = {"sk-a": "The first tenant asks about lighthouses and their keepers. " * 40,
               "sk-b": "The second tenant asks about volcanoes. " * 6}  # fmt: skip
    async with conductor([prefill, decode], tenants_file=tenants) as c:

        async def ask(key: str, rid: str, delay_s: float = 0.0) -> Any:
            await asyncio.sleep(delay_s)
            return await c.client.post(
                "/v1/chat/completions",
                json=chat_body(prompts[key], max_tokens=8),
                headers={"Authorization": f"Bearer {key}", "X-Request-Id": rid},
            )

        solo = {key: (await ask(key, f"solo-{key}")).json() for key in prompts}
        for i, delay_s in enumerate((0.0, 0.002, 0.005, 0.01, 0.02, 0.04)):
            rid = f"dup-{i}"
            a, b = await asyncio.gather(ask("sk-a", rid), ask("sk-b", rid, delay_s))
            assert a.status_code == b.status_code == 200, (a.text, b.text)
            for key, resp in (("sk-a", a), ("sk-b", b)):
                got = resp.json()["choices"][0]["message"]["content"]
                assert got == solo[key]["choices"][0]["message"]["content"]
    assert prefill.service.staging.nbytes == 0
    assert_no_locks(prefill, decode)


async def test_one_tenant_cannot_lock_a_shared_nodes_whole_pool(
    start_agent: AgentFactory,
) -> None:
    """Once, one TxAllocate of every block with a 600 s lease made every other tenant's
    request 429 until the lease ran out. Alone on a node a tenant still uses the whole
    pool; while another holds locks, each stays under tenant_max_locked_share."""
    from kvc.wire import ERROR_INFO_KEY

    agent = await start_agent("prefill", capacity_blocks=16, tenant_max_locked_share=0.5)
    async with grpc.aio.insecure_channel(agent.address) as channel:
        stub = pb_grpc.NodeAgentStub(channel)

        def tx(tx_id: str, tenant: str, keys: range) -> pb.TxAllocateRequest:
            return pb.TxAllocateRequest(
                key_layout=KEY_LAYOUT,
                tx_id=tx_id,
                tenant=tenant,
                block_keys=list(keys),
                lease_s=600,
            )

        alone = await stub.TxAllocate(tx("hog-alone", "hog", range(1, 13)))
        assert alone.new_blocks == 12  # nobody else here: 12 of 16 is fine
        await stub.TxAbort(pb.TxAbortRequest(tx_id="hog-alone"))
        await stub.TxAllocate(tx("fair", "fair", range(100, 102)))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.TxAllocate(tx("hog", "hog", range(1, 13)))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailer = dict(info.value.trailing_metadata() or ())[ERROR_INFO_KEY]
        assert pb.ErrorInfo.FromString(trailer).reason == "tenant_quota"
        await stub.TxAllocate(tx("hog-8", "hog", range(1, 9)))  # its share: 8 of 16
        more = await stub.TxAllocate(tx("fair-more", "fair", range(102, 108)))
        assert more.new_blocks == 6  # the other tenant still finds room
        for tx_id in ("fair", "hog-8", "fair-more"):
            await stub.TxAbort(pb.TxAbortRequest(tx_id=tx_id))
    assert_no_locks(agent)
