"""Metrics recorded where things happen: real agents (gRPC and ``/metrics`` over HTTP on
loopback) behind the real conductor app, read back from both expositions."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import Message, Scope

from kvc.block_keys import KEY_LAYOUT
from kvc.processes import free_port
from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from node_agent.server import AgentServer
from tests.conftest import AgentFactory, ConductorFactory, assert_no_locks, chat_body, wait_until

LONG_PROMPT = " ".join(f"word{i}" for i in range(120))  # several 32-token blocks


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, frozenset(labels.items())), 0.0)


def request_counts(text: str) -> dict[tuple[str, str], float]:
    """The non-zero ``conductor_requests_total`` series: (endpoint, outcome) → count."""
    return {
        (labels["endpoint"], labels["outcome"]): v
        for (name, frozen), v in samples(text).items()
        if name == "conductor_requests_total" and v
        for labels in [dict(frozen)]
    }


async def scrape(agent: AgentServer) -> str:
    assert agent.metrics_server is not None
    async with httpx.AsyncClient() as client:
        r = await client.get(f"http://127.0.0.1:{agent.metrics_server.port}/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return r.text


async def test_a_disaggregated_request_is_counted_on_both_sides(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    prefill = await start_agent("prefill", metrics_port=free_port())
    decode = await start_agent("decode", metrics_port=free_port())
    async with conductor([prefill, decode]) as c:
        r = await c.client.post("/v1/chat/completions", json=chat_body(LONG_PROMPT))
        assert r.status_code == 200, r.text
        await wait_until(lambda: prefill.service.pool.stats().open_txs == 0)
        p, d = await scrape(prefill), await scrape(decode)
        assert value(p, "node_agent_tx_total", op="allocate", outcome="ok") == 1
        assert value(p, "node_agent_tx_total", op="commit", outcome="ok") == 1
        assert value(p, "node_agent_info", role="prefill", engine="embedded", model="tiny-llama")
        computed = value(p, "node_agent_prefill_tokens_total", source="computed")
        assert computed > 32
        assert value(p, "node_agent_prefill_duration_seconds_count") == 1
        sent = value(p, "node_agent_kv_transfer_bytes_total", direction="sent", kind="handoff")
        got = value(d, "node_agent_kv_transfer_bytes_total", direction="received", kind="handoff")
        assert sent == got > 0
        assert value(d, "node_agent_kv_transfer_seconds_count", direction="received",
                     kind="handoff") == 1  # fmt: skip
        assert value(d, "node_agent_generated_tokens_total") == 12
        assert value(p, "node_agent_events_published_total", kind="stored") >= 1
        assert value(p, "node_agent_kv_blocks", state="cached") > 0
        assert value(p, "node_agent_kv_locked_blocks") == 0
        metrics = (await c.client.get("/metrics")).text
        # The allocation rode in Prefill, which committed once the KV was staged.
        assert value(metrics, "conductor_agent_calls_total", method="Prefill", code="OK") == 1
        assert value(metrics, "conductor_agent_calls_total", method="TxAllocate", code="OK") == 0
        assert value(metrics, "conductor_agent_calls_total", method="TxCommit", code="OK") == 0
        assert value(metrics, "conductor_agent_up", agent=prefill.address) == 1
        assert value(metrics, "conductor_agent_up", agent=decode.address) == 1
        assert value(metrics, "conductor_agents_usable", role="prefill") == 1
        total = value(metrics, "conductor_prompt_cache_tokens_total", source="computed")
        assert total > 0
    assert_no_locks(prefill, decode)


async def test_a_colocated_request_is_one_fused_call(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    """On a "both" node the allocation and the commit ride in the Generate call: the
    agent's block table records both, the conductor makes no TxAllocate/TxCommit call."""
    agent = await start_agent("both", metrics_port=free_port())
    async with conductor([agent]) as c:
        for _ in range(2):
            r = await c.client.post("/v1/chat/completions", json=chat_body(LONG_PROMPT))
            assert r.status_code == 200, r.text
        a = await scrape(agent)
        assert value(a, "node_agent_tx_total", op="allocate", outcome="ok") == 2
        assert value(a, "node_agent_tx_total", op="commit", outcome="ok") == 2
        metrics = (await c.client.get("/metrics")).text
        for method in ("TxAllocate", "TxCommit", "TxAbort"):
            assert value(metrics, "conductor_agent_calls_total", method=method, code="OK") == 0
        assert value(metrics, "conductor_agent_calls_total", method="Generate", code="OK") == 2
        cached = value(metrics, "conductor_prompt_cache_tokens_total", source="local")
        assert cached >= 32  # the second request reused the first one's committed blocks
    assert_no_locks(agent)


