"""The OpenAI-compatible generation routes (chat completions, completions) and models.

Both generation routes turn their body into prompt token ids, then share one path:
``admission.admit`` (bounds, rate limits, placement, first token — every refusal a
status code with the OpenAI error envelope), then a JSON body (``Admitted.collect``) or
server-sent events (``sse.GenerationResponse``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from conductor.api.admission import Admitted, ChoiceResult, admit
from conductor.api.deps import GenerationRoute, StateDep, TenantDep, request_id
from conductor.api.limits import request_slo
from conductor.api.openapi_doc import GENERATION_ERRORS, errors, streamed
from conductor.api.prompt_cache import read_marks, retention_ttl_s
from conductor.api.schemas import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionTokenLogprob,
    ChoiceDelta,
    ChoiceLogprobs,
    ChunkChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ContentChunks,
    FunctionCall,
    FunctionCallDelta,
    ModelCard,
    ModelList,
    PromptCacheUsage,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
    chunk_json,
    new_chat_completion_id,
    new_completion_id,
    sse_data,
)
from conductor.api.sse import GenerationResponse
from conductor.api.tool_calls import (
    Call,
    CallArguments,
    CallEnd,
    CallStart,
    Content,
    Event,
    ToolCallParser,
    call_events,
    collect,
    make_call,
)
from conductor.api.tool_calls import new_parser as new_tool_parser
from conductor.errors import (
    ContextLengthExceeded,
    InvalidRequest,
    ModelNotFound,
    UnprocessableEntity,
)
from conductor.generation import Breakpoint, TokenDelta, UsageCounts
from conductor.state import AppState
from conductor.tenants import Tenant
from kvc.sampling import TokenLogprob
from kvc.tokenization import ChatTemplateError, ChatTokenizer, TextTooLong

log = logging.getLogger("conductor.api")

router = APIRouter(route_class=GenerationRoute)


def _usage_model(u: UsageCounts) -> Usage:
    usage = Usage.from_counts(u.prompt_tokens, u.completion_tokens, cached_tokens=u.cached_tokens)
    if u.retention != "none":  # the request asked for retention: say what became of it
        usage.prompt_cache = PromptCacheUsage(
            retention=u.retention,
            cache_write_tokens=u.cache_write_tokens,
            cache_read_tokens=min(u.cached_tokens, u.prompt_tokens),
        )
    return usage


_UNKNOWN_SEEN: set[str] = set()
_UNKNOWN_SEEN_MAX = 1_024  # names remembered; past it, new names are still logged


def log_unknown_fields(rid: str, names: set[str]) -> None:
    """Log the unknown request fields this process has not logged yet, once per name
    (``messages[3].foo`` and ``messages[0].foo`` are one name): a client that always
    sends an extension does not fill the log."""
    fresh = {re.sub(r"\[\d+\]", "[]", name) for name in names} - _UNKNOWN_SEEN
    if fresh:
        log.info(
            "request %s: ignoring unknown fields %s (logged once per name)", rid, sorted(fresh)
        )
        if len(_UNKNOWN_SEEN) < _UNKNOWN_SEEN_MAX:
            _UNKNOWN_SEEN.update(fresh)


def check_model(state: AppState, model: str) -> None:
    if model != state.model_name:
        raise ModelNotFound(model)


MAX_CHOICES = 16  # n: each choice is a generation of its own on the fleet


def _reject_unsupported(n: int) -> None:
    if n > MAX_CHOICES:
        raise UnprocessableEntity(
            f"n is at most {MAX_CHOICES} here.", param="n", code="unsupported_value"
        )


def _token_text(tokenizer: ChatTokenizer, token_id: int) -> tuple[str, list[int]]:
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", "replace"), list(raw)


def chat_logprobs(
    tokenizer: ChatTokenizer, pairs: Iterable[tuple[int, TokenLogprob]]
) -> ChoiceLogprobs:
    """OpenAI's chat ``logprobs`` for generated (token id, entry) pairs."""
    content = []
    for token_id, entry in pairs:
        text, raw = _token_text(tokenizer, token_id)
        top = []
        for alt, logprob in entry.top:
            alt_text, alt_raw = _token_text(tokenizer, alt)
            top.append(TopLogprob(token=alt_text, logprob=logprob, bytes=alt_raw))
        content.append(
            ChatCompletionTokenLogprob(
                token=text, logprob=entry.logprob, bytes=raw, top_logprobs=top
            )
        )
    return ChoiceLogprobs(content=content)


