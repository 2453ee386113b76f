"""OpenAI-compatible HTTP routes and the operational endpoints.

Admission (auth, model, context length, in-flight bound) happens before any
agent is called, and placement + prefill + the first token happen before the
HTTP response starts: every refusal is a proper status code with the OpenAI
error envelope, never an error inside a 200 stream. After the first byte, a
failure ends the stream with an ``{"error": …}`` event, as OpenAI does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from conductor.api.schemas import (
    SSE_DONE,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceDelta,
    ChunkChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    Usage,
    chunk_json,
    new_chat_completion_id,
    new_completion_id,
    sse_data,
)
from conductor.core.ratelimit import Limit, format_reset
from conductor.core.scheduler import Slo
from conductor.dispatch import (
    GenerationRequest,
    GenerationStream,
    TokenDelta,
    UsageCounts,
)
from conductor.errors import (
    AuthenticationFailed,
    ConductorError,
    ContextLengthExceeded,
    InvalidRequest,
    ModelNotFound,
    RateLimited,
    ServiceUnavailable,
    UnprocessableEntity,
)
from conductor.metrics import rejection_reason
from conductor.state import AppState
from conductor.tenants import Tenant
from kvc.sampling import Sampling
from kvc.tokenization import ChatTemplateError

log = logging.getLogger("conductor.api")

router = APIRouter()


def get_state(request: Request) -> AppState:
    state: AppState = request.app.state.conductor
    return state


StateDep = Annotated[AppState, Depends(get_state)]


async def authenticate(request: Request, state: StateDep) -> Tenant:
    """Return the caller's tenant; 401 when keys are configured and none matches."""
    if not state.tenants.auth_required:
        return state.tenants.default
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationFailed(
            "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'."
        )
    tenant = await state.tenants.resolve(token.strip())
    if tenant is None:
        raise AuthenticationFailed("Incorrect API key provided.")
    return tenant


TenantDep = Annotated[Tenant, Depends(authenticate)]


SLO_TTFT_HEADER = "x-kvc-slo-ttft-ms"
SLO_TBT_HEADER = "x-kvc-slo-tbt-ms"


def request_slo(request: Request, state: AppState) -> Slo:
    """The request's SLOs: headers ``X-Kvc-Slo-Ttft-Ms`` / ``X-Kvc-Slo-Tbt-Ms`` or defaults."""
    values = {"ttft": state.settings.ttft_slo_s, "tbt": state.settings.tbt_slo_s}
    for name, header in (("ttft", SLO_TTFT_HEADER), ("tbt", SLO_TBT_HEADER)):
        raw = request.headers.get(header)
        if raw is None:
            continue
        try:
            ms = float(raw)
        except ValueError:
            ms = math.nan
        if not (ms > 0 and math.isfinite(ms)):
            raise InvalidRequest(f"Header {header} must be a positive number of milliseconds.")
        values[name] = ms / 1000.0
    return Slo(ttft_s=values["ttft"], tbt_s=values["tbt"])


def _request_id(request: Request) -> str:
    rid: str = request.state.request_id
    return rid


@dataclass(slots=True)
class _Admitted:
    """A generation that has its first token; closes its books exactly once."""

    state: AppState
    endpoint: str
    stream: GenerationStream
    started: float
    ttft_s: float
    headers: dict[str, str]
    done: bool = False

    def finish(self, outcome: str, usage: UsageCounts | None) -> None:
        if self.done:
            return
        self.done = True
        m = self.state.metrics
        m.requests.labels(self.endpoint, outcome).inc()
        m.request_duration.labels(self.endpoint).observe(time.perf_counter() - self.started)
        m.inflight.dec()
        self.state.inflight -= 1
        if (tbt_s := self.stream.mean_gap_s) is not None:
            m.tbt.labels(self.endpoint).observe(tbt_s)
        if usage is not None:
            cached = min(usage.cached_tokens, usage.prompt_tokens)
            migrated = min(self.stream.placed.migrated_tokens, cached)
            m.prompt_tokens.inc(usage.prompt_tokens)
            m.prompt_cache_tokens.labels("local").inc(cached - migrated)
            m.prompt_cache_tokens.labels("migrated").inc(migrated)
            m.prompt_cache_tokens.labels("computed").inc(usage.prompt_tokens - cached)
            m.completion_tokens.inc(usage.completion_tokens)
            if migrated:
                m.migrations.inc()