async def test_tx_failures_and_lease_expiries_are_counted(start_agent: AgentFactory) -> None:
    agent = await start_agent("both", metrics_port=free_port(), capacity_blocks=4)
    async with grpc.aio.insecure_channel(agent.address) as channel:
        stub = pb_grpc.NodeAgentStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as not_found:
            await stub.TxCommit(pb.TxCommitRequest(tx_id="nobody"))
        assert not_found.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as full:
            await stub.TxAllocate(
                pb.TxAllocateRequest(
                    key_layout=KEY_LAYOUT,
                    tx_id="big",
                    tenant="t",
                    block_keys=list(range(1, 9)),
                    lease_s=30,
                )
            )
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await stub.TxAllocate(
            pb.TxAllocateRequest(
                key_layout=KEY_LAYOUT, tx_id="short", tenant="t", block_keys=[1, 2], lease_s=0.05
            )
        )
    text = await scrape(agent)
    assert value(text, "node_agent_tx_total", op="commit", outcome="not_found") == 1
    assert value(text, "node_agent_tx_total", op="allocate", outcome="capacity") == 1
    assert value(text, "node_agent_tx_total", op="allocate", outcome="ok") == 1
    # The housekeeping loop expires the lease; the next scrape shows it.
    async with asyncio.timeout(10):
        while value(text, "node_agent_lease_expiries_total") < 1:
            await asyncio.sleep(0.05)
            text = await scrape(agent)
    assert value(text, "node_agent_open_transactions") == 0
    assert_no_locks(agent)


async def test_metrics_http_server_answers_only_metrics(start_agent: AgentFactory) -> None:
    agent = await start_agent("both", metrics_port=free_port())
    assert agent.metrics_server is not None
    base = f"http://127.0.0.1:{agent.metrics_server.port}"
    async with httpx.AsyncClient(base_url=base) as client:
        head = await client.head("/metrics")
        assert head.status_code == 200
        assert head.content == b""
        assert int(head.headers["content-length"]) > 0
        om = await client.get(
            "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
        )
        assert om.headers["content-type"].startswith("application/openmetrics-text")
        assert om.text.rstrip().endswith("# EOF")
        assert (await client.get("/")).status_code == 404
        assert (await client.post("/metrics")).status_code == 405
    reader, writer = await asyncio.open_connection("127.0.0.1", agent.metrics_server.port)
    writer.write(b"garbage\r\n\r\n")
    await writer.drain()
    assert (await reader.read()).startswith(b"HTTP/1.1 400 ")
    writer.close()
    await writer.wait_closed()


async def test_no_metrics_server_by_default(start_agent: AgentFactory) -> None:
    agent = await start_agent("both")
    assert agent.metrics_server is None


