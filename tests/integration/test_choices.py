"""OpenAI's ``n``: several choices of one request, each its own generation on the fleet,
streamed interleaved by index or answered together; usage counts the prompt once."""

from __future__ import annotations

from typing import Any

from tests.conftest import (
    AgentFactory,
    ConductorFactory,
    assert_no_locks,
    chat_body,
    completion_body,
    streamed_events,
    wait_until,
)


async def test_chat_choices_streamed_and_not(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both")
    ask = chat_body(
        "Tell me about lighthouses.", max_tokens=5, ignore_eos=True, n=3, seed=11, temperature=1.0
    )
    async with conductor([agent]) as c:
        r = await c.client.post("/v1/chat/completions", json=ask)
        assert r.status_code == 200, r.text
        answer = r.json()
        choices = answer["choices"]
        assert [ch["index"] for ch in choices] == [0, 1, 2]
        assert all(ch["finish_reason"] == "length" for ch in choices)
        texts = [ch["message"]["content"] for ch in choices]
        assert len(set(texts)) > 1  # seed + i per choice: not all alike
        usage = answer["usage"]
        assert usage["completion_tokens"] == 15
        single = await c.client.post("/v1/chat/completions", json={**ask, "n": 1, "max_tokens": 5})
        assert usage["prompt_tokens"] == single.json()["usage"]["prompt_tokens"]  # once
        # Choice 0 with the request's seed is the n=1 answer with that seed.
        assert texts[0] == single.json()["choices"][0]["message"]["content"]

        streamed: dict[int, str] = {}
        finishes: dict[int, str] = {}
        roles: list[int] = []
        body = {**ask, "stream_options": {"include_usage": True}}
        events = await streamed_events(c.client, "/v1/chat/completions", body)
        final_usage: dict[str, Any] | None = events[-1]["usage"]
        for event in events:
            for ch in event["choices"]:
                if ch["delta"].get("role"):
                    roles.append(ch["index"])
                text = ch["delta"].get("content") or ""
                streamed[ch["index"]] = streamed.get(ch["index"], "") + text
                if ch["finish_reason"]:
                    finishes[ch["index"]] = ch["finish_reason"]
        assert roles == [0, 1, 2]
        assert [streamed[i] for i in range(3)] == texts  # seeded: the same answers
        assert finishes == {0: "length", 1: "length", 2: "length"}
        assert final_usage is not None
        assert final_usage["completion_tokens"] == 15
    assert_no_locks(agent)


async def test_completion_choices_with_logprobs(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both")
    body = completion_body(max_tokens=4, n=2, ignore_eos=True, logprobs=1)
    async with conductor([agent]) as c:
        r = await c.client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [ch["index"] for ch in choices] == [0, 1]
        assert choices[0]["text"] == choices[1]["text"]  # greedy: alike
        assert all(len(ch["logprobs"]["tokens"]) == 4 for ch in choices)
        assert r.json()["usage"]["completion_tokens"] == 8
    assert_no_locks(agent)


async def test_a_choice_that_cannot_start_fails_the_request_and_leaks_nothing(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both", max_running=2)  # room for two of the three
    async with conductor([agent], max_waiting_requests=0) as c:
        r = await c.client.post(
            "/v1/chat/completions", json=chat_body("hi", max_tokens=4, n=3, ignore_eos=True)
        )
        # The third choice finds no decode slot (no queue here): the whole request is
        # refused, and the two choices that had started are closed.
        assert r.status_code == 429, r.text
        assert r.headers["x-kvc-reject-reason"] == "no_decode_node"
        await wait_until(lambda: agent.engine.load().running_requests == 0)
    assert_no_locks(agent)


async def test_best_of_answers_the_most_likely_and_echo_leads_with_the_prompt(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both")
    body = completion_body(max_tokens=4, temperature=1.0, seed=5, ignore_eos=True)
    async with conductor([agent]) as c:
        many = await c.client.post("/v1/completions", json={**body, "n": 4, "logprobs": 0})
        ranked = sorted(
            many.json()["choices"],
            key=lambda ch: sum(ch["logprobs"]["token_logprobs"]) / 4,
            reverse=True,
        )
        best = await c.client.post("/v1/completions", json={**body, "best_of": 4, "n": 2})
        assert best.status_code == 200, best.text
        answer = best.json()
        # The same four seeded generations, the two most likely answered, best first.
        assert [ch["text"] for ch in answer["choices"]] == [ch["text"] for ch in ranked[:2]]
        assert [ch["index"] for ch in answer["choices"]] == [0, 1]
        assert all(ch["logprobs"] is None for ch in answer["choices"])  # not asked for
        assert answer["usage"]["completion_tokens"] == 16  # every generation counts

        echoed = await c.client.post("/v1/completions", json={**body, "echo": True})
        plain = await c.client.post("/v1/completions", json=body)
        assert echoed.json()["choices"][0]["text"] == (
            "Once upon a time" + plain.json()["choices"][0]["text"]
        )
        events = await streamed_events(c.client, "/v1/completions", {**body, "echo": True})
        text = "".join(ch["text"] for event in events for ch in event["choices"])
        assert text == echoed.json()["choices"][0]["text"]
    assert_no_locks(agent)


async def test_completion_choices_stream(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both")
    body = completion_body("Hello", max_tokens=3, n=2, ignore_eos=True)
    async with conductor([agent]) as c:
        events = await streamed_events(c.client, "/v1/completions", body)
        seen = {ch["index"] for event in events for ch in event["choices"]}
        assert seen == {0, 1}
    assert_no_locks(agent)