async def _check_rate(
    state: AppState, endpoint: str, tenant: Tenant, tokens: int
) -> dict[str, str]:
    """Consume the tenant's request and token budget, or raise 429 with OpenAI's headers."""
    limits = {
        "requests": Limit(tenant.requests_per_minute),
        "tokens": Limit(tenant.tokens_per_minute),
    }
    decision = await state.limiter.check(tenant.name, limits, {"requests": 1, "tokens": tokens})
    headers: dict[str, str] = {}
    for name, dim in decision.dimensions.items():
        headers[f"x-ratelimit-limit-{name}"] = str(dim.limit)
        headers[f"x-ratelimit-remaining-{name}"] = str(dim.remaining)
        headers[f"x-ratelimit-reset-{name}"] = format_reset(dim.reset_s)
    if decision.allowed:
        return headers
    refused = decision.refused_by or "requests"
    dim = decision.dimensions[refused]
    unit = "requests per min (RPM)" if refused == "requests" else "tokens per min (TPM)"
    requested = 1 if refused == "requests" else tokens
    state.metrics.rejections.labels("tenant_rate_limit").inc()
    state.metrics.requests.labels(endpoint, "rejected").inc()
    state.dispatcher.refusals.log(
        "tenant_rate_limit", f"tenant {tenant.name!r}",
        f"{refused} per minute: limit {dim.limit}, remaining {dim.remaining}, "
        f"requested {requested}; Retry-After {decision.retry_after_s:.1f} s",
    )  # fmt: skip
    raise RateLimited(
        f"Rate limit reached for {unit} of tenant {tenant.name!r}: Limit {dim.limit}, "
        f"Remaining {dim.remaining}, Requested {requested}. "
        f"Please try again in {format_reset(decision.retry_after_s)}.",
        retry_after_s=decision.retry_after_s,
        reason="tenant_rate_limit",
        limit_type="tokens" if refused == "tokens" else "requests",
        headers=headers,
    )


async def _admit(
    state: AppState,
    endpoint: str,
    request_id: str,
    tenant: Tenant,
    prompt_ids: list[int],
    max_tokens_requested: int | None,
    sampling: Callable[[int], Sampling],
    prompt_param: str,
    slo: Slo,
) -> _Admitted:
    """Bound, check and place one generation; return once its first token exists."""
    started = time.perf_counter()
    m = state.metrics
    max_len = state.max_model_len()
    if max_len is None:
        m.rejections.labels("no_capacity").inc()
        m.requests.labels(endpoint, "rejected").inc()
        raise ServiceUnavailable("No node serving this model is ready yet.", retry_after_s=2.0)
    if not prompt_ids:
        m.requests.labels(endpoint, "client_error").inc()
        raise InvalidRequest("The prompt is empty.", param=prompt_param)
    room = max_len - len(prompt_ids)
    if room < 1 or (max_tokens_requested is not None and max_tokens_requested > room):
        m.requests.labels(endpoint, "client_error").inc()
        raise ContextLengthExceeded(
            max_context_tokens=max_len,
            prompt_tokens=len(prompt_ids),
            max_new_tokens=max_tokens_requested,
            param=prompt_param,
        )
    max_tokens = max_tokens_requested or min(state.settings.default_max_tokens, room)
    rate_headers = await _check_rate(state, endpoint, tenant, len(prompt_ids) + max_tokens)
    if state.inflight >= state.settings.max_inflight_requests:
        m.rejections.labels("conductor_overloaded").inc()
        m.requests.labels(endpoint, "rejected").inc()
        state.dispatcher.refusals.log(
            "conductor_overloaded", request_id,
            f"{state.inflight} requests in flight, max_inflight_requests "
            f"{state.settings.max_inflight_requests}; Retry-After 1.0 s",
        )  # fmt: skip
        raise RateLimited(
            "This conductor has too many requests in flight; retry shortly.",
            retry_after_s=1.0,
            reason="conductor_overloaded",
        )
    state.inflight += 1
    m.inflight.inc()
    try:
        stream = await state.dispatcher.start(
            GenerationRequest(
                request_id=request_id,
                tenant=tenant.name,
                prompt_ids=tuple(prompt_ids),
                sampling=sampling(max_tokens),
                slo=slo,
            )
        )
    except BaseException as exc:
        state.inflight -= 1
        m.inflight.dec()
        outcome = "cancelled"
        if isinstance(exc, RateLimited):
            outcome = "rejected"
            m.rejections.labels(rejection_reason(exc.reason)).inc()
        elif isinstance(exc, ServiceUnavailable):
            outcome = "rejected"
            m.rejections.labels("unavailable").inc()
        elif isinstance(exc, ConductorError):
            outcome = "client_error" if exc.status_code < 500 else "upstream_error"
        elif isinstance(exc, Exception):
            outcome = "upstream_error"
        m.requests.labels(endpoint, outcome).inc()
        raise
    ttft_s = time.perf_counter() - started
    m.ttft.labels(endpoint).observe(ttft_s)
    return _Admitted(
        state=state,
        endpoint=endpoint,
        stream=stream,
        started=started,
        ttft_s=ttft_s,
        headers=rate_headers,
    )


