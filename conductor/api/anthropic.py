"""Anthropic's Messages API (``POST /v1/messages``), so the official ``anthropic`` SDK
works against the conductor unchanged.

A Messages request is translated into a chat request (system prompt, text blocks,
``tool_use`` and ``tool_result`` blocks as an assistant's tool calls and tool messages,
tools and ``tool_choice``) and runs the same path as ``/v1/chat/completions``: the same
chat template, scheduling, tool-call parsing and accounting. The answer is rendered as
Anthropic renders it: content blocks (``text``, ``tool_use``), ``stop_reason``
(``end_turn``, ``max_tokens``, ``tool_use``), usage with ``cache_read_input_tokens``
(the prompt tokens served from a node's prefix cache), the streamed event sequence
(``message_start``, ``content_block_start``/``_delta``/``_stop``, ``message_delta``,
``message_stop``; an ``error`` event when a stream fails after it began) and error bodies
(``{"type": "error", "error": {"type", "message"}}``). The API key comes in ``x-api-key``
(or ``Authorization: Bearer``).

``cache_control`` (prompt-cache breakpoints with a 5-minute or 1-hour TTL) is honoured
on system, text, ``tool_use`` and ``tool_result`` blocks, on tools and at the top level
(the last message): see ``conductor.api.prompt_cache``; the usage then reports
``cache_creation_input_tokens`` and ``cache_creation`` by TTL. Text blocks become chat
content parts, joined by newlines in the prompt as vLLM joins them.

``stop_sequences`` (at most four, as on the chat route) stop the generation; the one
that matched comes back as ``stop_reason: "stop_sequence"`` with ``stop_sequence``.

Refused with 422 rather than ignored, until they are built: ``output_config``, image
and document blocks, extended thinking. Other fields are logged once per name, as on the OpenAI
routes.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError

from conductor.api.deps import GenerationRoute, StateDep, TenantDep, request_id
from conductor.api.openai import log_unknown_fields, start_chat
from conductor.api.openapi_doc import GENERATION_ERRORS, errors, streamed
from conductor.api.schemas import (
    _ABSENT,
    MAX_STOP_SEQUENCES,
    ChatCompletionRequest,
    OpenAIRequest,
    _ResponseModel,
)
from conductor.api.sse import GenerationResponse
from conductor.api.tool_calls import Call, CallArguments, CallEnd, CallStart, Content, collect
from conductor.errors import ConductorError, InvalidRequest, UnprocessableEntity
from conductor.generation import TokenDelta, UsageCounts

__all__ = ["MESSAGES_PATH", "anthropic_error_body", "router"]

MESSAGES_PATH = "/v1/messages"
router = APIRouter(route_class=GenerationRoute)

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(exc: ConductorError, request_id: str | None) -> dict[str, Any]:
    """Anthropic's error body for one of the conductor's errors (same status code)."""
    status = exc.status_code
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": exc.message}}
    if request_id:
        body["request_id"] = request_id
    return body


class AnthropicErrorDetail(_ResponseModel):
    type: str  # invalid_request_error, authentication_error, not_found_error, …
    message: str


class AnthropicErrorResponse(_ResponseModel):
    """Anthropic's error body: what every error of the Messages API answers."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
    request_id: str | None = None


# --------------------------------------------------------------------- the request


class MessagesRequest(OpenAIRequest):
    """``POST /v1/messages``. Content blocks are read in the translation, where an
    unsupported one gets a 422 naming it."""

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


def _refuse(param: str, why: str) -> UnprocessableEntity:
    return UnprocessableEntity(
        f"'{param}' is not supported yet: {why}.", param=param, code="unsupported_value"
    )


def _cached(item: dict[str, Any], block: Any) -> dict[str, Any]:
    """``item`` with the ``cache_control`` of ``block``, when it has one."""
    if isinstance(block, dict) and "cache_control" in block:
        return {**item, "cache_control": block["cache_control"]}
    return item


def _text_parts(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A string, or a list of text blocks as chat content parts (breakpoints kept)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"'{where}' must be a string or a list of text blocks.", param=where)
    parts = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise _refuse(f"{where}[{i}].type", "only text blocks here")
        if not isinstance(block.get("text"), str):
            raise InvalidRequest(f"'{where}[{i}].text' must be a string.", param=where)
        parts.append(_cached({"type": "text", "text": block["text"]}, block))
    return parts


