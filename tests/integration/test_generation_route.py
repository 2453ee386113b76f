"""The generation endpoints resolve their state and tenant themselves for a body that
validates (``GenerationRoute``); everything else takes FastAPI's handler, with the same
answers as before."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import fastapi.routing
import pytest
from fastapi.dependencies.utils import solve_dependencies
from fastapi.routing import APIRoute

from conductor.api import anthropic, openai
from conductor.api.deps import GenerationRoute
from tests.conftest import MODEL, AgentFactory, ConductorFactory, assert_no_locks, chat_body

DIRECT_PATHS = {"/v1/chat/completions", "/v1/completions", "/v1/messages"}


@pytest.fixture
def solved(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths FastAPI solved dependencies for (its own function, counted)."""
    paths: list[str] = []

    async def counting(*args: Any, **kwargs: Any) -> Any:
        paths.append(kwargs["request"].url.path)
        return await solve_dependencies(*args, **kwargs)

    monkeypatch.setattr(fastapi.routing, "solve_dependencies", counting)
    return paths


def test_only_the_generation_endpoints_have_a_direct_handler() -> None:
    api_routes = [
        r for r in (*openai.router.routes, *anthropic.router.routes) if isinstance(r, APIRoute)
    ]
    routes = [route for route in api_routes if isinstance(route, GenerationRoute)]
    assert len(routes) == len(api_routes)
    direct = {route.path for route in routes if route.direct_handler() is not None}
    assert direct == DIRECT_PATHS
    # Same routers, other shapes (no body; a path parameter): FastAPI's alone.
    assert {"/v1/models", "/v1/models/{model:path}"} <= {route.path for route in routes} - direct


async def test_valid_requests_skip_dependency_solving_and_invalid_ones_do_not(
    start_agent: AgentFactory, conductor: ConductorFactory, solved: list[str]
) -> None:
    agent = await start_agent("both")
    async with conductor([agent]) as c:
        ok = await c.client.post("/v1/chat/completions", json=chat_body(max_tokens=4))
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["message"]["content"]
        async with c.client.stream(
            "POST", "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3,
                                             "stream": True}
        ) as streamed:  # fmt: skip
            assert streamed.status_code == 200
            text = "".join([chunk async for chunk in streamed.aiter_text()])
        assert text.rstrip().endswith("data: [DONE]")
        message = await c.client.post(
            "/v1/messages",
            json={"model": MODEL, "max_tokens": 4,
                  "messages": [{"role": "user", "content": "Hi"}]},
        )  # fmt: skip
        assert message.status_code == 200, message.text
        assert solved == []

        bad = await c.client.post("/v1/chat/completions", json=chat_body(temperature=5))
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "temperature"
        not_an_object = await c.client.post("/v1/completions", json=["a"])
        assert not_an_object.status_code == 400
        # A JSON object under a media type FastAPI does not read as JSON: its answer.
        odd_type = await c.client.post(
            "/v1/chat/completions",
            content=json.dumps(chat_body(max_tokens=2)),
            headers={"content-type": "application/jsonx"},
        )
        assert odd_type.status_code == 400, odd_type.text
        assert solved == ["/v1/chat/completions", "/v1/completions", "/v1/chat/completions"]
        # Refused by the endpoint itself (it validates, then the model is unknown).
        unknown = await c.client.post("/v1/chat/completions", json=chat_body(model="gpt-9"))
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found"
        assert len(solved) == 3
        typed = await c.client.post(
            "/v1/chat/completions",
            content=json.dumps(chat_body(max_tokens=2)),
            headers={"content-type": "application/vnd.example+json; charset=utf-8"},
        )
        assert typed.status_code == 200, typed.text
        assert len(solved) == 3
        assert ok.headers["x-request-id"]
        assert unknown.headers["x-request-id"]
    assert_no_locks(agent)


async def test_authentication_is_the_same_on_both_paths(
    start_agent: AgentFactory, conductor: ConductorFactory, solved: list[str], tmp_path: Path
) -> None:
    tenants = tmp_path / "tenants.json"
    tenants.write_text('{"tenants": {"a": {"api_keys": ["sk-a"]}}}')
    agent = await start_agent("both")
    async with conductor([agent], tenants_file=tenants) as c:
        answers = []
        for body in (chat_body(max_tokens=2), chat_body(temperature=5)):  # direct, FastAPI
            for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
                resp = await c.client.post("/v1/chat/completions", json=body, headers=headers)
                assert resp.status_code == 401, resp.text
                answers.append(resp.json())
        assert answers[0] == answers[2]
        assert answers[1] == answers[3]
        assert answers[0] != answers[1]  # no key, and a wrong one, said apart
        assert solved == ["/v1/chat/completions"] * 2
        resp = await c.client.post(
            "/v1/chat/completions",
            json=chat_body(max_tokens=2),
            headers={"Authorization": "Bearer sk-a"},
        )
        assert resp.status_code == 200, resp.text
        assert len(solved) == 2
    assert_no_locks(agent)