async def _collect(adm: _Admitted) -> tuple[str, str, UsageCounts]:
    """Run a non-streamed generation to its end: (text, finish_reason, usage)."""
    parts: list[str] = []
    finish = "stop"
    usage: UsageCounts | None = None
    outcome = "cancelled"
    try:
        async for delta in adm.stream:
            parts.append(delta.text)
            if delta.finish_reason is not None:
                finish = delta.finish_reason
                usage = delta.usage
        outcome = "success"
    except ConductorError:
        outcome = "upstream_error"
        raise
    finally:
        await adm.stream.aclose()
        adm.finish(outcome, usage)
    assert usage is not None
    return "".join(parts), finish, usage


def _usage_model(u: UsageCounts) -> Usage:
    return Usage.from_counts(u.prompt_tokens, u.completion_tokens, cached_tokens=u.cached_tokens)


async def _sse(
    adm: _Admitted,
    make_chunk: Callable[[TokenDelta | None, UsageCounts | None], str | None],
    first_event: str | None,
) -> AsyncIterator[str]:
    """Stream chunks; on error send an error event; always close the generation."""
    outcome = "cancelled"
    usage: UsageCounts | None = None
    try:
        if first_event is not None:
            yield first_event
        async for delta in adm.stream:
            if delta.usage is not None:
                usage = delta.usage
            event = make_chunk(delta, None)
            if event is not None:
                yield event
        tail = make_chunk(None, usage)
        if tail is not None:
            yield tail
        yield SSE_DONE
        outcome = "success"
    except ConductorError as exc:
        outcome = "upstream_error"
        yield sse_data(json.dumps(exc.to_response_body()))
        yield SSE_DONE
    finally:
        await adm.stream.aclose()
        adm.finish(outcome, usage)


def _sse_response(adm: _Admitted, body: AsyncIterator[str], request_id: str) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": request_id}
    return StreamingResponse(
        body, media_type="text/event-stream", headers={**headers, **adm.headers}
    )


def _check_model(state: AppState, model: str) -> None:
    if model != state.model_name:
        raise ModelNotFound(model)


def _reject_unsupported(n: int, logprobs: Any) -> None:
    if n != 1:
        raise UnprocessableEntity("Only n=1 is supported.", param="n", code="unsupported_value")
    if logprobs:
        raise UnprocessableEntity(
            "logprobs are not supported yet.", param="logprobs", code="unsupported_value"
        )


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, state: StateDep, tenant: TenantDep
) -> Response:
    request_id = _request_id(request)
    if unknown := body.unknown_fields():
        log.info("request %s: ignoring unknown fields %s", request_id, sorted(unknown))
    _check_model(state, body.model)
    _reject_unsupported(body.n, body.logprobs)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    tools = body.tools if isinstance(body.tools, list) else None
    try:
        prompt_ids = await asyncio.to_thread(
            state.tokenizer.chat_token_ids, messages, add_generation_prompt=True, tools=tools
        )
    except ChatTemplateError as exc:
        raise InvalidRequest(str(exc), param="messages") from exc
    explicit = body.max_completion_tokens or body.max_tokens

    def sampling(max_tokens: int) -> Sampling:
        return Sampling(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            max_tokens=max_tokens,
            seed=body.seed,
            stop=tuple(body.stop_sequences),
            ignore_eos=(body.model_extra or {}).get("ignore_eos") is True,
        )

    adm = await _admit(
        state,
        "chat_completions",
        request_id,
        tenant,
        prompt_ids,
        explicit,
        sampling,
        "messages",
        request_slo(request, state),
    )
    completion_id = new_chat_completion_id()
    created = int(time.time())
    model = state.model_name
    if not body.stream:
        text, finish, usage = await _collect(adm)
        response = ChatCompletionResponse(
            id=completion_id,
            created=created,
            model=model,
            choices=[
                ChatCompletionChoice(
                    index=0,
                    message=ChatCompletionMessage(content=text),
                    finish_reason=finish,
                )
            ],
            usage=_usage_model(usage),
        )
        return JSONResponse(
            response.model_dump(), headers={"X-Request-Id": request_id, **adm.headers}
        )

    include_usage = body.include_usage

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
        if not delta.text and delta.finish_reason is None:
            return None
        return chunk(
            [
                ChunkChoice(
                    index=0,
                    delta=ChoiceDelta(content=delta.text or None),
                    finish_reason=delta.finish_reason,
                )
            ]
        )

    first = chunk([ChunkChoice(index=0, delta=ChoiceDelta(role="assistant", content=""))])
    return _sse_response(adm, _sse(adm, make_chunk, first), request_id)