def completion_logprobs(
    tokenizer: ChatTokenizer, pairs: Iterable[tuple[int, TokenLogprob]], offset: int = 0
) -> tuple[CompletionLogprobs, int]:
    """The legacy completions' ``logprobs`` for (token id, entry) pairs whose text starts
    at ``offset`` in the completion; returns it and the offset after them."""
    out = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
    for token_id, entry in pairs:
        text = _token_text(tokenizer, token_id)[0]
        out.text_offset.append(offset)
        offset += len(text)
        out.tokens.append(text)
        out.token_logprobs.append(entry.logprob)
        out.top_logprobs.append({_token_text(tokenizer, a)[0]: lp for a, lp in entry.top})
    return out, offset


def _check_token_ids(body: ChatCompletionRequest | CompletionRequest, vocab: int) -> None:
    """``logit_bias`` keys and ``stop_token_ids`` name tokens of this vocabulary; and
    ``min_tokens`` fits ``max_tokens``."""
    _check_logit_bias(body.logit_bias, vocab)
    for token in body.stop_token_ids or ():
        if token >= vocab:
            raise InvalidRequest(
                f"stop_token_ids: {token} is not below the vocabulary size {vocab}.",
                param="stop_token_ids",
                code="invalid_value",
            )
    limit = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        limit = body.max_completion_tokens
    if body.min_tokens and limit is not None and body.min_tokens > limit:
        raise InvalidRequest(
            f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({limit}).",
            param="min_tokens",
            code="invalid_value",
        )


def _check_logit_bias(logit_bias: dict[str, float] | None, vocab: int) -> None:
    for token in logit_bias or {}:
        if int(token) >= vocab:
            raise InvalidRequest(
                f"logit_bias token id {token} is not below the vocabulary size {vocab}.",
                param="logit_bias",
                code="invalid_value",
            )


def _require_structured_output(state: AppState, param: str = "response_format") -> None:
    """Structured output runs in vLLM's guided decoding: refuse it while any usable node
    runs another engine (the request could land there)."""
    others = sorted(
        f"{a.address} ({a.info.engine})"
        for a in state.fleet.handles()
        if a.usable and a.info is not None and a.info.engine != "vllm"
    )
    if others:
        raise UnprocessableEntity(
            "Structured output (response_format json_object/json_schema, tool_choice "
            "'required' or a named function) needs vLLM nodes; these nodes cannot "
            f"constrain their output: {', '.join(others)}.",
            param=param,
            code="unsupported_value",
        )


def _check_response_format(fmt: Any, state: AppState) -> None:
    """OpenAI's ``response_format`` (chat; vLLM also takes it on completions): 400 when
    malformed, 422 while a usable node cannot constrain its output, else honoured."""
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise InvalidRequest(
                "response_format.type must be 'text', 'json_object' or 'json_schema'.",
                param="response_format",
                code="invalid_value",
            )
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise InvalidRequest(
                    "response_format.json_schema must be an object with a 'name'.",
                    param="response_format.json_schema",
                    code="invalid_value",
                )
            if not isinstance(spec.get("schema", {}), dict):
                raise InvalidRequest(
                    "response_format.json_schema.schema must be a JSON Schema object.",
                    param="response_format.json_schema.schema",
                    code="invalid_value",
                )
        if kind != "text":
            _require_structured_output(state)


def _tool_names(tools: list[Any]) -> list[str]:
    """The functions' names; 400 for a tool that is not ``{"type": "function", "function":
    {"name": ..., "parameters"?: {...}}}``."""
    names: list[str] = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("parameters", {}), dict)
        ):
            raise InvalidRequest(
                "Each tool must be {'type': 'function', 'function': {'name': ..., "
                "'parameters': {...}}}.",
                param=f"tools[{i}]",
                code="invalid_value",
            )
        names.append(function["name"])
    return names