async def test_a_prefix_migration_is_counted_on_both_nodes(start_agent: AgentFactory) -> None:
    from tests.integration.test_block_migration import (
        P_PROMPT,
        P_WARM,
        S_PROMPT,
        UNREACHABLE,
        alloc,
        cache_prompt,
        keys_of,
    )

    src = await start_agent("both", metrics_port=free_port(), capacity_blocks=8)
    dst = await start_agent("both", metrics_port=free_port(), capacity_blocks=8)
    async with (
        grpc.aio.insecure_channel(src.address) as src_channel,
        grpc.aio.insecure_channel(dst.address) as dst_channel,
    ):
        s, p = pb_grpc.NodeAgentStub(src_channel), pb_grpc.NodeAgentStub(dst_channel)
        await cache_prompt(s, S_PROMPT, "s-warm")
        await cache_prompt(p, P_WARM, "p-warm")
        keys = keys_of(P_PROMPT)
        await p.TxAllocate(alloc("T_dst", keys))
        lock = await s.TxAllocate(alloc("T_src", keys[:3], lock_only=True))
        pull = pb.PullBlocksRequest(
            tx_id="T_dst", source_tx_id="T_src", source_read_token=lock.read_token, num_blocks=3
        )
        pull.source_address = UNREACHABLE
        with pytest.raises(grpc.aio.AioRpcError):
            await p.PullBlocks(pull)
        pull.source_address = src.address
        pulled = await p.PullBlocks(pull)
        await s.TxCommit(pb.TxCommitRequest(tx_id="T_src"))
        await p.TxAbort(pb.TxAbortRequest(tx_id="T_dst"))
    sent, got = await scrape(src), await scrape(dst)
    assert value(sent, "node_agent_tx_total", op="lock_only", outcome="ok") == 1
    nbytes = value(sent, "node_agent_kv_transfer_bytes_total", direction="sent", kind="migration")
    assert nbytes == pulled.bytes > 0
    assert value(got, "node_agent_kv_transfer_bytes_total", direction="received",
                 kind="migration") == nbytes  # fmt: skip
    assert value(got, "node_agent_kv_transfer_failures_total", kind="migration") == 1
    assert value(got, "node_agent_kv_transfer_failures_total", kind="handoff") == 0
    assert_no_locks(src, dst)


