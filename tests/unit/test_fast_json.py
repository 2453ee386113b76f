"""kvc.fast_json: orjson's speed with the standard library's results and errors."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRouter
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from kvc import fast_json
from kvc.fast_json import FastJsonRoute, body_text_is_unicode

_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(), inner, max_size=6),
    max_leaves=30,
)


@given(_JSON)
def test_round_trips_agree_with_the_standard_library(value: Any) -> None:
    stdlib = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    encoded = fast_json.dumps(value)
    assert fast_json.loads(encoded) == json.loads(stdlib) == fast_json.loads(stdlib)
    assert json.loads(encoded) == json.loads(stdlib)


def test_token_ids_encode_exactly_as_the_standard_library() -> None:
    body = {"model": "m", "prompt": list(range(0, 200_000, 7)), "max_tokens": 1, "text": "é"}
    assert fast_json.dumps(body) == json.dumps(
        body, separators=(",", ":"), ensure_ascii=False
    ).encode("utf-8")


@pytest.mark.parametrize(
    "text",
    ['"\\ud800"', "[1, NaN]", "[Infinity]"],
)
def test_what_orjson_refuses_is_decoded_by_the_standard_library(text: str) -> None:
    got, want = fast_json.loads(text.encode()), json.loads(text)
    assert repr(got) == repr(want)


def test_an_integer_beyond_64_bits_decodes_as_the_nearest_float() -> None:
    assert fast_json.loads(b"[18446744073709551617]") == [float(2**64)]


def test_malformed_json_raises_the_standard_library_error() -> None:
    with pytest.raises(json.JSONDecodeError):
        fast_json.loads(b'{"a": ')


def test_what_orjson_cannot_encode_is_encoded_by_the_standard_library() -> None:
    assert fast_json.dumps({1: "a"}) == b'{"1":"a"}'
    assert fast_json.dumps([2**70]) == b"[1180591620717411303424]"


def test_a_non_finite_float_is_written_as_null() -> None:
    assert fast_json.dumps([math.nan, math.inf, 1.5]) == b"[null,null,1.5]"


class _Body(BaseModel):
    prompt: str | list[int]


def _app() -> FastAPI:
    app = FastAPI()
    fast = APIRouter(route_class=FastJsonRoute)
    plain = APIRouter()

    @fast.post("/fast")
    async def fast_route(body: _Body) -> dict[str, Any]:
        return {"prompt": len(body.prompt), "unicode": body_text_is_unicode()}

    @plain.post("/plain")
    async def plain_route(body: _Body) -> dict[str, Any]:
        return {"prompt": len(body.prompt), "unicode": body_text_is_unicode()}

    app.include_router(fast)
    app.include_router(plain)
    return app


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": [1, 2, 3]}',
        '{"prompt": "d\u00e9j\u00e0 vu"}'.encode(),
        b'{"prompt": "\\ud83d\\ude00"}',
        b'{"prompt": "\\ud800"}',
        b'{"prompt": ',
        b'{"prompt": {"a": 1}}',
        b"",
    ],
)
def test_a_fast_route_answers_as_a_plain_one(raw: bytes) -> None:
    client = TestClient(_app())
    headers = {"content-type": "application/json"}
    fast = client.post("/fast", content=raw, headers=headers)
    plain = client.post("/plain", content=raw, headers=headers)
    assert fast.status_code == plain.status_code
    if fast.status_code == 200:
        assert fast.json()["prompt"] == plain.json()["prompt"]
    else:
        assert fast.json() == plain.json()


def test_the_unicode_flag_holds_only_for_bodies_orjson_decoded() -> None:
    client = TestClient(_app())
    headers = {"content-type": "application/json"}
    assert client.post("/fast", content=b'{"prompt": "a"}', headers=headers).json()["unicode"]
    lone = client.post("/fast", content=b'{"prompt": "\\ud800"}', headers=headers)
    assert lone.status_code == 200
    assert lone.json()["unicode"] is False
    assert (
        client.post("/plain", content=b'{"prompt": "a"}', headers=headers).json()["unicode"]
        is False
    )
    assert body_text_is_unicode() is False
