"""Anthropic's Messages API with the official ``anthropic`` SDK, unchanged, against the
conductor and a real agent (embedded engine): the same answer as the chat route for the
same conversation, streamed and not, prefix-cache reads in usage, ``x-api-key`` auth,
and errors in Anthropic's shape (tool use: tests/integration/test_vllm_pd.py)."""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any, cast

import anthropic
import pytest
from anthropic import AsyncAnthropic

from tests.conftest import MODEL, AgentFactory, ConductorFactory, assert_no_locks, over_http

SYSTEM = "You are a terse assistant."
QUESTION = "Name three things a lighthouse keeper does every night. " * 4


def sdk(base_url: str, api_key: str = "unused") -> AsyncAnthropic:
    # The SDK brings its own HTTP stack (an httpx fork): the app serves it on a real port.
    return AsyncAnthropic(base_url=base_url, api_key=api_key, max_retries=0)


async def test_the_sdk_gets_the_chat_routes_answer_streamed_and_not(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both")
    async with conductor([agent]) as c, over_http(c.app) as base, AsyncExitStack() as stack:
        chat = await c.client.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": QUESTION}]})  # fmt: skip
        expected = chat.json()["choices"][0]["message"]["content"]
        prompt_tokens = chat.json()["usage"]["prompt_tokens"]
        client = await stack.enter_async_context(sdk(base))
        ask: dict[str, Any] = {"model": MODEL, "max_tokens": 12, "system": SYSTEM,
                               "messages": [{"role": "user", "content": QUESTION}],
                               # the SDK of 2026 dropped sampling parameters; the API
                               # (and vLLM's) still takes them
                               "extra_body": {"temperature": 0}}  # fmt: skip
        reply = await client.messages.create(**ask)
        assert reply.type == "message"
        assert reply.role == "assistant"
        assert reply.model == MODEL
        assert reply.id.startswith("msg_")
        assert [b.type for b in reply.content] == ["text"]
        assert reply.content[0].text == expected
        assert reply.stop_reason in ("end_turn", "max_tokens")
        usage = reply.usage
        assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == prompt_tokens
        assert (usage.cache_read_input_tokens or 0) > 0  # the chat request cached the prefix
        assert usage.cache_creation_input_tokens == 0

        async with client.messages.stream(**ask) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert text == expected
        assert final.content[0].text == expected  # type: ignore[union-attr]
        assert final.stop_reason == reply.stop_reason
        assert final.usage.output_tokens == reply.usage.output_tokens

        # The raw events, in Anthropic's order and framing.
        plain = {k: v for k, v in ask.items() if k != "extra_body"} | ask["extra_body"]
        raw = await c.client.post("/v1/messages", json={**plain, "stream": True})
        kinds = [line.removeprefix("event: ") for line in raw.text.splitlines()
                 if line.startswith("event: ")]  # fmt: skip
        assert kinds[0] == "message_start"
        assert kinds[1:3] == ["content_block_start", "content_block_delta"]
        assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        assert "[DONE]" not in raw.text
    assert_no_locks(agent)


async def test_a_multi_turn_conversation_reads_its_prefix_from_the_cache_with_an_api_key(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both")
    async with (
        conductor([agent], api_keys=["sk-ant-test"]) as c,
        over_http(c.app) as base,
        AsyncExitStack() as stack,
    ):
        async with sdk(base, "wrong") as wrong:
            with pytest.raises(anthropic.AuthenticationError) as denied:
                await wrong.messages.create(
                    model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
                )
        assert denied.value.status_code == 401
        assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        client = await stack.enter_async_context(sdk(base, "sk-ant-test"))  # x-api-key
        turns: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
        first = await client.messages.create(model=MODEL, max_tokens=8, system=SYSTEM,
                                             messages=cast(Any, turns))  # fmt: skip
        turns += [{"role": "assistant", "content": first.content[0].text},  # type: ignore[union-attr]
                  {"role": "user", "content": "And in the morning?"}]  # fmt: skip
        second = await client.messages.create(model=MODEL, max_tokens=8, system=SYSTEM,
                                              messages=cast(Any, turns))  # fmt: skip
        assert (second.usage.cache_read_input_tokens or 0) >= 32  # the first turn's blocks
    assert_no_locks(agent)


@pytest.mark.parametrize(
    ("body", "status", "kind", "needle"),
    [
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, 400,
         "invalid_request_error", "max_tokens"),
        ({"model": "claude-9", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
         404, "not_found_error", "claude-9"),
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]},
         400, "invalid_request_error", "role"),
        ({"model": MODEL, "max_tokens": 4, "temperature": 1.5,
          "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error",
         "temperature"),
        ({"model": MODEL, "max_tokens": 4, "stop_sequences": ["a", "b", "c", "d", "e"],
          "messages": [{"role": "user", "content": "x"}]}, 422, "invalid_request_error",
         "stop_sequences"),
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}]},
         400, "invalid_request_error", "'5m' or '1h'"),
        ({"model": MODEL, "max_tokens": 4, "system": [
            {"type": "text", "text": "x", "cache_control": {"type": "persistent"}}],
          "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error",
         "ephemeral"),
        ({"model": MODEL, "max_tokens": 4, "system": [
            {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}] * 5,
          "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error",
         "A maximum of 4 blocks with cache_control"),
        ({"model": MODEL, "max_tokens": 4, "system": [
            {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "y", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
          "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error",
         "a longer TTL may not follow a shorter one"),
        ({"model": MODEL, "max_tokens": 4, "output_config": {"effort": "low"},
          "messages": [{"role": "user", "content": "x"}]}, 422, "invalid_request_error",
         "output_config"),
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AA=="}}]}]},
         422, "invalid_request_error", "image"),
        ({"model": MODEL, "max_tokens": 10_000_000, "messages": [{"role": "user", "content": "x"}]},
         400, "invalid_request_error", "context length"),
    ],
)  # fmt: skip
async def test_errors_come_in_anthropics_shape(
    start_agent: AgentFactory,
    conductor: ConductorFactory,
    body: dict[str, Any],
    status: int,
    kind: str,
    needle: str,
) -> None:
    agent = await start_agent("both")
    async with conductor([agent]) as c:
        resp = await c.client.post("/v1/messages", json=body)
        assert resp.status_code == status, resp.text
        error = resp.json()
        assert error["type"] == "error"
        assert set(error["error"]) == {"type", "message"}
        assert error["error"]["type"] == kind
        assert needle in error["error"]["message"]
        assert error["request_id"] == resp.headers["x-request-id"]
    assert_no_locks(agent)


async def test_a_matched_stop_sequence_is_reported_as_anthropic_does(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both")
    async with conductor([agent]) as c, over_http(c.app) as base, sdk(base) as client:
        ask: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": 24,
            "extra_body": {"temperature": 0.0},
            "messages": [{"role": "user", "content": QUESTION}],
        }
        free = await client.messages.create(**ask)
        text = "".join(b.text for b in free.content if b.type == "text")
        assert len(text) >= 8, text
        stop = text[4:7]  # it occurs first at 4 or earlier
        expected = text[: text.index(stop)]
        stopped = await client.messages.create(**ask, stop_sequences=["never-said-zz", stop])
        assert stopped.stop_reason == "stop_sequence"
        assert stopped.stop_sequence == stop
        assert "".join(b.text for b in stopped.content if b.type == "text") == expected
        async with client.messages.stream(**ask, stop_sequences=[stop]) as stream:
            final = await stream.get_final_message()
        assert final.stop_reason == "stop_sequence"
        assert final.stop_sequence == stop
        # Ended by its length: no stop sequence.
        assert free.stop_reason == "max_tokens"
        assert free.stop_sequence is None
    assert_no_locks(agent)
