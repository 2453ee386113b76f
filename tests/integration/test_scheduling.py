"""KV-centric scheduling against real agents: prefix routing, hot-spot replication,
SLO rejections before any engine work, and the shadow index following agents."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from conductor.core.prefix_index import NodeId
from node_agent.server import AgentServer
from tests.conftest import (
    AgentFactory,
    Conductor,
    ConductorFactory,
    assert_no_locks,
    chat_body,
    metric_value,
    tls_settings,
    wait_until,
)

SYSTEM_X = "You are the assistant of the Xylophone Club. " * 14
SYSTEM_Y = "You answer questions about yellow yachts only. " * 14


def conversation(system: str, question: str, **extra: Any) -> dict[str, Any]:
    return chat_body(
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=4,
        **extra,
    )


def cached(resp: Any) -> int:
    assert resp.status_code == 200, resp.text
    n: int = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return n


async def seed(
    conductor: ConductorFactory, agent: AgentServer, system: str, **settings: Any
) -> None:
    """Cache a conversation prefix on one agent (a conductor that sees only it)."""
    async with conductor([agent], **settings) as c:
        resp = await c.client.post("/v1/chat/completions", json=conversation(system, "hello"))
        assert cached(resp) == 0


async def synced(c: Conductor, *agents: AgentServer) -> None:
    await wait_until(lambda: all(c.state.index.node_key_count(NodeId(a.address)) for a in agents))


async def test_requests_go_to_the_node_holding_their_prefix(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    a = await start_agent("both")
    b = await start_agent("both")
    await seed(conductor, a, SYSTEM_X)
    await seed(conductor, b, SYSTEM_Y)
    async with conductor([a, b]) as c:
        await synced(c, a, b)  # rebuilt from each agent's Snapshot
        for _ in range(3):
            x = await c.client.post("/v1/chat/completions", json=conversation(SYSTEM_X, "q?"))
            y = await c.client.post("/v1/chat/completions", json=conversation(SYSTEM_Y, "q?"))
            assert cached(x) >= 4 * 32
            assert cached(y) >= 4 * 32
        metrics = (await c.client.get("/metrics")).text
        assert 'conductor_prompt_cache_tokens_total{source="local"}' in metrics
        assert "conductor_scheduling_decision_seconds_count 6.0" in metrics
    assert_no_locks(a, b)


@pytest.mark.parametrize("node_certificates", [False, True], ids=["plaintext", "mtls-strict"])
async def test_hot_prefix_is_replicated_under_load(
    start_agent: AgentFactory,
    conductor: ConductorFactory,
    tls_bundle: Path,
    node_certificates: bool,
) -> None:
    """Also over mTLS with agents that require node certificates: the conductor binds
    the holder's read grant to the node that pulls."""

    def agent_tls(node: str) -> dict[str, Any]:
        if not node_certificates:
            return {}
        files = tls_settings(tls_bundle, f"agent-{node}")
        return {"node_id": node, "require_node_certificates": True, **files}

    tls = tls_settings(tls_bundle, "conductor") if node_certificates else {}
    a = await start_agent("both", **agent_tls("node-a"))
    b = await start_agent("both", **agent_tls("node-b"))
    await seed(conductor, a, SYSTEM_X, **tls)
    # A prior that makes prefill expensive: a request queued on the holder costs more
    # than pulling the prefix to the idle node (Algorithm 1, lines 5-8).
    slow = {"prefill_prior_per_token_s": 0.01, "kvcache_balancing_threshold": 2.0}
    async with conductor([a, b], **slow, **tls) as c:
        await synced(c, a)
        bodies = [conversation(SYSTEM_X, f"question {i}?") for i in range(4)]
        responses = await asyncio.gather(
            *(c.client.post("/v1/chat/completions", json=body) for body in bodies)
        )
        assert all(cached(r) >= 4 * 32 for r in responses), [cached(r) for r in responses]
        metrics = (await c.client.get("/metrics")).text
        assert metric_value(metrics, "conductor_kv_migrations_total") >= 1
        assert 'conductor_prompt_cache_tokens_total{source="migrated"} 0.0' not in metrics
        # The prefix now lives on both nodes, and the shadow index knows it.
        await synced(c, b)
        keys_on_a = c.state.index.node_key_count(NodeId(a.address))
        assert c.state.index.node_key_count(NodeId(b.address)) >= 4
        assert keys_on_a >= 4
    assert_no_locks(a, b)


def _allocations(*agents: AgentServer) -> list[float]:
    return [a.service.metrics.tx.labels("allocate", "ok")._value.get() for a in agents]