def _message(i: int, message: dict[str, Any]) -> list[dict[str, Any]]:
    """One Messages API message as chat messages."""
    where = f"messages[{i}]"
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise InvalidRequest(f"'{where}.role' must be 'user' or 'assistant'.", param=where)
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise InvalidRequest(
            f"'{where}.content' must be a string or a list of blocks.", param=f"{where}.content"
        )
    texts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    turn_cache: Any = None  # a breakpoint on a tool_use block: after the whole turn
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(_cached({"type": "text", "text": block["text"]}, block))
        elif kind == "tool_use" and role == "assistant":
            turn_cache = block.get("cache_control", turn_cache)
            calls.append(
                {
                    "id": str(block.get("id", "")),
                    "type": "function",
                    "function": {
                        "name": str(block.get("name", "")),
                        "arguments": json.dumps(block.get("input", {})),
                    },
                }
            )
        elif kind == "tool_result" and role == "user":
            results.append(
                _cached(
                    {
                        "role": "tool",
                        "tool_call_id": str(block.get("tool_use_id", "")),
                        "content": _text_parts(block.get("content", ""), f"{at}.content"),
                    },
                    block,
                )
            )
        elif kind in ("text", "tool_use", "tool_result"):
            raise InvalidRequest(f"'{at}' is not a valid {kind} block here.", param=at)
        else:
            raise _refuse(f"{at}.type", f"{kind!r} blocks are not built yet")
    if role == "assistant":
        turn: dict[str, Any] = {"role": "assistant", "content": texts or None}
        if calls:
            turn["tool_calls"] = calls
        if turn_cache is not None:
            turn["cache_control"] = turn_cache
        return [turn]
    return [*results, *([{"role": "user", "content": texts}] if texts else [])]


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(OpenAI ``tool_choice``, ``parallel_tool_calls``) of an Anthropic ``tool_choice``."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise InvalidRequest(
        "'tool_choice' must be auto, any, tool (with a name) or none.", param="tool_choice"
    )


