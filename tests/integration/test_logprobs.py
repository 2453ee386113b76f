"""Logprobs on the embedded engine, end to end: chat (streamed and not) and legacy
completions, in OpenAI's shapes."""

from __future__ import annotations

import math

from tests.conftest import (
    AgentFactory,
    ConductorFactory,
    assert_no_locks,
    chat_body,
    completion_body,
    streamed_events,
)


async def test_chat_logprobs_streamed_and_not(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both")
    ask = chat_body(
        "Count the lighthouses.", max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=3
    )
    async with conductor([agent]) as c:
        r = await c.client.post("/v1/chat/completions", json=ask)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        content = choice["logprobs"]["content"]
        assert len(content) == r.json()["usage"]["completion_tokens"] == 6
        for entry in content:
            tops = entry["top_logprobs"]
            assert len(tops) == 3
            values = [t["logprob"] for t in tops]
            assert values == sorted(values, reverse=True)
            assert sum(math.exp(v) for v in values) <= 1.0 + 1e-5
            # Greedy on the raw logits: the token taken is the most likely one.
            assert entry["token"] == tops[0]["token"]
            assert math.isclose(entry["logprob"], tops[0]["logprob"], abs_tol=1e-5)
            assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
        text = choice["message"]["content"]
        joined = b"".join(bytes(e["bytes"]) for e in content).decode("utf-8", "replace")
        assert joined.startswith(text) or text in joined  # special tokens leave no text

        events = await streamed_events(c.client, "/v1/chat/completions", ask)
        streamed = [
            entry
            for event in events
            for ch in event["choices"]
            if ch.get("logprobs")
            for entry in ch["logprobs"]["content"]
        ]
        assert streamed == content

        plain = await c.client.post("/v1/chat/completions", json=chat_body("hi", max_tokens=2))
        assert plain.json()["choices"][0]["logprobs"] is None
    assert_no_locks(agent)


async def test_completion_logprobs_are_parallel_lists(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both")
    body = completion_body(max_tokens=5, ignore_eos=True, logprobs=2)
    async with conductor([agent]) as c:
        r = await c.client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
        assert all(len(top) <= 2 for top in lp["top_logprobs"])
        offsets = lp["text_offset"]
        assert offsets[0] == 0
        steps = zip(offsets[:-1], offsets[1:], lp["tokens"][:-1], strict=True)
        assert all(b - a == len(t) for a, b, t in steps)
        events = await streamed_events(c.client, "/v1/completions", body)
        streamed = [
            value
            for event in events
            for ch in event["choices"]
            if ch.get("logprobs")
            for value in ch["logprobs"]["token_logprobs"]
        ]
        assert streamed == lp["token_logprobs"]
    assert_no_locks(agent)