async def test_unattainable_slos_are_429_before_any_engine_work(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    """Busy, calibrated nodes refuse what would miss its SLO, before any Tx.

    An idle node never refuses (the next test); calibration gives the conductor a
    measured prior, i.e. evidence to refuse on."""
    prefill = await start_agent("prefill", calibrate=True)
    decode = await start_agent("decode", calibrate=True)
    assert prefill.service.node_info.HasField("calibration")
    async with conductor([prefill, decode]) as c:
        long_body = chat_body(
            messages=[{"role": "user", "content": SYSTEM_X * 12}], max_tokens=256, ignore_eos=True
        )
        background = asyncio.create_task(c.client.post("/v1/chat/completions", json=long_body))
        # Its prefill is queued or running: the prefill node is busy.
        await wait_until(lambda: _allocations(prefill)[0] >= 1, timeout_s=30)
        before = _allocations(prefill, decode)
        resp = await c.client.post(
            "/v1/chat/completions",
            json=conversation(SYSTEM_X, "hi"),
            headers={"X-Kvc-Slo-Ttft-Ms": "0.5"},
        )
        assert resp.status_code == 429, resp.text
        assert int(resp.headers["retry-after"]) >= 1
        assert resp.headers["x-kvc-reject-reason"] == "ttft_slo"
        err = resp.json()["error"]
        assert err["code"] == "ttft_slo_unattainable"
        assert err["type"] == "requests"
        assert _allocations(prefill, decode) == before  # no Tx, no prefill
        # Its decode is running: a TBT of 10 us cannot be met beside it.
        await wait_until(lambda: decode.engine.load().running_requests >= 1, timeout_s=60)
        resp = await c.client.post(
            "/v1/chat/completions",
            json=conversation(SYSTEM_X, "hi"),
            headers={"X-Kvc-Slo-Tbt-Ms": "0.01"},
        )
        assert resp.status_code == 429, resp.text
        assert resp.json()["error"]["code"] == "tbt_slo_unattainable"
        assert _allocations(prefill, decode) == before
        assert (await background).status_code == 200
        metrics = (await c.client.get("/metrics")).text
        assert 'conductor_rejections_total{reason="ttft_slo"} 1.0' in metrics
        assert 'conductor_rejections_total{reason="tbt_slo"} 1.0' in metrics
        bad = await c.client.post(
            "/v1/chat/completions", json=chat_body(), headers={"X-Kvc-Slo-Ttft-Ms": "soon"}
        )
        assert bad.status_code == 400
    assert_no_locks(prefill, decode)


async def test_an_idle_cluster_serves_what_fits_whatever_the_slo_says(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    """No evidence that the SLO is out of reach, and nothing to wait for: served (the
    response tells the client how long it took; the SLO is a target, not a guess)."""
    prefill = await start_agent("prefill")
    decode = await start_agent("decode")
    async with conductor([prefill, decode]) as c:
        resp = await c.client.post(
            "/v1/chat/completions",
            json=conversation(SYSTEM_X, "hi"),
            headers={"X-Kvc-Slo-Ttft-Ms": "0.5", "X-Kvc-Slo-Tbt-Ms": "0.01"},
        )
        assert resp.status_code == 200, resp.text
    assert_no_locks(prefill, decode)


async def test_policies_are_chosen_by_config(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    a = await start_agent("both")
    b = await start_agent("both")
    await seed(conductor, a, SYSTEM_X)
    async with conductor([a, b], policy="round_robin") as c:
        await synced(c, a)
        hits = [
            cached(await c.client.post("/v1/chat/completions", json=conversation(SYSTEM_X, "q")))
            for _ in range(4)
        ]
        # Prefix-blind rotation: only the turns that land on the holder hit its cache
        # (the other node caches the prefix on its first turn and hits afterwards).
        assert hits.count(0) == 1
    assert_no_locks(a, b)


async def test_shadow_resyncs_after_agent_restart(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    a = await start_agent("both")
    async with conductor([a]) as c:
        await c.client.post("/v1/chat/completions", json=conversation(SYSTEM_X, "hi"))
        await synced(c, a)
        epoch = c.state.index.position(NodeId(a.address))
        assert epoch is not None
        a.service.pool.clear()  # an engine reset: AllBlocksCleared
        await a.service.housekeeping_once()
        await wait_until(lambda: c.state.index.node_key_count(NodeId(a.address)) == 0)


async def test_inflight_prefixes_are_tracked_and_released(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    """kv_adaptive counts blocks an open prefill is computing; the count ends with the Tx."""
    from kvc.block_keys import BlockKey

    a = await start_agent("both")
    async with conductor([a], policy="kv_adaptive") as c:
        inflight = c.state.dispatcher.loop.inflight
        node = NodeId(a.address)
        keys = [BlockKey(k) for k in (11, 12, 13)]
        inflight.add(node, keys)
        inflight.add(node, keys[:2])
        assert inflight.pending([*keys, BlockKey(99)], {}) == {node: 3}
        inflight.remove(node, keys)
        assert inflight.pending(keys, {}) == {node: 2}
        inflight.remove(node, keys[:2])
        assert inflight.pending(keys, {}) == {}
        responses = await asyncio.gather(
            *(
                c.client.post("/v1/chat/completions", json=conversation(SYSTEM_X, f"q{i}"))
                for i in range(3)
            )
        )
        assert all(r.status_code == 200 for r in responses)
        assert len(inflight) == 0  # every Tx closed: nothing left counted
    assert_no_locks(a)