def _check_forced_choice(
    body: ChatCompletionRequest, choice: Any, names: list[str], state: AppState
) -> None:
    """``tool_choice`` ``required`` or a named function: the call is forced by guided
    decoding (vLLM), so it needs vLLM nodes and no response_format of its own."""
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequest(
                "A named tool_choice is {'type': 'function', 'function': {'name': ...}}.",
                param="tool_choice",
                code="invalid_value",
            )
        if name not in names:
            raise InvalidRequest(
                f"tool_choice names {name!r}, which is not among the tools.",
                param="tool_choice",
                code="invalid_value",
            )
    fmt = body.response_format
    if isinstance(fmt, dict) and fmt.get("type") != "text":
        raise InvalidRequest(
            "response_format cannot be combined with tool_choice 'required' or a named "
            "function (both constrain the output).",
            param="tool_choice",
            code="invalid_value",
        )
    _require_structured_output(state, param="tool_choice")


def _forced_call_format(body: ChatCompletionRequest) -> str | None:
    """The JSON Schema that forces ``tool_choice`` ``required``/named, as a response_format
    for the wire (vLLM's own approach): a named function's arguments object, or an array
    of ``{"name", "parameters"}`` over the tools. None when nothing is forced."""
    choice = body.tool_choice
    if not body.tools or not (isinstance(choice, dict) or choice == "required"):
        return None
    params = {
        t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
        for t in body.tools
    }
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        schema: dict[str, Any] = params[name]
    else:
        schema = {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"name": {"const": name}, "parameters": p},
                        "required": ["name", "parameters"],
                        "additionalProperties": False,
                    }
                    for name, p in params.items()
                ]
            },
        }
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        name = "tool_calls"
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    return json.dumps(fmt, separators=(",", ":"))


def _refuse_what_chat_cannot_honour(body: ChatCompletionRequest, state: AppState) -> None:
    """422 for what this server would otherwise have to ignore; 400 for OpenAI's own
    consistency rules. Tools are rendered into the prompt by the chat template; with
    ``tool_choice`` ``auto`` (the default) calls are read from the output by the model's
    tool-call parser (``--tool-call-parser``), with ``none`` no call is expected."""
    _check_response_format(body.response_format, state)
    choice = body.tool_choice
    if body.tools is not None and not isinstance(body.tools, list):
        raise InvalidRequest("tools must be an array.", param="tools", code="invalid_type")
    if body.tools:
        names = _tool_names(body.tools)
        if isinstance(choice, dict) or choice == "required":
            _check_forced_choice(body, choice, names, state)
        elif choice not in (None, "auto", "none"):
            raise InvalidRequest(
                "tool_choice must be 'none', 'auto', 'required' or a named function.",
                param="tool_choice",
                code="invalid_value",
            )
        elif choice != "none" and state.tool_parser is None:
            raise UnprocessableEntity(
                "This model has no tool-call parser: its calls could not be read from the "
                "output. Start the conductor with --tool-call-parser hermes|llama3_json, or "
                "send tool_choice 'none' to show the tools to the model without calls.",
                param="tool_choice" if choice is not None else "tools",
                code="unsupported_value",
            )
    elif choice is not None and choice != "none":
        raise InvalidRequest(
            "tool_choice is only allowed when tools are specified.",
            param="tool_choice",
            code="invalid_value",
        )
    if body.parallel_tool_calls is not None and not isinstance(body.parallel_tool_calls, bool):
        raise InvalidRequest(
            "parallel_tool_calls must be a boolean.",
            param="parallel_tool_calls",
            code="invalid_type",
        )


def _refuse_what_completion_cannot_honour(body: CompletionRequest, state: AppState) -> None:
    _check_response_format(body.response_format, state)
    if body.echo and body.logprobs is not None:
        raise UnprocessableEntity(
            "echo with logprobs needs the prompt's logprobs, which no engine here reports.",
            param="echo",
            code="unsupported_value",
        )
    best_of = body.best_of or body.n
    if best_of < body.n:
        raise InvalidRequest("best_of must be at least n.", param="best_of")
    if best_of > body.n and body.stream:  # the best are known only at the end
        raise InvalidRequest("best_of cannot be streamed.", param="best_of")
    if best_of > MAX_CHOICES:
        raise UnprocessableEntity(
            f"best_of is at most {MAX_CHOICES} here.", param="best_of", code="unsupported_value"
        )
    if body.suffix:
        raise UnprocessableEntity(
            "suffix (insertion) is not supported.", param="suffix", code="unsupported_value"
        )


