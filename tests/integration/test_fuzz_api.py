"""A bounded property-based fuzz of the HTTP API, driven by the conductor's own
/openapi.json: every POST body the document declares, with each field either a value
of its declared type (bounds, enums and nesting from the schema) or any JSON at all
(huge and negative integers, NaN and infinities, lone UTF-16 surrogates, deep nesting,
unknown fields). Whatever comes in, the answer is never a 5xx, a 4xx carries OpenAI's
error envelope, a stream ends, and no block lock is left behind.

Deterministic (``derandomize``): CI runs the same cases every time; the budget is
``EXAMPLES`` bodies per route. ``KVC_FUZZ_EXAMPLES=5000`` runs a longer, random fuzz.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import Callable
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import MODEL, AgentFactory, ConductorFactory, assert_no_locks

DEEP = os.environ.get("KVC_FUZZ_EXAMPLES", "")
EXAMPLES = int(DEEP or 120)
ROUTES = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize")
# Generation is the slow path: bodies that are valid ask for a few tokens at most.
TOKEN_LIMITS = ("max_tokens", "max_completion_tokens")

SURROGATES = ["\ud800", "a\udfffb", "\udc00\ud800", "ok \ud83d"]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(SURROGATES),
)
any_json = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _resolve(doc: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        schema = doc["components"]["schemas"][name]
    return schema


def typed(doc: dict[str, Any], schema: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    """Values of the schema's declared type (not always valid: bounds are crossed too)."""
    schema = _resolve(doc, schema)
    if depth > 4:
        return scalars
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([typed(doc, s, depth + 1) for s in schema[key]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"]) | st.text(max_size=10)
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "string":
        return st.text(max_size=60) | st.sampled_from(SURROGATES)
    if kind == "integer":
        lo, hi = schema.get("minimum", -5), schema.get("maximum", 10**6)
        return st.integers(min_value=int(lo) - 2, max_value=int(hi) + 2)
    if kind == "number":
        lo, hi = schema.get("minimum", -5.0), schema.get("maximum", 5.0)
        return st.floats(min_value=float(lo) - 1, max_value=float(hi) + 1) | st.sampled_from(
            [math.nan, math.inf]
        )
    if kind == "boolean":
        return st.booleans()
    if kind == "array":
        return st.lists(typed(doc, schema.get("items", {}), depth + 1), max_size=4)
    if kind == "object" or "properties" in schema:
        return body_of(doc, schema, depth + 1)
    return any_json


def body_of(doc: dict[str, Any], schema: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    """An object: each declared property typed, any JSON, or absent; now and then an
    unknown field; a required property is there most of the time."""
    schema = _resolve(doc, schema)
    props: dict[str, Any] = schema.get("properties", {})
    required = set(schema.get("required", []))

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, prop in props.items():
            choice = draw(st.integers(0, 9))
            if choice < (2 if name in required else 6):
                continue  # absent
            if name in TOKEN_LIMITS and choice < 9:
                out[name] = draw(st.sampled_from([1, 2, 0, -1, 10**9, "4", None]))
            elif choice < 8:
                out[name] = draw(typed(doc, prop, depth))
            else:
                out[name] = draw(any_json)
        if draw(st.integers(0, 9)) == 0:
            out[draw(st.text(min_size=1, max_size=10))] = draw(any_json)
        if "model" in props and draw(st.integers(0, 3)):
            out["model"] = MODEL  # mostly the served model, or generation is never reached
        return out

    return build()


VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 2},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
    "/tokenize": {"model": MODEL, "prompt": "hi"},
    "/detokenize": {"model": MODEL, "tokens": [1, 2]},
}  # fmt: skip


def one_field_off(
    doc: dict[str, Any], schema: dict[str, Any], valid: dict[str, Any]
) -> st.SearchStrategy[dict[str, Any]]:
    """A valid body with one field (declared or unknown) set to a typed or any value:
    what reaches the checks past the first one."""
    props: dict[str, Any] = _resolve(doc, schema).get("properties", {})
    names = st.sampled_from(sorted(props)) | st.text(min_size=1, max_size=10)

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        name = draw(names)
        value = draw(typed(doc, props[name]) if name in props else any_json)
        if name in TOKEN_LIMITS and isinstance(value, int) and value > 8:
            value = draw(st.sampled_from([8, 10**9]))  # generation is the slow path
        return {**valid, name: value}

    return build()


def raw(body: Any) -> bytes:
    # allow_nan: NaN and Infinity are what a sloppy client's encoder writes.
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


async def test_no_body_gets_a_5xx(start_agent: AgentFactory, conductor: ConductorFactory) -> None:
    agent = await start_agent("both", capacity_blocks=256)
    async with conductor([agent], default_max_tokens=4) as c:
        doc = (await c.client.get("/openapi.json")).json()
        loop = asyncio.get_running_loop()
        schemas = {
            path: doc["paths"][path]["post"]["requestBody"]["content"]["application/json"][
                "schema"]
            for path in ROUTES
        }  # fmt: skip
        bodies = {
            path: body_of(doc, schema) | one_field_off(doc, schema, VALID[path])
            for path, schema in schemas.items()
        }
        seen: dict[int, int] = {}

        async def send(path: str, content: bytes) -> httpx.Response:
            headers = {"content-type": "application/json"}
            async with c.client.stream("POST", path, content=content, headers=headers) as resp:
                await resp.aread()  # a stream must end
                return resp

        def check(path: str, body: Any) -> None:
            content = raw(body)
            resp = asyncio.run_coroutine_threadsafe(send(path, content), loop).result(timeout=120)
            seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
            assert resp.status_code < 500, (path, content[:400], resp.text[:400])
            if resp.status_code >= 400:
                error = resp.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, resp.text
                assert error["message"], resp.text

        def fuzzer(path: str) -> Callable[[], None]:
            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                derandomize=not DEEP,
                database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            )
            @given(body=bodies[path])
            def fuzz(body: Any) -> None:
                check(path, body)

            return fuzz

        for path in ROUTES:
            await asyncio.to_thread(fuzzer(path))
        # The fuzz reached past validation: some bodies were served, most refused.
        assert seen.get(200, 0) > 0, seen
        assert sum(n for code, n in seen.items() if 400 <= code < 500) > 0, seen
    assert_no_locks(agent)
