"""Logprobs on the embedded engine, end to end: chat (streamed and not) and legacy
completions, in OpenAI's shapes."""

from __future__ import annotations

import json
import math
from typing import Any

from tests.conftest import AgentFactory, ConductorFactory, assert_no_locks, chat_body

MODEL = "tiny-llama"


async def test_chat_logprobs_streamed_and_not(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both")
    ask = chat_body(
        "Count the lighthouses.",
        max_tokens=6,
        temperature=0,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=3,
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
            assert [t["logprob"] for t in tops] == sorted(
                (t["logprob"] for t in tops), reverse=True
            )
            assert sum(math.exp(t["logprob"]) for t in tops) <= 1.0 + 1e-5
            # Greedy on the raw logits: the token taken is the most likely one.
            assert entry["token"] == tops[0]["token"]
            assert math.isclose(entry["logprob"], tops[0]["logprob"], abs_tol=1e-5)
            assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
        text = choice["message"]["content"]
        joined = b"".join(bytes(e["bytes"]) for e in content).decode("utf-8", "replace")
        assert joined.startswith(text) or text in joined  # special tokens leave no text

        streamed: list[dict[str, Any]] = []
        async with c.client.stream(
            "POST", "/v1/chat/completions", json={**ask, "stream": True}
        ) as s:
            async for line in s.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for ch in json.loads(line[6:])["choices"]:
                        if ch.get("logprobs"):
                            streamed += ch["logprobs"]["content"]
        assert streamed == content

        plain = await c.client.post("/v1/chat/completions", json=chat_body("hi", max_tokens=2))
        assert plain.json()["choices"][0]["logprobs"] is None
    assert_no_locks(agent)


async def test_completion_logprobs_are_parallel_lists(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both")
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 2,
    }
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
        streamed: list[float] = []
        async with c.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            async for line in s.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for ch in json.loads(line[6:])["choices"]:
                        if ch.get("logprobs"):
                            streamed += ch["logprobs"]["token_logprobs"]
        assert streamed == lp["token_logprobs"]
    assert_no_locks(agent)
