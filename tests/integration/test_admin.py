"""Admin endpoints: node list, drain and resume, index stats; admin key required."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvc.block_keys import KEY_LAYOUT
from tests.conftest import AgentFactory, ConductorFactory, assert_no_locks, chat_body

ADMIN = {"Authorization": "Bearer admin-secret"}


async def test_admin_needs_a_key_and_is_off_without_one(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both")
    async with conductor([agent]) as c:
        resp = await c.client.get("/admin/nodes", headers=ADMIN)
        assert resp.status_code == 404
    async with conductor([agent], admin_keys=["admin-secret"]) as c:
        assert (await c.client.get("/admin/nodes")).status_code == 401
        bad = await c.client.get("/admin/nodes", headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401
        assert bad.json()["error"]["code"] == "invalid_api_key"


async def test_drain_stops_scheduling_onto_a_node_and_resume_restores_it(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    a = await start_agent("both")
    b = await start_agent("both")
    async with conductor([a, b], admin_keys=["admin-secret"]) as c:
        nodes = (await c.client.get("/admin/nodes", headers=ADMIN)).json()["nodes"]
        assert {n["address"] for n in nodes} == {a.address, b.address}
        assert all(n["usable"] and not n["draining"] for n in nodes)
        resp = await c.client.post(f"/admin/nodes/{a.address}/drain", headers=ADMIN)
        assert resp.status_code == 200, resp.text
        assert resp.json()["draining"] is True
        assert resp.json()["node"]["usable"] is False
        for _ in range(4):  # every request now lands on b
            ok = await c.client.post("/v1/chat/completions", json=chat_body())
            assert ok.status_code == 200
        assert a.service.pool.stats().cached_blocks == 0
        assert (await c.client.get("/ready")).status_code == 200  # b still serves
        resumed = await c.client.post(
            f"/admin/nodes/{a.service.node_info.node_id}/drain",
            headers=ADMIN,
            json={"resume": True},
        )
        assert resumed.json()["draining"] is False
        assert resumed.json()["node"]["usable"] is True
        unknown = await c.client.post("/admin/nodes/nowhere:1/drain", headers=ADMIN)
        assert unknown.status_code == 404
        index = (await c.client.get("/admin/index", headers=ADMIN)).json()
        assert index["policy"] == "kv_centric"
        assert set(index["per_node"]) <= {a.address, b.address}
        assert all("prefill_model" in n for n in index["per_node"].values())
    assert_no_locks(a, b)


async def test_draining_agent_refuses_new_work_but_finishes_a_tx(
    start_agent: AgentFactory,
) -> None:
    import grpc

    from kvc.v1 import node_agent_pb2 as pb
    from kvc.v1 import node_agent_pb2_grpc as pb_grpc

    agent = await start_agent("both")
    async with grpc.aio.insecure_channel(agent.address) as channel:
        stub = pb_grpc.NodeAgentStub(channel)
        await stub.TxAllocate(
            pb.TxAllocateRequest(
                key_layout=KEY_LAYOUT, tx_id="before", tenant="t", block_keys=[1, 2], lease_s=30
            )
        )
        drained = await stub.Drain(pb.DrainRequest())
        assert (drained.draining, drained.open_txs) == (True, 1)
        assert (await stub.GetInfo(pb.GetInfoRequest())).draining
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.TxAllocate(
                pb.TxAllocateRequest(
                    key_layout=KEY_LAYOUT, tx_id="after", tenant="t", block_keys=[3], lease_s=30
                )
            )
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        await stub.TxCommit(pb.TxCommitRequest(tx_id="before"))  # in-flight work completes
        assert agent.service.busy() == (0, 0)
    assert_no_locks(agent)


async def test_ready_lists_agents_only_to_an_admin_when_keys_are_set(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    """An unauthenticated /ready once listed every agent's address and error."""
    agent = await start_agent("both")
    async with conductor([agent], admin_keys=["admin-secret"], api_keys=["sk-1"]) as c:
        anonymous = await c.client.get("/ready")
        assert anonymous.status_code == 200
        assert anonymous.json() == {"status": "ready", "agents": []}
        client = await c.client.get("/ready", headers={"Authorization": "Bearer sk-1"})
        assert client.json()["agents"] == []  # an API key is not an admin key
        admin = await c.client.get("/ready", headers=ADMIN)
        assert [a["address"] for a in admin.json()["agents"]] == [agent.address]
        for key in ("admin-secre", "admin-secret-", "", "x" * 200):  # near misses
            resp = await c.client.get("/admin/nodes", headers={"Authorization": f"Bearer {key}"})
            assert resp.status_code == 401, key
    async with conductor([agent]) as c:  # no keys at all: nothing is private
        assert [a["address"] for a in (await c.client.get("/ready")).json()["agents"]] == [
            agent.address
        ]


async def test_node_list_shows_each_nodes_kv_tiers(
    start_agent: AgentFactory, conductor: ConductorFactory, tmp_path: Path
) -> None:
    tiered = await start_agent(
        "both", host_tier_bytes=1 << 20, disk_tier_dir=tmp_path, disk_tier_bytes=4 << 20
    )
    plain = await start_agent("both")
    async with conductor([tiered, plain], admin_keys=["admin-secret"]) as c:
        nodes = (await c.client.get("/admin/nodes", headers=ADMIN)).json()["nodes"]
    by_address = {n["address"]: n for n in nodes}
    assert by_address[plain.address]["tiers"] == []
    tiers = {t["medium"]: t for t in by_address[tiered.address]["tiers"]}
    assert set(tiers) == {"host", "disk"}
    assert (tiers["host"]["capacity_bytes"], tiers["disk"]["capacity_bytes"]) == (1 << 20, 4 << 20)
    assert tiers["host"]["read_bytes_per_s"] > 0  # measured at agent start
    assert tiers["disk"]["read_bytes_per_s"] > 0