class _ToolCallReader:
    """Splits one generation's text into what the model said and the tool calls it made:
    with the model family's parser (``conductor/api/tool_calls.py``), or — when
    ``tool_choice`` forced the call through guided decoding — from the JSON the output
    is (a named function's arguments, or an array of ``{"name", "parameters"}``); JSON
    that does not parse (cut by max_tokens) stays text. ``parallel_tool_calls: false``
    keeps the first call. A streamed answer's parser is incremental: a call's arguments
    stream as they are written."""

    def __init__(
        self, parser: ToolCallParser | None, parallel: bool, forced_name: str | None = None
    ) -> None:
        self._parser = parser
        self._parallel = parallel
        self._forced_name = forced_name
        self._held = ""  # forced mode: the whole output, read at the end
        self._dropping = False  # inside a call that parallel_tool_calls=false drops
        self._cut = False  # a streamed call's arguments were cut short
        self.called = 0  # calls handed out so far

    @classmethod
    def for_request(cls, body: ChatCompletionRequest, state: AppState) -> _ToolCallReader | None:
        choice = body.tool_choice
        parallel = body.parallel_tool_calls is not False
        if not body.tools or choice == "none":
            return None
        if isinstance(choice, dict):
            return cls(None, parallel, forced_name=choice["function"]["name"])
        if choice == "required":
            return cls(None, parallel)
        if state.tool_parser is None:
            return None
        return cls(new_tool_parser(state.tool_parser, incremental=body.stream), parallel)

    def read(self, text: str, *, last: bool) -> list[Event]:
        """What ``text`` (the next delta; ``last`` at the generation's end) adds:
        content and calls' starts, argument fragments and ends, in order."""
        if self._parser is None:
            events = self._forced(text, last)
        else:
            events = self._parser.feed(text) if text else []
            if last:
                events += self._parser.finish()
        kept: list[Event] = []
        for event in events:
            if isinstance(event, CallStart):
                if not self._parallel and self.called:
                    self._dropping = True
                    continue
                self.called += 1
            elif self._dropping and isinstance(event, CallArguments | CallEnd):
                self._dropping = not isinstance(event, CallEnd)
                continue
            elif isinstance(event, CallEnd) and not event.complete:
                self._cut = True
            kept.append(event)
        return kept

    def finish_reason(self, finish: str) -> str:
        """``tool_calls`` once a call was made — unless one was cut short, when the
        generation's own reason (``length``) says its arguments are incomplete."""
        return "tool_calls" if self.called and not self._cut else finish

    def _forced(self, text: str, last: bool) -> list[Event]:
        self._held += text
        if not last:
            return []
        held, self._held = self._held, ""
        try:
            data = json.loads(held)
        except ValueError:
            return [Content(held)]
        if self._forced_name is not None:
            call = make_call(self._forced_name, data)
            return call_events(call) if call is not None else [Content(held)]
        items = data if isinstance(data, list) else []
        calls = [
            make_call(i.get("name"), i.get("parameters")) if isinstance(i, dict) else None
            for i in items
        ]
        if not calls or any(c is None for c in calls):
            return [Content(held)]
        return [e for c in calls if c is not None for e in call_events(c)]


def _tool_call(call: Call) -> ToolCall:
    return ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def _chat_deltas(events: list[Event], first_call: int) -> list[ChoiceDelta]:
    """Streamed as OpenAI streams calls: text as it comes; per call one delta naming it
    (id, type, function name, empty arguments), then its arguments fragment by fragment.
    ``first_call`` is the index of the first call that starts in ``events``."""
    parts: list[ChoiceDelta] = []
    call = first_call - 1
    for event in events:
        if isinstance(event, Content):
            if event.text:
                parts.append(ChoiceDelta(content=event.text))
        elif isinstance(event, CallStart):
            call += 1
            head = ToolCallDelta(
                index=call,
                id=event.id,
                type="function",
                function=FunctionCallDelta(name=event.name, arguments=""),
            )
            parts.append(ChoiceDelta(tool_calls=[head]))
        elif isinstance(event, CallArguments):
            fragment = ToolCallDelta(index=call, function=FunctionCallDelta(arguments=event.text))
            parts.append(ChoiceDelta(tool_calls=[fragment]))
    return parts


# Text up to this many characters is tokenized on the event loop, longer text in a worker
# thread, so one long prompt does not stall every other request. Measured with the demo
# tokenizer: 4,096 characters are ~1,200 tokens and 1.1 ms to encode (16,384: 5.5 ms, too
# long a stall); a thread hop costs more than encoding a short prompt.
_INLINE_TOKENIZE_CHARS = 4_096


