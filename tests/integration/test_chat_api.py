"""The conductor app in-process against real node agents over gRPC on loopback."""

from __future__ import annotations

import json
from typing import Any

from tests.conftest import MODEL, AgentFactory, ConductorFactory, assert_no_locks, chat_body


def sse_events(text: str) -> list[Any]:
    events: list[Any] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def test_chat_completion_disaggregated(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    prefill = await start_agent("prefill")
    decode = await start_agent("decode")
    async with conductor([prefill, decode]) as c:
        resp = await c.client.post("/v1/chat/completions", json=chat_body(max_tokens=8))
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert list(body) == [
            "id",
            "object",
            "created",
            "model",
            "choices",
            "usage",
            "system_fingerprint",
        ]
        assert body["object"] == "chat.completion"
        assert body["id"].startswith("chatcmpl-")
        assert body["model"] == MODEL
        choice = body["choices"][0]
        assert choice["message"]["role"] == "assistant"
        assert choice["finish_reason"] in ("stop", "length")
        usage = body["usage"]
        assert usage["prompt_tokens"] > 0
        assert 1 <= usage["completion_tokens"] <= 8
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert resp.headers["x-request-id"].startswith("req-")
    assert_no_locks(prefill, decode)


async def test_request_id_is_echoed(start_agent: AgentFactory, conductor: ConductorFactory) -> None:
    agent = await start_agent("both")
    async with conductor([agent]) as c:
        resp = await c.client.post(
            "/v1/chat/completions", json=chat_body(), headers={"X-Request-Id": "abc-123"}
        )
        assert resp.headers["x-request-id"] == "abc-123"
        bad = await c.client.get("/v1/models", headers={"X-Request-Id": "bad id with spaces"})
        assert bad.headers["x-request-id"].startswith("req-")


async def test_streaming_with_usage(start_agent: AgentFactory, conductor: ConductorFactory) -> None:
    prefill = await start_agent("prefill")
    decode = await start_agent("decode")
    async with conductor([prefill, decode]) as c:
        body = chat_body(max_tokens=6, stream=True, stream_options={"include_usage": True})
        resp = await c.client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.text)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
        assert len({ch["id"] for ch in chunks}) == 1
        assert all("usage" in ch for ch in chunks)
        finals = [ch for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"]]
        assert len(finals) == 1
        usage_chunk = chunks[-1]
        assert usage_chunk["choices"] == []
        assert (
            usage_chunk["usage"]["completion_tokens"] == 6
            or finals[0]["choices"][0]["finish_reason"] == "stop"
        )
        plain = await c.client.post("/v1/chat/completions", json=chat_body(stream=True))
        assert all("usage" not in ch for ch in sse_events(plain.text)[:-1])
    assert_no_locks(prefill, decode)


async def test_greedy_output_identical_across_recompute_reuse_and_transfer(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    """Full recompute (colocated), P/D transfer, and a reused prefix give the same tokens."""
    long_system = "You are a careful assistant. " * 12
    body = chat_body(
        "Tell me about the weather in spring.",
        max_tokens=16,
        messages=[
            {"role": "system", "content": long_system},
            {"role": "user", "content": "Tell me about the weather in spring."},
        ],
    )
    both = await start_agent("both")
    async with conductor([both]) as c:
        colocated = (await c.client.post("/v1/chat/completions", json=body)).json()
    prefill = await start_agent("prefill")
    decode = await start_agent("decode")
    async with conductor([prefill, decode]) as c:
        cold = (await c.client.post("/v1/chat/completions", json=body)).json()
        warm = (await c.client.post("/v1/chat/completions", json=body)).json()
    text = colocated["choices"][0]["message"]["content"]
    assert text, "the model produced no text"
    assert cold["choices"][0]["message"]["content"] == text
    assert warm["choices"][0]["message"]["content"] == text
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert cached % 32 == 0
    assert cached < warm["usage"]["prompt_tokens"]
    assert_no_locks(both, prefill, decode)


async def test_colocated_node_reuses_its_prefix(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both")
    body = chat_body("A question about gardens and the plants that grow in them. " * 4)
    async with conductor([agent]) as c:
        first = (await c.client.post("/v1/chat/completions", json=body)).json()
        second = (await c.client.post("/v1/chat/completions", json=body)).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert first["choices"][0]["message"] == second["choices"][0]["message"]
    assert_no_locks(agent)


async def test_stop_sequence_and_max_tokens(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both")
    async with conductor([agent]) as c:
        base = (
            await c.client.post(
                "/v1/chat/completions", json=chat_body(max_tokens=24, ignore_eos=True)
            )
        ).json()
        text = base["choices"][0]["message"]["content"]
        assert base["choices"][0]["finish_reason"] in ("length", "stop")
        visible = text.strip()
        assert len(visible) >= 4, f"24 tokens gave too little text: {text!r}"
        stop = visible[len(visible) // 2 : len(visible) // 2 + 2]
        cut = (
            await c.client.post(
                "/v1/chat/completions", json=chat_body(max_tokens=24, ignore_eos=True, stop=[stop])
            )
        ).json()
        assert cut["choices"][0]["finish_reason"] == "stop"
        assert stop not in cut["choices"][0]["message"]["content"]
        assert text.startswith(cut["choices"][0]["message"]["content"])


async def test_legacy_completions(start_agent: AgentFactory, conductor: ConductorFactory) -> None:
    agent = await start_agent("both")
    async with conductor([agent]) as c:
        resp = await c.client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0},
        )
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["object"] == "text_completion"
        assert body["usage"]["completion_tokens"] <= 5
        # A text prompt gets the tokenizer's special tokens (BOS), as vLLM adds them, and
        # /tokenize counts exactly that.
        ids = c.state.tokenizer.encode("Once upon a time", add_special_tokens=True)
        assert ids[0] != c.state.tokenizer.encode("Once upon a time")[0]
        assert body["usage"]["prompt_tokens"] == len(ids)
        counted = await c.client.post("/tokenize", json={"prompt": "Once upon a time"})
        assert counted.json()["tokens"] == ids
        bare = await c.client.post(
            "/v1/completions",
            json={
                "model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0,
                "add_special_tokens": False,
            },
        )  # fmt: skip
        assert bare.json()["usage"]["prompt_tokens"] == len(ids) - 1
        by_ids = await c.client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": ids, "max_tokens": 5, "temperature": 0},
        )
        assert by_ids.json()["choices"][0]["text"] == body["choices"][0]["text"]
        streamed = await c.client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": ids, "max_tokens": 5, "temperature": 0, "stream": True},
        )
        events = sse_events(streamed.text)
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
        assert text == body["choices"][0]["text"]
    assert_no_locks(agent)


async def test_models_health_ready_metrics(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    prefill = await start_agent("prefill")
    decode = await start_agent("decode")
    async with conductor([prefill, decode]) as c:
        models = (await c.client.get("/v1/models")).json()
        assert models["object"] == "list"
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert (await c.client.get(f"/v1/models/{MODEL}")).json()["id"] == MODEL
        assert (await c.client.get("/health")).json() == {"status": "ok"}
        ready = await c.client.get("/ready")
        assert ready.status_code == 200
        assert {a["role"] for a in ready.json()["agents"]} == {"prefill", "decode"}
        await c.client.post("/v1/chat/completions", json=chat_body())
        metrics = (await c.client.get("/metrics")).text
        assert 'conductor_requests_total{endpoint="chat_completions",outcome="success"} 1.0' in (
            metrics
        )
        assert "conductor_time_to_first_token_seconds_bucket" in metrics
        assert 'conductor_agents_usable{role="prefill"} 1.0' in metrics
        # prometheus_client's standard process and runtime families, beside our own
        assert "\nprocess_resident_memory_bytes " in metrics
        assert "\npython_info{" in metrics


async def test_not_ready_without_agents(conductor: ConductorFactory) -> None:
    async with conductor([]) as c:
        ready = await c.client.get("/ready")
        assert ready.status_code == 503
        assert ready.json()["error"]["type"] == "server_error"
        resp = await c.client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code == 503
        assert "retry-after" in resp.headers
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


async def test_logit_bias_and_penalties_reach_the_embedded_engine(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    """The embedded engine applies OpenAI's logit_bias and penalties: +100 forces a token
    at every greedy step, -100 keeps the greedy first token out, and a frequency penalty
    changes which of two forced tokens greedy takes."""
    agent = await start_agent("both")
    async with conductor([agent]) as c:
        tokenizer = c.state.tokenizer
        forced = tokenizer.encode(" apple")[-1]

        async def complete(**fields: Any) -> tuple[str, int]:
            resp = await c.client.post(
                "/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": "Once upon a time",
                    "max_tokens": 6,
                    "temperature": 0,
                    "ignore_eos": True,
                    **fields,
                },
            )
            assert resp.status_code == 200, resp.text
            body = resp.json()
            return body["choices"][0]["text"], body["usage"]["completion_tokens"]

        text, n = await complete(logit_bias={str(forced): 100})
        assert n == 6
        assert tokenizer.encode(text) == tokenizer.encode(tokenizer.decode([forced] * 6))
        plain, _ = await complete()
        first = tokenizer.encode(plain)[0]
        banned, _ = await complete(logit_bias={str(first): -100})
        assert banned != plain
        assert not tokenizer.encode(banned) or tokenizer.encode(banned)[0] != first
        # Two tokens biased by +100 leave the rest far behind; which of them greedy
        # takes depends on the context, and a frequency penalty of 2 per use (up to 22
        # over 12 tokens) moves that choice (the model's weights are seeded: the same
        # run everywhere).
        other = tokenizer.encode(" banana")[-1]
        pair = {str(forced): 100, str(other): 100}
        repeated, _ = await complete(logit_bias=pair, max_tokens=12)
        spread, _ = await complete(logit_bias=pair, max_tokens=12, frequency_penalty=2)
        allowed = set(tokenizer.decode([forced]) + tokenizer.decode([other]))
        assert set(repeated) <= allowed, repeated
        assert set(spread) <= allowed, spread
        assert repeated != spread
    assert_no_locks(agent)


async def test_stop_token_ids_and_min_tokens_on_the_embedded_engine(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both")
    async with conductor([agent]) as c:
        ids = c.state.tokenizer.encode("Once upon a time")
        base = {"model": MODEL, "prompt": ids, "max_tokens": 6, "temperature": 0}
        plain = (await c.client.post("/v1/completions", json=base)).json()
        first = c.state.tokenizer.encode(plain["choices"][0]["text"])[0]
        stopped = (
            await c.client.post("/v1/completions", json={**base, "stop_token_ids": [first]})
        ).json()
        assert stopped["choices"][0]["finish_reason"] == "stop"
        assert stopped["usage"]["completion_tokens"] == 1  # the stop token, not returned
        assert stopped["choices"][0]["text"] == ""
        held = (
            await c.client.post(
                "/v1/completions", json={**base, "stop_token_ids": [first], "min_tokens": 4}
            )
        ).json()
        assert held["usage"]["completion_tokens"] >= 4  # the stop id was banned until then
    assert_no_locks(agent)


async def test_placement_headers_name_the_serving_nodes_only_when_enabled(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    prefill = await start_agent("prefill")
    decode = await start_agent("decode")
    async with conductor([prefill, decode]) as c:  # off by default: no topology leaks
        resp = await c.client.post("/v1/chat/completions", json=chat_body(max_tokens=4))
        assert resp.status_code == 200, resp.text
        assert "x-kvc-prefill-node" not in resp.headers
        assert "x-kvc-decode-node" not in resp.headers
    async with conductor([prefill, decode], placement_headers=True) as c:
        for body in (chat_body(max_tokens=4), chat_body(max_tokens=4, stream=True)):
            resp = await c.client.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kvc-prefill-node"] == prefill.address
            assert resp.headers["x-kvc-decode-node"] == decode.address
        completion = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 2}
        resp = await c.client.post("/v1/completions", json=completion)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-kvc-prefill-node"] == prefill.address
        refused = await c.client.post("/v1/chat/completions", json=chat_body(max_tokens=0))
        assert refused.status_code == 400
        assert "x-kvc-prefill-node" not in refused.headers
    assert_no_locks(prefill, decode)
