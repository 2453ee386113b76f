"""Prompt-cache breakpoints end to end in one process: real agents (gRPC on loopback)
and the real conductor app — budgets per tenant, what the usage says, the OpenAI
fields, bad input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from kvc.block_keys import KEY_LAYOUT
from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from tests.conftest import AgentFactory, ConductorFactory, assert_no_locks, wait_until

MODEL = "tiny-llama"
BLOCK = 32


def system_prompt(topic: str) -> str:
    return " ".join(f"Rule {i} for {topic}: answer briefly and stay on {topic}." for i in range(8))


def chat(topic: str, ttl: str = "1h", question: str = "What is rule 3?") -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [
            {
                "role": "system",
                "content": [
                    {
                        "type": "text",
                        "text": system_prompt(topic),
                        "cache_control": {"type": "ephemeral", "ttl": ttl},
                    }
                ],
            },
            {"role": "user", "content": question},
        ],
    }


async def test_a_tenant_over_budget_is_served_without_retention_and_others_keep_theirs(
    start_agent: AgentFactory, conductor: ConductorFactory, tmp_path: Path
) -> None:
    tenants = tmp_path / "tenants.json"
    tenants.write_text('{"tenants": {"a": {"api_keys": ["sk-a"]}, "b": {"api_keys": ["sk-b"]}}}')
    # About 6 blocks retained for an hour is ~21,600 block-seconds: one grant per tenant.
    agent = await start_agent("both", retention_budget_block_s=30_000.0)
    pool = agent.service.pool
    async with conductor([agent], tenants_file=tenants, prompt_cache_min_tokens=64) as c:

        async def ask(key: str, body: dict[str, Any]) -> dict[str, Any]:
            r = await c.client.post(
                "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            )
            assert r.status_code == 200, r.text
            usage: dict[str, Any] = r.json()["usage"]
            return usage

        b_first = await ask("sk-b", chat("tides"))
        assert b_first["prompt_cache"]["retention"] == "granted"
        b_retained = {k for k, _ in pool.retained_keys()}
        assert len(b_retained) >= 4
        assert pool.retention_of("b")[0] == len(b_retained)

        a_first = await ask("sk-a", chat("lighthouses"))
        assert a_first["prompt_cache"]["retention"] == "granted"
        assert a_first["prompt_cache"]["cache_write_tokens"] > 0
        a_over = await ask("sk-a", chat("harbours"))  # a second hour-long grant: over budget
        assert a_over["prompt_cache"] == {
            "retention": "over_budget",
            "cache_write_tokens": 0,
            "cache_read_tokens": a_over["prompt_tokens_details"]["cached_tokens"],
        }
        assert a_over["completion_tokens"] == 2  # served all the same
        # b's retention is untouched, and b can still use its own.
        assert b_retained <= {k for k, _ in pool.retained_keys()}
        assert pool.retention_of("b")[0] == len(b_retained)
        b_again = await ask("sk-b", chat("tides", question="And rule 4?"))
        assert b_again["prompt_tokens_details"]["cached_tokens"] >= len(b_retained) * BLOCK

        books = (await c.client.get("/admin/prompt-cache")).status_code
        assert books == 404  # operators only (no admin key configured: no admin API)
    assert_no_locks(agent)


async def test_the_ledger_and_metrics_count_writes_reads_and_refusals(
    start_agent: AgentFactory, conductor: ConductorFactory, tmp_path: Path
) -> None:
    agent = await start_agent("both", retention_budget_block_s=0.0)  # refuse every grant
    async with conductor(
        [agent], prompt_cache_min_tokens=64, admin_keys=["adm"], api_keys=["sk-1"]
    ) as c:
        auth = {"Authorization": "Bearer sk-1"}
        r = await c.client.post("/v1/chat/completions", json=chat("tides"), headers=auth)
        assert r.json()["usage"]["prompt_cache"]["retention"] == "over_budget"
        books = await c.client.get("/admin/prompt-cache", headers={"Authorization": "Bearer adm"})
        default = books.json()["tenants"]["default"]
        assert default["retention_requests"] == 1
        assert default["retention_refused"] == 1
        assert default["written_tokens"] == 0
        metrics = (await c.client.get("/metrics")).text
        assert 'conductor_prompt_cache_retentions_total{outcome="over_budget"} 1.0' in metrics
    assert_no_locks(agent)


async def test_short_breakpoints_openai_retention_and_affinity_key(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both")
    pool = agent.service.pool
    async with conductor([agent], prompt_cache_min_tokens=4096) as c:
        r = await c.client.post("/v1/chat/completions", json=chat("tides"))
        assert r.json()["usage"]["prompt_cache"]["retention"] == "below_minimum"
        assert pool.stats().retained_blocks == 0
    async with conductor([agent], prompt_cache_min_tokens=64) as c:
        plain = {
            "model": MODEL,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": system_prompt("sails")}],
        }
        # in_memory is automatic caching: nothing retained, nothing reported.
        r = await c.client.post(
            "/v1/chat/completions", json={**plain, "prompt_cache_retention": "in_memory"}
        )
        assert "prompt_cache" not in r.json()["usage"]
        # 24h is longer than this deployment retains (1 h by default): refused, not shortened.
        r = await c.client.post(
            "/v1/chat/completions", json={**plain, "prompt_cache_retention": "24h"}
        )
        assert r.status_code == 422, r.text
        assert r.json()["error"]["param"] == "prompt_cache_retention"
        r = await c.client.post(
            "/v1/chat/completions", json={**plain, "prompt_cache_retention": "forever"}
        )
        assert r.status_code == 400
        # A completion with a key: accepted, served.
        r = await c.client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "hello there", "max_tokens": 2,
                  "prompt_cache_key": "session-42"},
        )  # fmt: skip
        assert r.status_code == 200, r.text
    async with conductor([agent], prompt_cache_min_tokens=64, prompt_cache_max_ttl_s=86_400.0) as c:
        r = await c.client.post(
            "/v1/chat/completions", json={**plain, "prompt_cache_retention": "24h"}
        )
        # The agents retain for at most 1 h: served, the retention refused and said so.
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_cache"]["retention"] == "too_long"
    assert_no_locks(agent)


async def test_bad_breakpoints_are_400s(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both")
    async with conductor([agent]) as c:
        bad_ttl = chat("tides", ttl="10m")
        r = await c.client.post("/v1/chat/completions", json=bad_ttl)
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "messages[0].content[0].cache_control"
        five = chat("tides")
        five["tools"] = [
            {"type": "function", "function": {"name": f"t{i}"},
             "cache_control": {"type": "ephemeral"}}
            for i in range(5)
        ]  # fmt: skip
        r = await c.client.post("/v1/chat/completions", json=five)
        assert r.status_code == 400
        assert "A maximum of 4 blocks" in r.json()["error"]["message"]
    assert_no_locks(agent)


async def test_retention_outlives_the_conductor_that_asked_for_it(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    """The node owns a retention: a conductor started afterwards learns it from the
    node's snapshot and shows it, and its requests read the retained prefix."""
    agent = await start_agent("both")
    async with conductor([agent], prompt_cache_min_tokens=64) as first:
        r = await first.client.post("/v1/chat/completions", json=chat("tides"))
        assert r.json()["usage"]["prompt_cache"]["retention"] == "granted"
    retained = agent.service.pool.stats().retained_blocks
    assert retained >= 4
    async with conductor([agent], prompt_cache_min_tokens=64, admin_keys=["adm"]) as second:
        handle = second.state.fleet.handles()[0]
        await wait_until(lambda: len(handle.retained) == retained)  # from its snapshot
        admin = {"Authorization": "Bearer adm"}
        nodes = (await second.client.get("/admin/nodes", headers=admin)).json()
        assert nodes["nodes"][0]["retained_blocks"] == retained
        r = await second.client.post("/v1/chat/completions", json=chat("tides", question="Hm?"))
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= retained * BLOCK
        # A new grant reaches this conductor's view through the node's events.
        r = await second.client.post("/v1/chat/completions", json=chat("sails"))
        assert r.json()["usage"]["prompt_cache"]["retention"] == "granted"
        now_retained = agent.service.pool.stats().retained_blocks
        assert now_retained > retained
        await wait_until(lambda: len(handle.retained) == now_retained)
    assert_no_locks(agent)


async def test_a_retried_allocation_answers_its_retention_again_and_counts_it_once(
    start_agent: AgentFactory,
) -> None:
    agent = await start_agent("both")
    registry = agent.service.metrics.registry
    request = pb.TxAllocateRequest(
        key_layout=KEY_LAYOUT,
        tx_id="tx-retry",
        tenant="t",
        block_keys=[11, 12, 13],
        lease_s=5.0,
        mode=pb.TX_MODE_ALLOCATE,
        retain=[pb.Retention(blocks=2, ttl_s=60.0)],
    )
    async with grpc.aio.insecure_channel(agent.address) as channel:
        stub = pb_grpc.NodeAgentStub(channel)
        first = await stub.TxAllocate(request)
        again = await stub.TxAllocate(request)  # a conductor's retry of the same call
        assert first.retention == again.retention
        assert first.retention.status == pb.RETENTION_STATUS_GRANTED
        assert first.retention.retained_blocks == 2
        granted = {"outcome": "granted"}
        assert registry.get_sample_value("node_agent_retentions_total", granted) == 1
        await stub.TxCommit(pb.TxCommitRequest(tx_id="tx-retry"))
    assert agent.service.pool.stats().retained_blocks == 2
    assert_no_locks(agent)