def text_size(messages: list[dict[str, Any]], tools: list[Any] | None) -> int:
    size = sum(len(str(m.get("content") or "")) for m in messages)
    return size + (len(str(tools)) if tools else 0)


async def off_loop_if_long(chars: int, work: Callable[[], list[int]]) -> list[int]:
    if chars <= _INLINE_TOKENIZE_CHARS:
        return work()
    return await asyncio.to_thread(work)  # the tokenizer releases the GIL for long text


async def prompt_token_ids(
    state: AppState, chars: int, encode: Callable[..., list[int]], param: str
) -> list[int]:
    """``encode(limit=...)`` bounded by the model's context: a prompt whose length alone
    shows it cannot fit is refused before it is tokenized (seconds of CPU for a
    body of megabytes), the rest tokenized off the loop when long."""
    limit = state.max_model_len()
    try:
        return await off_loop_if_long(chars, partial(encode, limit=limit))
    except TextTooLong as exc:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {exc.limit} tokens. However, your "
            f"prompt is at least {exc.min_tokens} tokens long. Please reduce its length.",
            max_context_tokens=exc.limit,
            prompt_tokens=exc.min_tokens,
            param=param,
        ) from exc


@dataclass(frozen=True, slots=True)
class StartedChat:
    """A chat generation admitted: its first token exists."""

    admitted: Admitted
    # One per choice: reads tool calls out of its text, when tools may be called.
    readers: list[_ToolCallReader | None]
    prompt_tokens: int

    @property
    def reader(self) -> _ToolCallReader | None:
        return self.readers[0]


