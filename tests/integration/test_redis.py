"""Redis: agent registry and discovery, cluster-wide per-tenant rate limits across
conductor replicas, API keys in Redis, tenant isolation, and behaviour with Redis down."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from conductor.tenants import key_digest
from tests.conftest import (
    AgentFactory,
    ConductorFactory,
    RedisServer,
    assert_no_locks,
    chat_body,
    wait_until,
)


def tenants_file(tmp_path: Path, **tenants: dict[str, Any]) -> Path:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": tenants}))
    return path


async def test_rate_limits_hold_across_two_conductors(
    start_agent: AgentFactory, conductor: ConductorFactory, redis_server: RedisServer,
    tmp_path: Path,
) -> None:  # fmt: skip
    agent = await start_agent("both")
    path = tenants_file(tmp_path, acme={"api_keys": ["sk-acme"], "requests_per_minute": 3})
    auth = {"Authorization": "Bearer sk-acme"}
    common = {"tenants_file": path, "redis_url": redis_server.url}
    async with conductor([agent], **common) as c1, conductor([agent], **common) as c2:
        statuses = []
        for client in (c1.client, c2.client, c1.client, c2.client):
            resp = await client.post("/v1/chat/completions", json=chat_body(), headers=auth)
            statuses.append(resp.status_code)
            if resp.status_code == 200:
                assert resp.headers["x-ratelimit-limit-requests"] == "3"
                assert int(resp.headers["x-ratelimit-remaining-requests"]) < 3
                assert resp.headers["x-ratelimit-reset-requests"].endswith("s")
        assert statuses == [200, 200, 200, 429]
        err = resp.json()["error"]
        assert err["type"] == "requests"
        assert err["code"] == "rate_limit_exceeded"
        assert "acme" in err["message"]
        assert int(resp.headers["retry-after"]) >= 1
        assert resp.headers["x-kvc-reject-reason"] == "tenant_rate_limit"
        assert resp.headers["x-ratelimit-remaining-requests"] == "0"
        metrics = (await c2.client.get("/metrics")).text
        assert 'conductor_rejections_total{reason="tenant_rate_limit"} 1.0' in metrics
        assert "conductor_redis_up 1.0" in metrics
    assert_no_locks(agent)


async def test_token_limit_counts_prompt_and_max_tokens(
    start_agent: AgentFactory, conductor: ConductorFactory, redis_server: RedisServer,
    tmp_path: Path,
) -> None:  # fmt: skip
    agent = await start_agent("both")
    path = tenants_file(tmp_path, t={"api_keys": ["sk-t"], "tokens_per_minute": 100})
    async with conductor([agent], tenants_file=path, redis_url=redis_server.url) as c:
        auth = {"Authorization": "Bearer sk-t"}
        ok = await c.client.post("/v1/chat/completions", json=chat_body(max_tokens=8), headers=auth)
        assert ok.status_code == 200
        big = await c.client.post(
            "/v1/chat/completions", json=chat_body(max_tokens=200), headers=auth
        )
        assert big.status_code == 429
        assert big.json()["error"]["type"] == "tokens"


async def test_agents_register_and_conductor_discovers_them(
    start_agent: AgentFactory, conductor: ConductorFactory, redis_server: RedisServer
) -> None:
    agent = await start_agent("both", redis_url=redis_server.url, registry_ttl_s=3.0)
    async with conductor([], redis_url=redis_server.url, agent_poll_interval_s=0.2) as c:
        await wait_until(lambda: c.state.fleet.ready())
        resp = await c.client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code == 200
        await agent.stop(grace_s=0.1)  # a clean stop withdraws the record
        await wait_until(
            lambda: all(a.address != agent.address for a in c.state.fleet.handles()), timeout_s=5
        )
        assert (await c.client.get("/ready")).status_code == 503


async def test_redis_down_keeps_serving_with_known_agents_and_local_limits(
    start_agent: AgentFactory, conductor: ConductorFactory, redis_server: RedisServer,
    tmp_path: Path,
) -> None:  # fmt: skip
    agent = await start_agent("both", redis_url=redis_server.url)
    path = tenants_file(tmp_path, t={"api_keys": ["sk-t"], "requests_per_minute": 2})
    settings = {"redis_url": redis_server.url, "tenants_file": path, "agent_poll_interval_s": 0.2}
    auth = {"Authorization": "Bearer sk-t"}
    async with conductor([], **settings) as c:
        await wait_until(lambda: c.state.fleet.ready())
        redis_server.stop()
        registry = c.state.metrics.registry
        await wait_until(lambda: registry.get_sample_value("conductor_redis_up") == 0, 5)
        codes = [
            (
                await c.client.post("/v1/chat/completions", json=chat_body(), headers=auth)
            ).status_code
            for _ in range(3)
        ]
        assert codes == [200, 200, 429]  # the last known agent serves; limits hold locally
        metrics = (await c.client.get("/metrics")).text
        assert "conductor_redis_up 0.0" in metrics
    assert_no_locks(agent)


async def test_api_keys_resolved_from_redis(
    start_agent: AgentFactory, conductor: ConductorFactory, redis_server: RedisServer
) -> None:
    agent = await start_agent("both")
    redis = Redis.from_url(redis_server.url, decode_responses=True)
    await redis.set(f"kvc:apikey:{key_digest('sk-from-redis')}", json.dumps({"tenant": "beta"}))
    await redis.aclose()
    async with conductor([agent], redis_url=redis_server.url, api_keys_in_redis=True) as c:
        good = await c.client.post(
            "/v1/chat/completions", json=chat_body(),
            headers={"Authorization": "Bearer sk-from-redis"},
        )  # fmt: skip
        assert good.status_code == 200
        bad = await c.client.post(
            "/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer sk-no"}
        )
        assert bad.status_code == 401
        assert bad.json()["error"]["code"] == "invalid_api_key"


async def test_one_tenant_never_hits_another_tenants_cache(
    start_agent: AgentFactory, conductor: ConductorFactory, tmp_path: Path
) -> None:
    agent = await start_agent("both")
    path = tenants_file(tmp_path, a={"api_keys": ["sk-a"]}, b={"api_keys": ["sk-b"]})
    body = chat_body("A shared document that both tenants happen to send. " * 8)

    prompt_tokens = 0

    async def cached(key: str) -> int:
        nonlocal prompt_tokens
        resp = await c.client.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        )
        assert resp.status_code == 200
        usage = resp.json()["usage"]
        prompt_tokens = usage["prompt_tokens"]
        n: int = usage["prompt_tokens_details"]["cached_tokens"]
        return n

    async with conductor([agent], tenants_file=path) as c:
        assert await cached("sk-a") == 0
        assert await cached("sk-a") > 0  # tenant a reuses its own prefix
        assert await cached("sk-b") == 0  # same tokens, other tenant: no hit, no timing signal
        assert await cached("sk-b") > 0
    blocks_per_tenant = (prompt_tokens - 1) // 32
    assert blocks_per_tenant >= 2
    # Two disjoint copies of the same tokens: one per tenant, keys never shared.
    assert agent.service.pool.stats().cached_blocks == 2 * blocks_per_tenant
    assert_no_locks(agent)


async def test_invalid_tenants_file_fails_fast(tmp_path: Path) -> None:
    from kvc_cli.cli import main

    bad = tmp_path / "tenants.json"
    bad.write_text('{"tenants": {"x": {"requests_per_minute": -1}}}')
    assert await asyncio.to_thread(main, ["conductor", "--tenants-file", str(bad)]) == 2


@pytest.mark.parametrize("grace_s", [20.0, 0.0])
async def test_a_redis_restarted_empty_does_not_empty_the_fleet(
    start_agent: AgentFactory, conductor: ConductorFactory, redis_server: RedisServer,
    grace_s: float, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """Once, a Redis without persistence that restarted listed no agents, both
    conductors dropped every agent and served 503s until the agents' next heartbeat.
    Now the fleet keeps the agents it knew for ``registry_grace_s`` after the Redis
    server changed (0: the old behaviour, shown for contrast)."""
    agent = await start_agent("both", redis_url=redis_server.url, registry_ttl_s=60.0)
    settings = {"redis_url": redis_server.url, "agent_poll_interval_s": 0.1,
                "registry_grace_s": grace_s}  # fmt: skip
    async with conductor([], **settings) as c:
        await wait_until(lambda: c.state.fleet.ready())
        redis_server.restart_empty()  # the agent re-registers only in 20 s
        if grace_s:  # discovery sees the new server, lists nobody, keeps the agent
            await wait_until(lambda: "Redis restarted" in caplog.text)
            resp = await c.client.post("/v1/chat/completions", json=chat_body())
            assert resp.status_code == 200, resp.text
            assert [a.address for a in c.state.fleet.handles()] == [agent.address]
        else:  # the empty registry is taken as the truth: the fleet empties
            await wait_until(lambda: not c.state.fleet.handles())
            resp = await c.client.post("/v1/chat/completions", json=chat_body())
            assert resp.status_code == 503
    assert_no_locks(agent)