@router.post("/v1/completions", response_model=None)
async def completions(
    body: CompletionRequest, request: Request, state: StateDep, tenant: TenantDep
) -> Response:
    request_id = _request_id(request)
    _check_model(state, body.model)
    _reject_unsupported(body.n, body.logprobs)
    if body.echo:
        raise UnprocessableEntity(
            "echo is not supported yet.", param="echo", code="unsupported_value"
        )
    prompt = body.single_prompt()
    if prompt is None:
        raise InvalidRequest("Only a single prompt per request is supported.", param="prompt")
    if isinstance(prompt, str):
        prompt_ids = await asyncio.to_thread(state.tokenizer.encode, prompt)
    else:
        vocab = state.tokenizer.vocab_size
        if any(t >= vocab for t in prompt):
            raise InvalidRequest(
                f"Token ids must be below the vocabulary size {vocab}.", param="prompt"
            )
        prompt_ids = list(prompt)

    def sampling(max_tokens: int) -> Sampling:
        return Sampling(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            max_tokens=max_tokens,
            seed=body.seed,
            stop=tuple(body.stop_sequences),
            ignore_eos=(body.model_extra or {}).get("ignore_eos") is True,
        )

    adm = await _admit(
        state,
        "completions",
        request_id,
        tenant,
        prompt_ids,
        body.max_tokens,
        sampling,
        "prompt",
        request_slo(request, state),
    )
    completion_id = new_completion_id()
    created = int(time.time())
    model = state.model_name
    if not body.stream:
        text, finish, usage = await _collect(adm)
        response = CompletionResponse(
            id=completion_id,
            created=created,
            model=model,
            choices=[CompletionChoice(text=text, index=0, finish_reason=finish)],
            usage=_usage_model(usage),
        )
        return JSONResponse(
            response.model_dump(), headers={"X-Request-Id": request_id, **adm.headers}
        )

    include_usage = body.include_usage

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
        if not delta.text and delta.finish_reason is None:
            return None
        c = CompletionChunk(
            id=completion_id,
            created=created,
            model=model,
            choices=[
                CompletionChunkChoice(
                    text=delta.text,
                    index=0,
                    finish_reason=delta.finish_reason,
                )
            ],
        )
        return sse_data(chunk_json(c, include_usage))

    return _sse_response(adm, _sse(adm, make_chunk, None), request_id)


@router.get("/v1/models")
async def list_models(state: StateDep, _tenant: TenantDep) -> ModelList:
    return ModelList(data=[state.model_card()])


@router.get("/v1/models/{model:path}")
async def get_model(model: str, state: StateDep, _tenant: TenantDep) -> ModelCard:
    _check_model(state, model)
    return state.model_card()


@router.get("/health")
async def health() -> dict[str, str]:
    """Liveness: the process serves HTTP."""
    return {"status": "ok"}


@router.get("/ready", response_model=None)
async def ready(state: StateDep) -> Response:
    """Readiness: a prefill-capable and a decode-capable agent are usable."""
    agents = [
        {
            "address": a.address,
            "node_id": a.info.node_id if a.info else None,
            "role": a.role if a.info else None,
            "usable": a.usable,
            "inflight": a.inflight,
            "error": a.last_error or None,
        }
        for a in state.fleet.handles()
    ]
    if state.fleet.ready() and not state.draining:
        return JSONResponse({"status": "ready", "agents": agents})
    reason = "draining" if state.draining else "no usable prefill and decode agents"
    err = ServiceUnavailable(f"Not ready: {reason}.", retry_after_s=2.0)
    body = err.to_response_body()
    body["agents"] = agents
    return JSONResponse(body, status_code=503, headers=err.headers)


@router.get("/metrics")
async def metrics(state: StateDep) -> Response:
    state.metrics.refresh_agents(state.fleet.handles())
    return Response(state.metrics.exposition(), media_type="text/plain; version=0.0.4")