def to_chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat request a Messages request stands for (422 for what is not built)."""
    if body.stop_sequences and len(body.stop_sequences) > MAX_STOP_SEQUENCES:
        raise UnprocessableEntity(
            f"'stop_sequences' may hold at most {MAX_STOP_SEQUENCES} strings here.",
            param="stop_sequences",
            code="unsupported_value",
        )
    if body.thinking is not None:
        raise _refuse("thinking", "extended thinking is not built")
    if body.output_config is not None:
        raise _refuse("output_config", "output formats and effort are not built yet")
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text_parts(body.system, "system")})
    for i, message in enumerate(body.messages):
        messages.extend(_message(i, message))
    if body.cache_control is not None and messages:  # a breakpoint at the end
        messages[-1] = {**messages[-1], "cache_control": body.cache_control}
    tools = None
    if body.tools is not None:
        tools = []
        for i, tool in enumerate(body.tools):
            if not isinstance(tool.get("name"), str):
                raise InvalidRequest(f"'tools[{i}].name' is required.", param=f"tools[{i}]")
            tools.append(
                _cached(
                    {
                        "type": "function",
                        "function": {
                            "name": tool["name"],
                            "description": tool.get("description", ""),
                            "parameters": tool.get("input_schema", {"type": "object"}),
                        },
                    },
                    tool,
                )
            )
    choice, parallel = _tool_choice(body.tool_choice)
    user = (body.metadata or {}).get("user_id")
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_tokens,
        "stream": body.stream,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "stop": body.stop_sequences or None,
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "user": user if isinstance(user, str) else None,
    }
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in chat.items() if v is not None}
        )
    except ValidationError as exc:
        raise InvalidRequest.from_validation_errors(exc.errors()) from exc


# --------------------------------------------------------------------- the answer


class CacheCreation(_ResponseModel):
    """Cache writes by TTL, as Anthropic reports them."""

    ephemeral_5m_input_tokens: int = 0
    ephemeral_1h_input_tokens: int = 0


class MessagesUsage(_ResponseModel):
    input_tokens: int  # prompt tokens neither read from nor written to a cache
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation: CacheCreation | None = _ABSENT
    # This conductor's extension, when breakpoints were asked: what became of them
    # (granted, over_budget, node_full, unsupported, too_long, below_minimum).
    cache_retention: str | None = _ABSENT


class MessagesResponse(_ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[dict[str, Any]]
    model: str
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: MessagesUsage


def _usage(usage: UsageCounts) -> MessagesUsage:
    cached = min(usage.cached_tokens, usage.prompt_tokens)
    written = min(usage.cache_write_tokens, usage.prompt_tokens - cached)
    asked = usage.retention != "none"
    by_ttl = dict(usage.cache_writes)
    return MessagesUsage(
        input_tokens=usage.prompt_tokens - cached - written,
        output_tokens=usage.completion_tokens,
        cache_read_input_tokens=cached,
        cache_creation_input_tokens=written,
        cache_creation=CacheCreation(
            ephemeral_5m_input_tokens=sum(n for t, n in by_ttl.items() if t <= 300.0),
            ephemeral_1h_input_tokens=sum(n for t, n in by_ttl.items() if t > 300.0),
        )
        if asked
        else None,
        cache_retention=usage.retention if asked else None,
    )


def _tool_use(call: Call) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments or "{}")
    except ValueError:
        arguments = {}
    return {
        "type": "tool_use",
        "id": _tool_use_id(call.id),
        "name": call.name,
        "input": arguments if isinstance(arguments, dict) else {},
    }


def _tool_use_id(call_id: str) -> str:
    return call_id.replace("call_", "toolu_", 1)


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


@router.post(
    MESSAGES_PATH,
    response_model=None,
    responses={
        **streamed(MessagesResponse, None),
        **errors(*GENERATION_ERRORS, model=AnthropicErrorResponse),
    },
)
async def messages(
    body: MessagesRequest, request: Request, state: StateDep, tenant: TenantDep
) -> Response:
    """Anthropic's Messages API over the conductor's chat path."""
    rid = request_id(request)
    log_unknown_fields(rid, body.unknown_fields())
    chat = await start_chat(to_chat_request(body), request, state, tenant, "messages")
    adm, reader = chat.admitted, chat.reader
    message_id = f"msg_{secrets.token_hex(12)}"
    model = state.model_name
    if not body.stream:
        text, finish, usage = await adm.collect()
        blocks: list[dict[str, Any]] = []
        said, made = collect(reader.read(text, last=True)) if reader is not None else (text, [])
        if said:
            blocks.append({"type": "text", "text": said})
        blocks += [_tool_use(c) for c in made]
        reason = "tool_calls" if made else finish
        matched = adm.choices[0].stop_sequence if reason == "stop" else ""
        answer = MessagesResponse(
            id=message_id,
            content=blocks,
            model=model,
            stop_reason="stop_sequence" if matched else _STOP_REASONS.get(reason, "end_turn"),
            stop_sequence=matched or None,
            usage=_usage(usage),
        )
        return JSONResponse(answer.model_dump(), headers={"X-Request-Id": rid, **adm.headers})

    index = -1  # the content block being streamed
    text_open = False

    def make_event(delta: TokenDelta | None, usage: UsageCounts | None) -> str | None:
        nonlocal index, text_open
        if delta is None:
            return None
        out: list[str] = []
        events = (
            [Content(delta.text)]
            if reader is None
            else reader.read(delta.text, last=delta.finish_reason is not None)
        )
        # Text blocks and tool_use blocks in the order written; a call's input streams
        # as ``input_json_delta`` fragments as its arguments are written.
        for event in events:
            if isinstance(event, Content):
                if not event.text:
                    continue
                if not text_open:
                    index += 1
                    text_open = True
                    out.append(
                        _event(
                            "content_block_start",
                            {"index": index, "content_block": {"type": "text", "text": ""}},
                        )
                    )
                out.append(
                    _event(
                        "content_block_delta",
                        {"index": index, "delta": {"type": "text_delta", "text": event.text}},
                    )
                )
            elif isinstance(event, CallStart):
                if text_open:
                    out.append(_event("content_block_stop", {"index": index}))
                    text_open = False
                index += 1
                block = {"type": "tool_use", "id": _tool_use_id(event.id), "name": event.name,
                         "input": {}}  # fmt: skip
                out.append(_event("content_block_start", {"index": index, "content_block": block}))
            elif isinstance(event, CallArguments):
                fragment = {"type": "input_json_delta", "partial_json": event.text}
                out.append(_event("content_block_delta", {"index": index, "delta": fragment}))
            elif isinstance(event, CallEnd):
                out.append(_event("content_block_stop", {"index": index}))
        if delta.finish_reason is not None:
            if text_open:
                out.append(_event("content_block_stop", {"index": index}))
                text_open = False
            reason = (
                delta.finish_reason if reader is None else reader.finish_reason(delta.finish_reason)
            )
            final = _usage(delta.usage) if delta.usage is not None else None
            matched = delta.stop_sequence if reason == "stop" else ""
            out.append(
                _event(
                    "message_delta",
                    {
                        "delta": {
                            "stop_reason": "stop_sequence"
                            if matched
                            else _STOP_REASONS.get(reason, "end_turn"),
                            "stop_sequence": matched or None,
                        },
                        "usage": final.model_dump() if final else {"output_tokens": 0},
                    },
                )
            )
            out.append(_event("message_stop", {}))
        return "".join(out) or None

    start = MessagesResponse(
        id=message_id,
        content=[],
        model=model,
        stop_reason=None,
        usage=MessagesUsage(input_tokens=chat.prompt_tokens, output_tokens=0),
    )
    first = _event("message_start", {"message": start.model_dump()})

    def on_error(exc: ConductorError) -> str:
        return _event("error", {"error": anthropic_error_body(exc, None)["error"]})

    return GenerationResponse(adm, make_event, first, rid, on_error=on_error, done="")