async def start_chat(
    body: ChatCompletionRequest, request: Request, state: AppState, tenant: Tenant, endpoint: str
) -> StartedChat:
    """Check, tokenize and admit a chat request (the OpenAI route's and the Messages
    route's, which translates into one)."""
    rid = request_id(request)
    check_model(state, body.model)
    _reject_unsupported(body.n)
    _refuse_what_chat_cannot_honour(body, state)
    _check_token_ids(body, state.tokenizer.vocab_size)
    max_ttl_s = state.settings.prompt_cache_max_ttl_s
    whole_ttl_s = retention_ttl_s(body.prompt_cache_retention, max_ttl_s)
    cache = read_marks(
        [m.model_dump(exclude_none=True) for m in body.messages],
        body.tools if isinstance(body.tools, list) else None,
        max_ttl_s,
    )
    messages, tools = cache.messages, cache.tools
    breakpoints: list[Breakpoint] = []
    try:
        if cache.marks:
            marked = partial(
                state.tokenizer.chat_token_ids_marked, messages, cache.marks, tools=tools
            )
            counts: list[int] = []

            def encode(limit: int | None) -> list[int]:
                ids, found = marked(limit=limit)
                counts.extend(found)
                return ids

            prompt_ids = await prompt_token_ids(
                state, text_size(messages, tools), encode, "messages"
            )
            breakpoints = [Breakpoint(n, t) for n, t in zip(counts, cache.ttls_s, strict=True)]
        else:
            prompt_ids = await prompt_token_ids(
                state,
                text_size(messages, tools),
                partial(
                    state.tokenizer.chat_token_ids,
                    messages,
                    add_generation_prompt=True,
                    tools=tools,
                    cache_scope=tenant.name,
                ),
                "messages",
            )
    except ChatTemplateError as exc:
        raise InvalidRequest(str(exc), param="messages") from exc
    if whole_ttl_s is not None:
        breakpoints.append(Breakpoint(len(prompt_ids), whole_ttl_s))
    adm = await admit(
        state,
        endpoint,
        rid,
        tenant,
        prompt_ids,
        body,
        body.max_completion_tokens or body.max_tokens,
        "messages",
        request_slo(request, state),
        response_format=_forced_call_format(body),
        breakpoints=tuple(breakpoints),
        cache_key=body.prompt_cache_key or "",
    )
    readers = [_ToolCallReader.for_request(body, state) for _ in range(adm.n)]
    return StartedChat(adm, readers, len(prompt_ids))


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses={
        **streamed(ChatCompletionResponse, ChatCompletionChunk),
        **errors(*GENERATION_ERRORS),
    },
)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, state: StateDep, tenant: TenantDep
) -> Response:
    rid = request_id(request)
    log_unknown_fields(rid, body.unknown_fields())
    chat = await start_chat(body, request, state, tenant, "chat_completions")
    adm, readers = chat.admitted, chat.readers
    completion_id = new_chat_completion_id()
    created = int(time.time())
    model = state.model_name
    if not body.stream:
        _, _, usage = await adm.collect()
        choices = []
        for index, (result, reader) in enumerate(zip(adm.choices, readers, strict=True)):
            content: str | None = result.text
            calls: list[ToolCall] | None = None
            finish = result.finish
            if reader is not None:
                said, made = collect(reader.read(result.text, last=True))
                content = said or None
                calls = [_tool_call(c) for c in made] or None
                finish = reader.finish_reason(finish)
            logprobs = chat_logprobs(state.tokenizer, result.logprobs) if body.logprobs else None
            choices.append(
                ChatCompletionChoice(
                    index=index,
                    message=ChatCompletionMessage(content=content, tool_calls=calls),
                    logprobs=logprobs,
                    finish_reason=finish,
                )
            )
        response = ChatCompletionResponse(
            id=completion_id,
            created=created,
            model=model,
            choices=choices,
            usage=_usage_model(usage),
        )
        return JSONResponse(response.model_dump(), headers={"X-Request-Id": rid, **adm.headers})

    include_usage = body.include_usage
    plain = ContentChunks(completion_id, created, model, include_usage)

    def chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> str:
        c = ChatCompletionChunk(
            id=completion_id, created=created, model=model, choices=choices, usage=usage
        )
        return sse_data(chunk_json(c, include_usage))

    def make_chunk(delta: TokenDelta | None, usage: UsageCounts | None) -> str | None:
        if delta is None:
            if include_usage and usage is not None:
                return chunk([], _usage_model(usage))
            return None
        text = delta.text
        finish = delta.finish_reason
        index = delta.index
        reader = readers[index]
        logprobs = None
        if delta.logprobs:
            pairs = zip(delta.token_ids, delta.logprobs, strict=True)
            logprobs = chat_logprobs(state.tokenizer, pairs)
        if reader is None:
            if not text and finish is None and logprobs is None:
                return None
            if finish is None and logprobs is None and (event := plain.event(index, text)):
                return event
            return chunk([ChunkChoice(index=index, delta=ChoiceDelta(content=text or None),
                                      logprobs=logprobs, finish_reason=finish)])  # fmt: skip
        # Text and calls in the order written (``_chat_deltas``); the finish reason in a
        # chunk of its own. This delta's logprobs ride on its first chunk (an empty delta
        # when the text is held back).
        started = reader.called
        events = reader.read(text, last=finish is not None)
        parts = _chat_deltas(events, started)
        if logprobs is not None and not parts:
            parts = [ChoiceDelta()]
        out = [
            chunk([ChunkChoice(index=index, delta=part, logprobs=logprobs if i == 0 else None)])
            for i, part in enumerate(parts)
        ]
        if finish is not None:
            finish = reader.finish_reason(finish)
            done = ChunkChoice(index=index, delta=ChoiceDelta(), finish_reason=finish)
            out.append(chunk([done]))
        return "".join(out) or None

    first = "".join(
        chunk([ChunkChoice(index=i, delta=ChoiceDelta(role="assistant", content=""))])
        for i in range(adm.n)
    )
    return GenerationResponse(adm, make_chunk, first, rid)


