"""``/openapi.json`` as the truth: each route's real success and error bodies.

Routes declare their error statuses with ``errors(...)`` (every one answers OpenAI's
envelope, ``ErrorResponse``) and, for the streaming routes, both bodies of their 200:
``application/json`` and ``text/event-stream``, whose events carry the chunk schema named
in ``x-kvc-event-data`` and end with ``data: [DONE]``. ``install`` then builds the
document once: FastAPI's 422 ``HTTPValidationError`` is dropped (a body that fails
validation is answered 400 with the envelope, see ``conductor/errors.py``), the chunk
schemas are added to the components, and the version is the installed package's.
``tests/integration/test_openapi.py`` validates the document and checks recorded
responses of every route against it.
"""

from __future__ import annotations

from typing import Any, Final

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from conductor.api.schemas import ChatCompletionChunk, CompletionChunk, ErrorResponse
from kvc.version import package_version

__all__ = ["ANTHROPIC_EVENTS", "errors", "install", "streamed"]

_REF: Final = "#/components/schemas/{model}"

_WHEN: Final[dict[int, str]] = {
    400: "Invalid request: a schema violation or malformed JSON (`param` names the field), "
    "or prompt + max_tokens over the model's context (`context_length_exceeded`)",
    401: "An API key is required and none, or a wrong one, was given (`invalid_api_key`)",
    404: "Unknown model (`model_not_found`) or node",
    413: "Body larger than `--max-request-bytes` (`request_too_large`)",
    422: "A valid OpenAI parameter this server does not honour (`unsupported_value`; `param` "
    "names it): see docs/api.md",
    429: "Refused before any engine work: a tenant's rate limit, the conductor's in-flight "
    "bound, a predicted TTFT/TBT SLO miss or no KV room; `Retry-After` and "
    "`X-Kvc-Reject-Reason` say which",
    502: "A node failed the request (`upstream_error`)",
    503: "No usable prefill or decode node, or draining (`service_unavailable`); `Retry-After`",
    504: "A node did not answer in time (`timeout`)",
}

GENERATION_ERRORS: Final = (400, 401, 404, 413, 422, 429, 502, 503, 504)
# The Messages API's stream: ``event: <type>`` and ``data: {"type": <type>, ...}``, the
# last one message_stop (or error), no [DONE].
ANTHROPIC_EVENTS: Final = ("message_start", "content_block_start", "content_block_delta",
                           "content_block_stop", "message_delta", "message_stop", "ping",
                           "error")  # fmt: skip


def errors(
    *statuses: int, model: type[BaseModel] = ErrorResponse
) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for error statuses, each with OpenAI's error envelope (or
    ``model``: the Messages API answers Anthropic's error body)."""
    return {s: {"model": model, "description": _WHEN[s]} for s in statuses}


def streamed(response: type[BaseModel], chunk: type[BaseModel] | None) -> dict[int | str, Any]:
    """The 200 of a route that answers ``response`` as JSON, or a stream of ``chunk``s
    (None: Anthropic's typed events, ``event:`` and ``data:`` lines, no ``[DONE]``)."""
    if chunk is None:
        kinds = list(ANTHROPIC_EVENTS)
        stream: dict[str, Any] = {"schema": {"type": "string"}, "x-kvc-event-types": kinds}
        events = f"server-sent events typed as Anthropic types them ({', '.join(kinds)})"
        description = f"`{response.__name__}`, or with `stream: true` {events}"
        return {
            200: {
                "model": response,
                "description": description,
                "content": {"text/event-stream": stream},
            }
        }
    return {
        200: {
            "model": response,
            "description": f"`{response.__name__}`, or with `stream: true` server-sent events "
            f"whose data is a `{chunk.__name__}` each, then `[DONE]`",
            "content": {
                "text/event-stream": {
                    "schema": {"type": "string"},
                    "x-kvc-event-data": {"$ref": _REF.format(model=chunk.__name__)},
                }
            },
        }
    }


def _is_validation_error(response: dict[str, Any]) -> bool:
    content = response.get("content", {}).get("application/json", {})
    return bool(content.get("schema", {}).get("$ref", "").endswith("/HTTPValidationError"))


def _build(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(
        title=app.title,
        version=package_version(),
        description="The conductor's HTTP API: OpenAI's chat and completions, Anthropic's "
        "Messages, vLLM's tokenizer extras, operations and admin routes (docs/api.md).",
        routes=app.routes,
    )
    for operations in doc["paths"].values():
        for operation in operations.values():
            responses = operation["responses"]
            if "422" in responses and _is_validation_error(responses["422"]):
                del responses["422"]
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    _, defs = models_json_schema(
        [(ChatCompletionChunk, "serialization"), (CompletionChunk, "serialization")],
        ref_template=_REF,
    )
    for name, schema in defs.get("$defs", {}).items():
        schemas.setdefault(name, schema)
    return doc


def install(app: FastAPI) -> None:
    """Serve the document ``_build`` makes (once, then cached on the app)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _build(app)
        return app.openapi_schema

    setattr(app, "openapi", openapi)  # noqa: B010 - FastAPI's documented override
