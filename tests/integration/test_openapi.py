"""``/openapi.json`` is the truth: a valid OpenAPI document, and every response a route
really gives — success and errors, JSON and streamed — matches what it declares."""

from __future__ import annotations

import json
from typing import Any

import httpx
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate

from tests.conftest import MODEL, AgentFactory, ConductorFactory, chat_body

KEY = {"Authorization": "Bearer k1"}
ADMIN = {"Authorization": "Bearer admin-1"}


def _check(doc: dict[str, Any], template: str, method: str, resp: httpx.Response) -> str:
    """Assert ``resp`` matches the document; returns ``"<method> <path> <status>"``."""
    seen = f"{method.upper()} {template} {resp.status_code}"
    declared = doc["paths"][template][method]["responses"]
    assert str(resp.status_code) in declared, f"{seen}: undeclared status ({resp.text[:200]})"
    content = declared[str(resp.status_code)]["content"]
    media = resp.headers["content-type"].split(";")[0].strip()
    assert media in content, f"{seen}: {media} not declared ({sorted(content)})"

    def conforms(schema: dict[str, Any], value: Any) -> None:
        validator = Draft202012Validator({**schema, "components": doc["components"]})
        problems = [e.message for e in validator.iter_errors(value)]
        assert not problems, f"{seen}: {problems[:3]} in {json.dumps(value)[:300]}"

    if media == "application/json":
        conforms(content[media]["schema"], resp.json())
    elif media == "text/event-stream" and "x-kvc-event-types" in content[media]:
        # Anthropic's framing: "event: <type>" then "data: {"type": <type>, …}".
        kinds = []
        for block in (b for b in resp.text.split("\n\n") if b.strip()):
            event, data = block.split("\n", 1)
            kind = event.removeprefix("event: ")
            assert json.loads(data.removeprefix("data: "))["type"] == kind, seen
            kinds.append(kind)
        assert set(kinds) <= set(content[media]["x-kvc-event-types"]), seen
        assert kinds[0] == "message_start", seen
        assert kinds[-1] == "message_stop", seen
    elif media == "text/event-stream":
        events = [b[len("data: ") :] for b in resp.text.split("\n\n") if b.strip()]
        assert events[-1] == "[DONE]", seen
        for data in events[:-1]:
            conforms(content[media]["x-kvc-event-data"], json.loads(data))
    else:
        assert isinstance(resp.text, str)
    return seen


async def test_the_document_is_valid_and_every_recorded_response_matches_it(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both")
    seen: set[str] = set()
    chat = "/v1/chat/completions"
    completions = "/v1/completions"
    async with conductor(
        [agent], api_keys=["k1"], admin_keys=["admin-1"], max_request_bytes=65_536
    ) as c:
        doc = (await c.client.get("/openapi.json")).json()
        validate(doc)

        async def record(
            method: str, template: str, path: str | None = None, **kwargs: Any
        ) -> httpx.Response:
            resp = await c.client.request(method, path or template, **kwargs)
            seen.add(_check(doc, template, method.lower(), resp))
            return resp

        stream: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}}
        await record("POST", chat, json=chat_body(max_tokens=3), headers=KEY)
        await record("POST", chat, json=chat_body(max_tokens=3, **stream), headers=KEY)
        await record("POST", chat, json=chat_body(temperature=9), headers=KEY)
        await record("POST", chat, json=chat_body())
        await record("POST", chat, json=chat_body(model="gpt-9"), headers=KEY)
        await record("POST", chat, json=chat_body(n=17), headers=KEY)
        await record("POST", chat, json=chat_body("x" * 70_000), headers=KEY)
        prompt = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3}
        await record("POST", completions, json=prompt, headers=KEY)
        await record("POST", completions, json={**prompt, **stream}, headers=KEY)
        await record("POST", completions, json={**prompt, "echo": True, "logprobs": 1}, headers=KEY)
        messages = "/v1/messages"
        ask = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
        await record("POST", messages, json=ask, headers={"x-api-key": "k1"})
        await record("POST", messages, json={**ask, "stream": True}, headers={"x-api-key": "k1"})
        await record("POST", messages, json={**ask, "max_tokens": 0}, headers=KEY)
        await record("POST", messages, json=ask)
        await record("POST", messages, json={**ask, "model": "claude-9"}, headers=KEY)
        await record("POST", messages, json={**ask, "stop_sequences": list("abcde")}, headers=KEY)
        await record("GET", "/v1/models", headers=KEY)
        await record("GET", "/v1/models", json=None)
        await record("GET", "/v1/models/{model}", f"/v1/models/{MODEL}", headers=KEY)
        await record("GET", "/v1/models/{model}", "/v1/models/gpt-9", headers=KEY)
        await record("POST", "/tokenize", json={"prompt": "hello"}, headers=KEY)
        await record("POST", "/tokenize", json={}, headers=KEY)
        await record("POST", "/detokenize", json={"tokens": [5, 6]}, headers=KEY)
        await record("POST", "/detokenize", json={"tokens": [10**9]}, headers=KEY)
        for path in ("/health", "/ready", "/metrics", "/version"):
            await record("GET", path)
        await record("GET", "/admin/nodes", headers=ADMIN)
        await record("GET", "/admin/nodes")
        await record("GET", "/admin/index", headers=ADMIN)
        await record("GET", "/admin/prompt-cache", headers=ADMIN)
        await record("GET", "/admin/prompt-cache")
        drain = "/admin/nodes/{node}/drain"
        await record(
            "POST", drain, f"/admin/nodes/{agent.address}/drain", json={"resume": True},
            headers=ADMIN,
        )  # fmt: skip
        await record("POST", drain, "/admin/nodes/nobody/drain", headers=ADMIN)

    async with conductor([]) as empty:  # no agent: not ready, nothing can be served
        doc = (await empty.client.get("/openapi.json")).json()
        resp = await empty.client.get("/ready")
        seen.add(_check(doc, "/ready", "get", resp))
        resp = await empty.client.post(chat, json=chat_body())
        seen.add(_check(doc, chat, "post", resp))

    # Every route was exercised, and the error statuses that requests can reach here.
    for path, operations in doc["paths"].items():
        for method in operations:
            assert any(s.startswith(f"{method.upper()} {path} ") for s in seen), (method, path)
    for expected in (
        f"POST {chat} 200", f"POST {chat} 400", f"POST {chat} 401", f"POST {chat} 404",
        f"POST {chat} 413", f"POST {chat} 422", f"POST {chat} 503", "GET /ready 503",
        f"POST {completions} 422", "POST /admin/nodes/{node}/drain 404",
        "POST /v1/messages 200", "POST /v1/messages 400", "POST /v1/messages 401",
        "POST /v1/messages 404", "POST /v1/messages 422",
    ):  # fmt: skip
        assert expected in seen, (expected, sorted(seen))


async def test_validation_errors_are_documented_as_the_400_envelope(
    conductor: ConductorFactory,
) -> None:
    async with conductor([]) as c:
        doc = (await c.client.get("/openapi.json")).json()
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            for status, response in operation["responses"].items():
                if status.startswith(("4", "5")):
                    schema = response["content"]["application/json"]["schema"]
                    assert schema["$ref"].rsplit("/", 1)[-1] in (
                        "ErrorResponse",
                        "NotReadyResponse",
                        "AnthropicErrorResponse",  # /v1/messages: Anthropic's shape
                    ), (method, path, status)
