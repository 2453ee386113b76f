"""JSON on the request path: orjson where it can, the standard library where it must.

Why
    A prompt crosses the request path as JSON up to four times (client → conductor,
    agent → engine, and for a P/D request both legs again; vLLM echoes the prompt's ids in
    the decode leg's first chunk). The standard library takes ~5 ms to encode and ~4.5 ms
    to decode a 32k-token id list on this project's 2-core reference machine; orjson 0.4 and
    1.4 ms (measured 2026-11-26, ``timeit``, AMD EPYC). On an idle fleet the five processes
    of one P/D request spent ~140 ms of CPU per 32k-token prompt, a third of it in JSON.

Behaviour
    Results are those of the standard library, with one exception: an integer beyond
    64 bits comes back from orjson as the nearest float (the standard library keeps it
    exact); no field of this project's APIs takes such an integer, and both are refused
    alike. Where orjson refuses what ``json`` accepts (``NaN``/``Infinity`` literals and
    escaped lone surrogates on decode; non-string keys and integers beyond 64 bits on
    encode) the call falls back to ``json``, so every other input parses or fails as
    before, with the standard library's error
    (FastAPI turns its ``JSONDecodeError`` into the usual 400). Encoding is compact
    (``separators=(",", ":")``) and keeps non-ASCII characters as UTF-8. One difference
    on encode, on purpose: a non-finite float is written as ``null`` (orjson's choice;
    JSON has no ``NaN``), where ``json.dumps`` writes ``NaN``, which strict parsers
    refuse. The request path validates its floats finite before they get here.

``FastJsonRoute`` is a FastAPI route class whose request bodies are decoded this way;
the route's validation, errors and OpenAPI document are unchanged. A subclass may serve a
decoded JSON body itself (``direct_handler``), falling back to FastAPI's handler for
anything it does not take. orjson refuses an escaped lone UTF-16 surrogate
(``"\\ud800"``), which the standard library lets through into a ``str`` that no UTF-8
encoder takes: while a body that orjson decoded is being handled,
``body_text_is_unicode()`` is true, and a validator that looks for such strings may skip
the walk.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Coroutine
from contextvars import ContextVar
from typing import Any, Final

import orjson
from fastapi import Request, Response
from fastapi.routing import APIRoute

__all__ = [
    "DirectHandler",
    "FastJsonRoute",
    "body_text_is_unicode",
    "dumps",
    "loads",
    "read_as_json",
]

DirectHandler = Callable[[Request, Any], Awaitable[Response | None]]
"""Serves a request from its decoded JSON body, or returns None (nothing done) to leave
it to FastAPI's handler."""

_JSON_TYPES: Final = ("application/json", "+json")
_UNICODE_BODY: Final[ContextVar[bool]] = ContextVar("kvc_json_body_unicode", default=False)


def read_as_json(content_type: str) -> bool:
    """Whether FastAPI reads a body of this media type as JSON (``application/json`` or
    ``application/*+json``, any case, parameters aside); it validates any other body as
    bytes. (The route decodes a little more eagerly — FastAPI parses those bodies again.)"""
    media = content_type.partition(";")[0].strip().lower()
    main, _, sub = media.partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


def body_text_is_unicode() -> bool:
    """Whether the request body being handled was decoded by orjson (so none of its
    strings holds a lone surrogate)."""
    return _UNICODE_BODY.get()


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """``json.loads``, decoded by orjson when it can."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        if isinstance(data, memoryview):
            data = data.tobytes()
        return json.loads(data)


def loads_object(data: bytes | str) -> dict[str, Any] | None:
    """The JSON object ``data`` holds; None when it is not JSON, or not an object."""
    try:
        value = loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON of ``value`` (``json.dumps(value, separators=(",", ":"),
    ensure_ascii=False)``, encoded), by orjson when it can."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


class FastJsonRoute(APIRoute):
    """An ``APIRoute`` whose JSON request body orjson decodes.

    The body is parsed before FastAPI asks the request for it; a body orjson refuses is
    left for FastAPI's own ``request.json()`` (the standard library, as ``loads`` falls
    back), so malformed bodies get exactly the error they got before."""

    def direct_handler(self) -> DirectHandler | None:
        """A handler for requests whose JSON body orjson decoded, sent as a media type
        FastAPI reads as JSON, tried before FastAPI's (which gets the request when it
        returns None); none here."""
        return None

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        direct = self.direct_handler()

        async def decode_then_handle(request: Request) -> Response:
            content_type = request.headers.get("content-type", "")
            unicode_body = False
            parsed: Any = None
            if content_type.startswith(_JSON_TYPES[0]) or _JSON_TYPES[1] in content_type:
                body = await request.body()
                if body:
                    try:
                        parsed = orjson.loads(body)
                    except orjson.JSONDecodeError:
                        pass  # FastAPI parses it again and reports the error
                    else:
                        # Starlette's Request.json() returns this cached value.
                        request._json = parsed
                        unicode_body = True
            token = _UNICODE_BODY.set(unicode_body)
            try:
                if direct is not None and unicode_body and read_as_json(content_type):
                    response = await direct(request, parsed)
                    if response is not None:
                        return response
                return await handler(request)
            finally:
                _UNICODE_BODY.reset(token)

        return decode_then_handle
