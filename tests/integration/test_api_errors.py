"""Bad input gets the right status and the OpenAI error envelope; nothing leaks."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.conftest import MODEL, AgentFactory, ConductorFactory, assert_no_locks, chat_body


def envelope(resp: Any) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    err: dict[str, Any] = body["error"]
    return err


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, 400, "model", None),
        ({"model": MODEL}, 400, "messages", None),
        ({"model": MODEL, "messages": []}, 400, "messages", None),
        (chat_body(temperature=5), 400, "temperature", None),
        (chat_body(top_p=0), 400, "top_p", None),
        (chat_body(max_tokens=0), 400, "max_tokens", None),
        (chat_body(stop=["a", "b", "c", "d", "e"]), 400, "stop", None),
        (chat_body(stream_options={"include_usage": True}), 400, "stream_options", None),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, None, None),
        (chat_body(model="gpt-9"), 404, "model", "model_not_found"),
        (chat_body(n=17), 422, "n", "unsupported_value"),
        (chat_body(n=0), 400, "n", None),
        (chat_body(top_logprobs=2), 400, "top_logprobs", None),  # needs logprobs: true
        (chat_body(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
        (
            chat_body(
                tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required"
            ),
            422,
            "tool_choice",
            "unsupported_value",
        ),
        # The embedded engine has no guided decoding: structured output is refused.
        (chat_body(response_format={"type": "json_object"}), 422, "response_format", None),
        (
            chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
            422,
            "response_format",
            "unsupported_value",
        ),
        (chat_body(max_tokens=10_000_000), 400, "messages", "context_length_exceeded"),
    ],
)
async def test_chat_bad_requests(
    start_agent: AgentFactory,
    conductor: ConductorFactory,
    body: dict[str, Any],
    status: int,
    param: str | None,
    code: str | None,
) -> None:
    agent = await start_agent("both")
    async with conductor([agent]) as c:
        resp = await c.client.post("/v1/chat/completions", json=body)
        assert resp.status_code == status, resp.text
        err = envelope(resp)
        assert err["type"] == "invalid_request_error"
        if param is not None:
            assert err["param"] is not None
            assert err["param"].startswith(param), err
        if code is not None:
            assert err["code"] == code
        assert resp.headers["x-request-id"]
    assert_no_locks(agent)


async def test_malformed_json_and_wrong_content(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both")
    async with conductor([agent]) as c:
        resp = await c.client.post(
            "/v1/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        assert resp.status_code == 400
        envelope(resp)
        resp = await c.client.post("/v1/chat/completions", json=["a", "list"])
        assert resp.status_code == 400
        envelope(resp)
        too_long = chat_body("word " * 5000)
        resp = await c.client.post("/v1/chat/completions", json=too_long)
        assert resp.status_code == 400
        assert envelope(resp)["code"] == "context_length_exceeded"
        parts = chat_body(messages=[{"role": "user", "content": [{"type": "image_url"}]}])
        resp = await c.client.post("/v1/chat/completions", json=parts)
        assert resp.status_code == 400
        assert envelope(resp)["param"] == "messages"
    assert_no_locks(agent)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", chat_body(seed=2**64), "seed"),
        ("/v1/chat/completions", chat_body(seed=-(2**63) - 1), "seed"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "seed": 2**64}, "seed"),
        ("/v1/chat/completions", chat_body(tools=[1]), "tools[0]"),
        ("/v1/chat/completions", chat_body(tools=[None]), "tools[0]"),
        ("/v1/chat/completions", chat_body(tools=["abc"]), "tools[0]"),
        ("/v1/chat/completions", chat_body("a\ud800b"), "messages[0].content"),
        (
            "/v1/chat/completions",
            chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]),
            "messages[0].content[0].text",
        ),
        ("/v1/chat/completions", chat_body(stop=["ok", "\ud83d"]), "stop[1]"),
        ("/v1/completions", {"model": MODEL, "prompt": "a\ud800b"}, "prompt"),
        ("/tokenize", {"model": MODEL, "prompt": "\ud800"}, "prompt"),
    ],
)
async def test_bad_values_are_400_never_500(
    start_agent: AgentFactory,
    conductor: ConductorFactory,
    path: str,
    body: dict[str, Any],
    param: str,
) -> None:
    """Values that once reached a 500 or a reset connection: a seed outside vLLM's
    signed 64-bit range, tools that are not objects, text with a lone UTF-16
    surrogate (valid JSON, invalid Unicode; sent as the escape a client's encoder
    writes)."""
    agent = await start_agent("both")
    async with conductor([agent]) as c:
        raw = json.dumps(body, ensure_ascii=True)
        resp = await c.client.post(path, content=raw, headers={"content-type": "application/json"})
        assert resp.status_code == 400, resp.text
        assert envelope(resp)["param"] == param
    assert_no_locks(agent)


async def test_signed_seed_is_honoured(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    """A negative seed (vLLM takes any signed 64-bit seed) samples reproducibly."""
    agent = await start_agent("both")
    async with conductor([agent]) as c:
        texts = set()
        for _ in range(2):
            body = chat_body(seed=-1, temperature=1.0, max_tokens=8)
            resp = await c.client.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            texts.add(resp.json()["choices"][0]["message"]["content"])
        assert len(texts) == 1
    assert_no_locks(agent)


async def test_maximal_body_is_refused_by_size_and_never_starves_health(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    """A chat body just under the 8 MiB limit that cannot fit the context is refused
    from its length, before tokenizing it (which took seconds with the GIL held and
    froze /health past a liveness probe's 3 s timeout)."""
    agent = await start_agent("both")
    async with conductor([agent]) as c:
        body = chat_body("hello world " * 690_000)
        assert 7 * 2**20 < len(json.dumps(body)) < 8 * 2**20
        worst = 0.0
        probes = 0
        sending = asyncio.Event()

        async def probe() -> None:
            nonlocal worst, probes
            sending.set()
            while probes < 3 or not sent.done():
                started = time.perf_counter()
                resp = await c.client.get("/health")
                assert resp.status_code == 200
                worst = max(worst, time.perf_counter() - started)
                probes += 1
                await asyncio.sleep(0.01)

        async def send() -> Any:
            await sending.wait()
            return await c.client.post("/v1/chat/completions", json=body)

        sent = asyncio.ensure_future(send())
        await probe()
        resp = sent.result()
        assert resp.status_code == 400, resp.text
        err = envelope(resp)
        assert err["code"] == "context_length_exceeded"
        assert "at least" in err["message"]
        assert worst < 3.0  # a liveness probe's timeout (kvc probe)
    assert_no_locks(agent)


async def test_unknown_path_and_method(conductor: ConductorFactory) -> None:
    async with conductor([]) as c:
        resp = await c.client.get("/v1/nope")
        assert resp.status_code == 404
        assert envelope(resp)["type"] == "invalid_request_error"
        resp = await c.client.get("/v1/chat/completions")
        assert resp.status_code == 405
        envelope(resp)
        resp = await c.client.get("/v1/models/gpt-9")
        assert resp.status_code == 404
        assert envelope(resp)["code"] == "model_not_found"


async def test_body_too_large(conductor: ConductorFactory) -> None:
    async with conductor([], max_request_bytes=2048) as c:
        resp = await c.client.post("/v1/chat/completions", json=chat_body("x" * 4096))
        assert resp.status_code == 413
        assert envelope(resp)["code"] == "request_too_large"
        assert resp.headers["x-request-id"]

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length to refuse by
            for _ in range(8):
                yield b"x" * 1024

        resp = await c.client.post("/v1/chat/completions", content=chunked())
        assert resp.status_code == 413, resp.text
        assert envelope(resp)["code"] == "request_too_large"


async def test_api_keys(start_agent: AgentFactory, conductor: ConductorFactory) -> None:
    agent = await start_agent("both")
    async with conductor([agent], api_keys=["sk-good"]) as c:
        resp = await c.client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code == 401
        assert envelope(resp)["code"] == "invalid_api_key"
        resp = await c.client.get("/v1/models", headers={"Authorization": "Bearer sk-bad"})
        assert resp.status_code == 401
        resp = await c.client.post(
            "/v1/chat/completions",
            json=chat_body(),
            headers={"Authorization": "Bearer sk-good"},
        )
        assert resp.status_code == 200
        assert (await c.client.get("/health")).status_code == 200
    assert_no_locks(agent)


async def test_overload_is_429_with_retry_after_and_no_agent_work(
    start_agent: AgentFactory, conductor: ConductorFactory, caplog: pytest.LogCaptureFixture
) -> None:
    agent = await start_agent("both")
    async with conductor([agent], max_inflight_requests=1) as c:
        c.state.inflight = 1  # one request already in flight on this conductor
        before = agent.service.pool.stats()
        resp = await c.client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code == 429
        assert int(resp.headers["retry-after"]) >= 1
        err = envelope(resp)
        assert err["type"] == "requests"
        assert err["code"] == "rate_limit_exceeded"
        assert agent.service.pool.stats() == before
        assert agent.engine.load().running_requests == 0
        c.state.inflight = 0
        metrics = (await c.client.get("/metrics")).text
        assert 'conductor_rejections_total{reason="conductor_overloaded"} 1.0' in metrics
    # The refusal is logged with its reason and the figures behind it.
    logged = [r.getMessage() for r in caplog.records if r.name == "conductor.dispatch"]
    assert any("conductor_overloaded" in m and "max_inflight_requests 1" in m for m in logged)


async def test_node_out_of_capacity_is_429_and_leaks_nothing(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both", capacity_blocks=2)
    async with conductor([agent]) as c:
        resp = await c.client.post("/v1/chat/completions", json=chat_body("many words " * 60))
        assert resp.status_code == 429
        assert "retry-after" in resp.headers
        assert envelope(resp)["code"] == "rate_limit_exceeded"
        ok = await c.client.post("/v1/chat/completions", json=chat_body("short"))
        assert ok.status_code == 200
    assert_no_locks(agent)


async def test_agent_dies_before_request_is_503(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both")
    async with conductor([agent], rpc_timeout_s=2.0) as c:
        await agent.stop(grace_s=0.1)
        resp = await c.client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code == 503
        assert "retry-after" in resp.headers
        envelope(resp)


async def test_a_role_with_no_agent_is_503_not_429(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    """Only a prefill node: nothing to wait for, so 503 with Retry-After (it was a 429
    insufficient_capacity, which tells a client the fleet is merely busy)."""
    prefill = await start_agent("prefill")
    async with conductor([prefill]) as c:
        resp = await c.client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code == 503, resp.text
        assert float(resp.headers["retry-after"]) > 0
        assert envelope(resp)["code"] == "service_unavailable"
    assert_no_locks(prefill)


async def test_a_body_that_does_not_arrive_is_408(conductor: ConductorFactory) -> None:
    """A client that sends part of a body and stalls held its connection (and a task)
    for ever; now it gets 408 after body_timeout_s."""

    async def trickle() -> AsyncIterator[bytes]:
        yield b'{"model": "tiny-llama", "messages": ['
        await asyncio.Event().wait()  # the rest never comes
        yield b"]}"

    async with conductor([], body_timeout_s=0.3) as c:
        started = time.perf_counter()
        resp = await c.client.post(
            "/v1/chat/completions",
            content=trickle(),
            headers={"content-type": "application/json"},
        )
        assert resp.status_code == 408, resp.text
        assert envelope(resp)["code"] == "request_timeout"
        assert time.perf_counter() - started < 10
        # A body that arrives in time is not affected by the deadline afterwards.
        ok = await c.client.post("/v1/chat/completions", json=chat_body(model="gpt-9"))
        assert ok.status_code == 404