@router.post(
    "/v1/completions",
    response_model=None,
    responses={**streamed(CompletionResponse, CompletionChunk), **errors(*GENERATION_ERRORS)},
)
async def completions(
    body: CompletionRequest, request: Request, state: StateDep, tenant: TenantDep
) -> Response:
    rid = request_id(request)
    log_unknown_fields(rid, body.unknown_fields())
    check_model(state, body.model)
    _reject_unsupported(body.n)
    _refuse_what_completion_cannot_honour(body, state)
    _check_token_ids(body, state.tokenizer.vocab_size)
    whole_ttl_s = retention_ttl_s(
        body.prompt_cache_retention, state.settings.prompt_cache_max_ttl_s
    )
    prompt = body.single_prompt()
    if prompt is None:
        raise InvalidRequest("Only a single prompt per request is supported.", param="prompt")
    if isinstance(prompt, str):
        prompt_ids = await prompt_token_ids(
            state,
            len(prompt),
            partial(state.tokenizer.encode, prompt, add_special_tokens=body.add_special_tokens),
            "prompt",
        )
    else:
        vocab = state.tokenizer.vocab_size
        if prompt and max(prompt) >= vocab:
            raise InvalidRequest(
                f"Token ids must be below the vocabulary size {vocab}.", param="prompt"
            )
        prompt_ids = list(prompt)

    adm = await admit(
        state,
        "completions",
        rid,
        tenant,
        prompt_ids,
        body,
        body.max_tokens,
        "prompt",
        request_slo(request, state),
        breakpoints=() if whole_ttl_s is None else (Breakpoint(len(prompt_ids), whole_ttl_s),),
        cache_key=body.prompt_cache_key or "",
    )
    completion_id = new_completion_id()
    created = int(time.time())
    model = state.model_name
    # echo: the prompt's text leads each choice (vLLM's and OpenAI's legacy behaviour).
    echoed = "" if not body.echo else prompt if isinstance(prompt, str) else (
        state.tokenizer.decode(prompt_ids)
    )  # fmt: skip
    if not body.stream:
        _, _, usage = await adm.collect()
        response = CompletionResponse(
            id=completion_id,
            created=created,
            model=model,
            choices=[
                CompletionChoice(
                    text=echoed + result.text,
                    index=index,
                    logprobs=None
                    if body.logprobs is None
                    else completion_logprobs(state.tokenizer, result.logprobs)[0],
                    finish_reason=result.finish,
                )
                for index, result in enumerate(_best(adm.choices, body.n))
            ],
            usage=_usage_model(usage),
        )
        return JSONResponse(response.model_dump(), headers={"X-Request-Id": rid, **adm.headers})

    include_usage = body.include_usage
    offsets = [0] * adm.n  # of each choice's next token in its text (logprobs.text_offset)
    plain = ContentChunks(completion_id, created, model, include_usage, "completions")

    def make_chunk(delta: TokenDelta | None, usage: UsageCounts | None) -> str | None:
        if delta is None:
            if include_usage and usage is not None:
                c = CompletionChunk(
                    id=completion_id,
                    created=created,
                    model=model,
                    choices=[],
                    usage=_usage_model(usage),
                )
                return sse_data(chunk_json(c, include_usage))
            return None
        logprobs = None
        if delta.logprobs:
            pairs = zip(delta.token_ids, delta.logprobs, strict=True)
            logprobs, offsets[delta.index] = completion_logprobs(
                state.tokenizer, pairs, offsets[delta.index]
            )
        if not delta.text and delta.finish_reason is None and logprobs is None:
            return None
        if delta.finish_reason is None and logprobs is None:
            event = plain.event(delta.index, delta.text)
            if event is not None:
                return event
        c = CompletionChunk(
            id=completion_id,
            created=created,
            model=model,
            choices=[
                CompletionChunkChoice(
                    text=delta.text,
                    index=delta.index,
                    logprobs=logprobs,
                    finish_reason=delta.finish_reason,
                )
            ],
        )
        return sse_data(chunk_json(c, include_usage))

    first = None
    if echoed:
        first = "".join(
            sse_data(
                chunk_json(
                    CompletionChunk(
                        id=completion_id,
                        created=created,
                        model=model,
                        choices=[CompletionChunkChoice(text=echoed, index=i)],
                    ),
                    include_usage,
                )
            )
            for i in range(adm.n)
        )
    return GenerationResponse(adm, make_chunk, first, rid)


def _best(results: list[ChoiceResult], n: int) -> list[ChoiceResult]:
    """``best_of``: the ``n`` generations with the highest mean log-probability per
    token, best first (all of them, in order, when there are only ``n``)."""
    if len(results) <= n:
        return results

    def mean_logprob(result: ChoiceResult) -> float:
        values = [entry.logprob for _, entry in result.logprobs]
        return sum(values) / len(values) if values else -math.inf

    return sorted(results, key=mean_logprob, reverse=True)[:n]


@router.get("/v1/models", responses=errors(401))
async def list_models(state: StateDep, _tenant: TenantDep) -> ModelList:
    return ModelList(data=[state.model_card()])


@router.get("/v1/models/{model:path}", responses=errors(401, 404))
async def get_model(model: str, state: StateDep, _tenant: TenantDep) -> ModelCard:
    check_model(state, model)
    return state.model_card()