async def test_every_request_is_counted_once_with_its_outcome(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    """``conductor_requests_total`` has one writer (the request's account): success,
    streamed or not, client errors before any engine work, and a tenant's 429."""
    agent = await start_agent("both")
    async with conductor([agent], default_requests_per_minute=5) as c:
        ok = await c.client.post("/v1/chat/completions", json=chat_body())
        assert ok.status_code == 200, ok.text
        streamed = await c.client.post(
            "/v1/completions",
            json={"model": ok.json()["model"], "prompt": "Hi", "max_tokens": 4, "stream": True},
        )
        assert streamed.status_code == 200
        assert "[DONE]" in streamed.text
        empty = await c.client.post(
            "/v1/completions",
            json={
                "model": ok.json()["model"], "prompt": "", "max_tokens": 4,
                "add_special_tokens": False,  # else the prompt is BOS alone, as in vLLM
            },
        )  # fmt: skip
        assert empty.status_code == 400, empty.text
        too_long = await c.client.post("/v1/chat/completions", json=chat_body(max_tokens=10**6))
        assert too_long.status_code == 400, too_long.text
        budget = 5 - 2  # the two that passed admission; client errors stop before the limiter
        for _ in range(budget):
            assert (
                await c.client.post("/v1/chat/completions", json=chat_body())
            ).status_code == 200
        limited = await c.client.post("/v1/chat/completions", json=chat_body())
        assert limited.status_code == 429, limited.text
        metrics = (await c.client.get("/metrics")).text
    assert request_counts(metrics) == {
        ("chat_completions", "success"): 1 + budget,
        ("completions", "success"): 1,
        ("completions", "client_error"): 1,
        ("chat_completions", "client_error"): 1,
        ("chat_completions", "rejected"): 1,
    }
    assert value(metrics, "conductor_rejections_total", reason="tenant_rate_limit") == 1
    assert value(metrics, "conductor_requests_in_flight") == 0
    assert_no_locks(agent)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_an_upstream_failure_before_the_first_token_is_counted_once(
    start_agent: AgentFactory, conductor: ConductorFactory, stream: bool
) -> None:
    from tests.integration.test_transfer_faults import STREAMED, LinkDropsAfter

    prefill = await start_agent("prefill", transport=LinkDropsAfter(chunks=0), **STREAMED)
    decode = await start_agent("decode")
    async with conductor([prefill, decode]) as c:
        body = chat_body("hello " * 80, stream=stream)
        r = await c.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 502, r.text  # admission ends before the response starts
        metrics = (await c.client.get("/metrics")).text
    assert request_counts(metrics) == {("chat_completions", "upstream_error"): 1}
    assert value(metrics, "conductor_requests_in_flight") == 0
    assert_no_locks(prefill, decode)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_an_upstream_failure_mid_generation_is_counted_once(
    start_agent: AgentFactory, conductor: ConductorFactory, stream: bool
) -> None:
    prefill, decode = await start_agent("prefill"), await start_agent("decode")
    async with conductor([prefill, decode]) as c:

        def admitted() -> bool:  # the first token reached the conductor
            text = c.state.metrics.exposition().decode()
            ttft = "conductor_time_to_first_token_seconds_count"
            return value(text, ttft, endpoint="chat_completions") == 1

        async def decode_node_dies() -> None:
            await wait_until(admitted)
            await decode.stop(grace_s=0)

        dies = asyncio.create_task(decode_node_dies())
        body = chat_body(max_tokens=4000, ignore_eos=True, stream=stream)
        r = await c.client.post("/v1/chat/completions", json=body)
        await dies
        if stream:  # after the first byte: an error event, then [DONE]
            assert r.status_code == 200
            assert '"error"' in r.text
            assert r.text.endswith("data: [DONE]\n\n")
        else:
            assert r.status_code >= 500, r.text
        metrics = (await c.client.get("/metrics")).text
    assert request_counts(metrics) == {("chat_completions", "upstream_error"): 1}
    assert value(metrics, "conductor_requests_in_flight") == 0
    assert_no_locks(prefill)


async def test_a_client_gone_during_a_json_generation_is_counted_once_as_cancelled(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both")
    async with conductor([agent]) as c:
        body = chat_body(max_tokens=4000, ignore_eos=True)
        waiting = asyncio.create_task(c.client.post("/v1/chat/completions", json=body))
        await wait_until(lambda: agent.engine.load().running_requests == 1)
        waiting.cancel()  # in-process, the request's task is the client's: it is cancelled
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await wait_until(lambda: agent.engine.load().running_requests == 0, timeout_s=1.5)
        metrics = (await c.client.get("/metrics")).text
    assert request_counts(metrics) == {("chat_completions", "cancelled"): 1}
    assert value(metrics, "conductor_requests_in_flight") == 0
    assert_no_locks(agent)


async def test_a_client_gone_before_the_first_event_is_counted_once_as_cancelled(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    """The client hangs up while the response starts, so the event stream is never
    iterated: the generation must still be cancelled, counted and its slot given back."""
    agent = await start_agent("both")
    async with conductor([agent]) as c:
        body = json.dumps(chat_body(max_tokens=4000, ignore_eos=True, stream=True)).encode()
        received: list[Message] = [
            {"type": "http.request", "body": body, "more_body": False},
            {"type": "http.disconnect"},  # at once: the response is cancelled as it starts
        ]
        sent: list[Message] = []

        async def receive() -> Message:
            return received.pop(0) if len(received) > 1 else received[0]

        async def send(message: Message) -> None:
            sent.append(message)
            await asyncio.sleep(0)  # a real transport yields to the loop

        scope: Scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 40000),
            "server": ("conductor", 80),
        }
        await c.app(scope, receive, send)
        assert [m["type"] for m in sent] == ["http.response.start"]
        await wait_until(lambda: agent.engine.load().running_requests == 0, timeout_s=1.5)
        metrics = (await c.client.get("/metrics")).text
    assert request_counts(metrics) == {("chat_completions", "cancelled"): 1}
    assert value(metrics, "conductor_requests_in_flight") == 0
    assert_no_locks(agent)
