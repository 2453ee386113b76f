"""The simulated engine's HTTP server: vLLM 0.32's OpenAI API over ``EngineRunner``.

``create_app(config, profile)`` builds a FastAPI app whose lifespan owns the engine
loop task, the KV-event publisher and the HTTP client for KV pulls; ``SimEngineServer``
runs it under uvicorn (port 0 allowed: ``url`` and ``port`` once started).

Routes
    ``POST /v1/completions`` (prompt text or token ids), ``POST /v1/chat/completions``
    (the model folder's chat template), streamed as server-sent events or not;
    ``GET /v1/models``, ``GET /health``, ``POST /tokenize``, ``POST /detokenize``,
    ``GET /metrics`` (``metrics``), ``POST /reset_prefix_cache`` (200, or 409 while
    blocks are in use: vLLM only logs that), and the P/D side channel
    ``POST /kvc_sim/kv_pull`` (``transfer``).

Requests
    Request id: ``X-Request-Id`` header, else the body's ``request_id``, else random;
    the response id is ``cmpl-<id>`` / ``chatcmpl-<id>`` as in vLLM. A prompt of
    ``max_model_len`` tokens or more is refused (400, vLLM's message); ``max_tokens`` is
    capped at what the context leaves. A client that leaves aborts its request (its
    blocks are freed). Errors leave as vLLM's envelope
    ``{"error": {"message", "type", "param", "code"}}``: 400 invalid, 404 unknown model
    or route, 409 conflict, 500 anything unexpected.

Complexity
    Per request: tokenization (text prompts), O(output) detokenization for the text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

import httpx
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvc import fast_json
from kvc.fast_json import FastJsonRoute
from kvc.tokenization import ChatTemplateError, ChatTokenizer, IncrementalDetokenizer
from kvc_sim.profile import Profile
from kvc_sim.vllm_sim.cache import KvBlockPool
from kvc_sim.vllm_sim.config import SimEngineConfig
from kvc_sim.vllm_sim.metrics import METRICS_MEDIA_TYPE, EngineMetrics
from kvc_sim.vllm_sim.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk,
    chat_response,
    chat_role_chunk,
    completion_chunk,
    completion_response,
    error_body,
    usage,
    usage_chunk,
)
from kvc_sim.vllm_sim.runner import EngineRunner, RequestStream
from kvc_sim.vllm_sim.scheduler import EngineRequest, EngineScheduler
from kvc_sim.vllm_sim.tokens import OutputTokens, StopStrings, incomplete_text_ids
from kvc_sim.vllm_sim.transfer import (
    PULL_PATH,
    KvPuller,
    KvPullError,
    RemotePrefill,
    prefill_params,
)

log = logging.getLogger("kvc_sim.vllm_sim.server")

__all__ = ["SimEngineServer", "SimEngineState", "create_app"]


class SimRequestError(Exception):
    """A request the engine refuses: ``status`` and vLLM's error ``kind``."""

    def __init__(self, message: str, status: int = 400, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


@dataclass(slots=True)
class SimEngineState:
    """Everything the routes reach, built by the lifespan."""

    config: SimEngineConfig
    profile: Profile
    tokenizer: ChatTokenizer
    tokens: OutputTokens
    runner: EngineRunner
    puller: KvPuller
    metrics: EngineMetrics


async def _state(request: Request) -> SimEngineState:
    # async: FastAPI runs a sync dependency in a worker thread, a hop per request.
    state: SimEngineState = request.app.state.sim
    return state


State = Annotated[SimEngineState, Depends(_state)]


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class PullRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    remote_request_id: str = Field(min_length=1)
    remote_engine_id: str = Field(min_length=1)


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + fast_json.dumps(data) + b"\n\n"


def create_app(
    config: SimEngineConfig,
    profile: Profile,
    *,
    tokenizer: ChatTokenizer | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> FastAPI:
    """The engine's app; nothing starts before its lifespan does."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            tok = tokenizer or ChatTokenizer.from_dir(config.model_dir)
            events = config.kv_events
            pool = KvBlockPool(
                config.num_gpu_blocks,
                config.block_size,
                enable_caching=config.enable_prefix_caching,
                enable_events=events.publishes,
                num_cpu_blocks=config.num_cpu_blocks,
            )
            output = OutputTokens(
                tok.vocab_size,
                tok.special_token_ids
                | tok.eos_token_ids
                | incomplete_text_ids(tok.decode, tok.vocab_size),
            )
            scheduler = EngineScheduler(
                pool,
                profile,
                output,
                max_model_len=config.max_model_len,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                hold_timeout_s=config.kv_transfer_timeout_s,
                by_priority=config.scheduling_policy == "priority",
            )
            sink = None
            if events.publishes:
                from kvc_sim.vllm_sim.kv_events import ZmqEventPublisher

                publisher = ZmqEventPublisher(events)
                publisher.start()
                stack.push_async_callback(publisher.aclose)
                sink = publisher.publish
                app.state.kv_events_endpoint = publisher.endpoint
                app.state.kv_events_replay_endpoint = publisher.replay_endpoint
            runner = EngineRunner(scheduler, time_scale=config.time_scale, events=sink, sleep=sleep)
            http = await stack.enter_async_context(httpx.AsyncClient(timeout=30.0))
            puller = KvPuller(http, profile, time_scale=config.time_scale, sleep=sleep)
            metrics = EngineMetrics(lambda: runner, config.served_model_name)
            app.state.sim = SimEngineState(config, profile, tok, output, runner, puller, metrics)
            stop = asyncio.Event()
            task = asyncio.create_task(runner.run(stop), name="sim-engine-loop")

            async def stop_loop() -> None:
                stop.set()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

            stack.push_async_callback(stop_loop)
            log.info(
                "simulated engine %s: model %s, %d blocks of %d tokens, profile %s, scale %g",
                config.engine_id, config.served_model_name, config.num_gpu_blocks,
                config.block_size, profile.name, config.time_scale,
            )  # fmt: skip
            yield

    app = FastAPI(title="kvc sim-engine", lifespan=lifespan)
    app.router.route_class = FastJsonRoute  # request bodies decoded by orjson
    app.add_middleware(_MetricsScrape, engine_app=app)
    _install_error_handlers(app)
    _install_routes(app)
    return app


class _MetricsScrape:
    """``GET /metrics`` answered ahead of FastAPI's routing and dependencies: each
    agent polls its engine twice a second, and on a fleet of simulated engines sharing
    a few cores the framework's cost per scrape was larger than the exposition's.
    The only ``/metrics`` handler; anything else goes on to the app (a scrape before
    the engine started: its 404)."""

    def __init__(self, app: ASGIApp, engine_app: FastAPI) -> None:
        self._app = app
        self._engine_app = engine_app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state: SimEngineState | None = getattr(self._engine_app.state, "sim", None)
        if (
            state is None
            or scope["type"] != "http"
            or scope["path"] != "/metrics"
            or scope["method"] != "GET"
        ):
            await self._app(scope, receive, send)
            return
        body = state.metrics.render()
        headers = [
            (b"content-type", METRICS_MEDIA_TYPE.encode("latin-1")),
            (b"content-length", str(len(body)).encode("latin-1")),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(SimRequestError)
    async def _refused(_: Request, exc: SimRequestError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), exc.status, exc.kind), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        return JSONResponse(error_body("; ".join(parts), 400), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "NotFoundError" if exc.status_code == 404 else "BadRequestError"
        return JSONResponse(
            error_body(str(exc.detail), exc.status_code, kind), status_code=exc.status_code
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return JSONResponse(
            error_body(f"{type(exc).__name__}: {exc}", 500, "InternalServerError"),
            status_code=500,
        )


def _check_model(state: SimEngineState, model: str | None) -> None:
    if model is not None and model != state.config.served_model_name:
        raise SimRequestError(f"The model `{model}` does not exist.", 404, "NotFoundError")


def _check_ids(state: SimEngineState, ids: list[int]) -> None:
    vocab = state.tokenizer.vocab_size
    bad = None  # min and max run at C speed; the offender is looked for only if one is out
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        bad = next(t for t in ids if not 0 <= t < vocab)
    if bad is not None:
        raise SimRequestError(f"Token id {bad} is out of vocabulary (size {vocab})")


def _request_id(request: Request, body_id: str | None) -> str:
    return request.headers.get("x-request-id") or body_id or uuid.uuid4().hex


def _install_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(state: State) -> dict[str, Any]:
        config = state.config
        card = {
            "id": config.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": str(config.model_dir),
            "parent": None,
            "max_model_len": config.max_model_len,
            "permission": [],
        }
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, state: State) -> dict[str, Any]:
        _check_model(state, body.model)
        tok = state.tokenizer
        try:
            ids = tok.api_token_ids(
                prompt=body.prompt,
                messages=body.messages,
                add_special_tokens=body.add_special_tokens,
                add_generation_prompt=body.add_generation_prompt,
            )
        except ValueError as exc:  # ChatTemplateError included
            raise SimRequestError(str(exc)) from exc
        strs = tok.token_strs(ids) if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": state.config.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, state: State) -> dict[str, Any]:
        _check_model(state, body.model)
        _check_ids(state, body.tokens)
        return {"prompt": state.tokenizer.decode(body.tokens)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(state: State) -> Response:
        if not state.runner.scheduler.reset_prefix_cache():
            raise SimRequestError("prefix cache not reset: blocks are in use", 409, "ConflictError")
        await state.runner.flush_events()
        return Response(status_code=200)

    @app.post(PULL_PATH)
    async def kv_pull(body: PullRequest, state: State) -> dict[str, Any]:
        if body.remote_engine_id != state.config.engine_id:
            raise SimRequestError(
                f"this is engine {state.config.engine_id!r}, not {body.remote_engine_id!r}",
                409,
                "ConflictError",
            )
        tokens = state.runner.release_held(body.remote_request_id)
        if tokens is None:
            raise SimRequestError(
                f"no KV held for request {body.remote_request_id!r}", 404, "NotFoundError"
            )
        return {"num_tokens": tokens}

    @app.post("/v1/completions", response_model=None)
    async def completions(
        body: CompletionRequest, request: Request, state: State
    ) -> Response | dict[str, Any]:
        _check_model(state, body.model)
        if isinstance(body.prompt, str):
            ids = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            ids = list(body.prompt)
            _check_ids(state, ids)
        rid = "cmpl-" + _request_id(request, body.request_id)
        return await _generate(state, request, body, ids, rid, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest, request: Request, state: State
    ) -> Response | dict[str, Any]:
        _check_model(state, body.model)
        try:
            ids = state.tokenizer.chat_token_ids(
                body.messages,
                add_generation_prompt=body.add_generation_prompt,
                template_kwargs=body.chat_template_kwargs,
            )
        except ChatTemplateError as exc:
            raise SimRequestError(str(exc)) from exc
        rid = "chatcmpl-" + _request_id(request, body.request_id)
        return await _generate(state, request, body, ids, rid, body.requested_max_tokens, chat=True)


async def _generate(
    state: SimEngineState,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    prompt_ids: list[int],
    response_id: str,
    requested_max_tokens: int | None,
    *,
    chat: bool,
) -> Response | dict[str, Any]:
    config = state.config
    limit = config.max_model_len
    if not prompt_ids:
        raise SimRequestError("the prompt is empty")
    if len(prompt_ids) >= limit:
        raise SimRequestError(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"contains {len(prompt_ids)} input tokens, which exceeds this limit even without "
            "any output tokens. Please reduce the length of the input prompt."
        )
    max_tokens = min(requested_max_tokens or limit, limit - len(prompt_ids))
    if body.priority and config.scheduling_policy != "priority":
        raise SimRequestError(
            f"Got priority {body.priority} but Priority scheduling is not enabled."
        )
    params = body.kv_transfer_params or {}
    hold = bool(params.get("do_remote_decode"))
    if hold and body.stream:
        raise SimRequestError("the prefill leg (kv_transfer_params.do_remote_decode) is unstreamed")
    external = 0
    if params.get("do_remote_prefill"):
        try:
            remote = RemotePrefill.from_params(params)
        except ValueError as exc:
            raise SimRequestError(str(exc)) from exc
        try:
            external = await state.puller.pull(remote)
        except KvPullError as exc:
            log.warning("KV pull for %s failed, computing the prompt here: %s", response_id, exc)
    engine_request = EngineRequest(
        request_id=f"{response_id}-{uuid.uuid4().hex[:8]}",
        prompt_ids=tuple(prompt_ids),
        max_tokens=max_tokens,
        token_key=state.tokens.request_key(prompt_ids, body.seed),
        cache_salt=body.cache_salt,
        report_full=body.report_full,
        hold_blocks=hold,
        external_tokens=external,
        priority=body.priority,
    )
    stream = state.runner.submit(engine_request)
    generation = _Generation(state, stream, body.stops)
    created = int(time.time())
    if body.stream:
        return _GenerationResponse(
            _stream(state, generation, body, response_id, created, chat=chat), generation
        )
    try:
        await generation.run_to_end()
    except BaseException:
        generation.abandon()
        raise
    # Rendered as is: FastAPI's encoder would walk every id of an echoed prompt.
    return Response(
        fast_json.dumps(
            _full_response(state, request, generation, body, response_id, created, chat=chat)
        ),
        media_type="application/json",
    )


class _Generation:
    """One request's outputs turned into text, with stop strings applied."""

    def __init__(self, state: SimEngineState, stream: RequestStream, stops: tuple[str, ...]):
        self.state = state
        self.stream = stream
        self.request = stream.request
        self.detok = IncrementalDetokenizer(state.tokenizer, prompt_ids=self.request.prompt_ids)
        self.stops = StopStrings(stops)
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None

    @property
    def stop_reason(self) -> str | None:
        return self.stops.matched

    async def next(self) -> tuple[list[int], str]:
        """The next token and the text it releases; sets ``finish_reason`` at the end."""
        item = await self.stream.get()
        text = self.stops.push(self.detok.push(item.token_id))
        if self.stops.matched is not None:
            if item.finish_reason is None:
                self.state.runner.stop(self.request.request_id)
            self.finish_reason = "stop"
        elif item.finish_reason is not None:
            text += self._end_text()
            self.finish_reason = item.finish_reason if self.stops.matched is None else "stop"
        self.token_ids.append(item.token_id)
        self.text += text
        return [item.token_id], text

    def _end_text(self) -> str:
        """Text held back at the end (a stop string may still match in it)."""
        text = self.stops.push(self.detok.flush())
        return text if self.stops.matched is not None else text + self.stops.flush()

    async def run_to_end(self) -> None:
        while self.finish_reason is None:
            await self.next()

    def abandon(self) -> None:
        if self.finish_reason is None:
            self.state.runner.abort(self.request.request_id)

    def usage(self, *, full: bool) -> dict[str, Any]:
        cached = self.request.num_cached_tokens
        return usage(self.request.num_prompt_tokens, len(self.token_ids), cached or 0, full=full)


class _GenerationResponse(StreamingResponse):
    """A stream that aborts its generation however the response ended (a client gone
    before the first event never starts the body's generator)."""

    def __init__(self, content: AsyncIterator[bytes], generation: _Generation) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._generation.abandon()


def _transfer_params(
    state: SimEngineState, request: Request, generation: _Generation
) -> dict[str, Any] | None:
    engine_request = generation.request
    if not engine_request.hold_blocks:
        return None
    held = state.runner.scheduler.held.get(engine_request.request_id)
    if held is None:
        return None
    config = state.config
    server = request.scope.get("server") or (config.side_channel_host, 0)
    return prefill_params(
        block_ids=held.blocks,
        engine_id=config.engine_id,
        request_id=engine_request.request_id,
        host=config.side_channel_host,
        port=int(server[1]),
        num_tokens=held.num_tokens,
    )


def _full_response(
    state: SimEngineState,
    request: Request,
    generation: _Generation,
    body: CompletionRequest | ChatCompletionRequest,
    response_id: str,
    created: int,
    *,
    chat: bool,
) -> dict[str, Any]:
    assert generation.finish_reason is not None
    model = state.config.served_model_name
    token_ids = list(generation.token_ids) if body.return_token_ids else None
    prompt_ids = list(generation.request.prompt_ids) if body.return_token_ids else None
    common: dict[str, Any] = {
        "request_id": response_id,
        "created": created,
        "model": model,
        "finish_reason": generation.finish_reason,
        "stop_reason": generation.stop_reason,
        "token_ids": token_ids,
        "prompt_token_ids": prompt_ids,
        "usage_info": generation.usage(full=True),
        "kv_transfer_params": _transfer_params(state, request, generation),
    }
    if chat:
        return chat_response(content=generation.text, **common)
    return completion_response(text=generation.text, **common)


async def _stream(
    state: SimEngineState,
    generation: _Generation,
    body: CompletionRequest | ChatCompletionRequest,
    response_id: str,
    created: int,
    *,
    chat: bool,
) -> AsyncIterator[bytes]:
    model = state.config.served_model_name
    prompt_ids = list(generation.request.prompt_ids) if body.return_token_ids else None
    try:
        if chat:
            yield _sse(
                chat_role_chunk(
                    request_id=response_id, created=created, model=model,
                    prompt_token_ids=prompt_ids,
                )
            )  # fmt: skip
        first = True
        while generation.finish_reason is None:
            ids, text = await generation.next()
            if chat:
                chunk = chat_chunk(
                    request_id=response_id, created=created, model=model, content=text,
                    finish_reason=generation.finish_reason, stop_reason=generation.stop_reason,
                    token_ids=ids if body.return_token_ids else None,
                )  # fmt: skip
            else:
                chunk = completion_chunk(
                    request_id=response_id, created=created, model=model, text=text,
                    finish_reason=generation.finish_reason, stop_reason=generation.stop_reason,
                    prompt_token_ids=prompt_ids if first else None, token_ids=ids,
                    return_token_ids=body.return_token_ids,
                )  # fmt: skip
            first = False
            yield _sse(chunk)
        if body.include_usage:
            yield _sse(
                usage_chunk(
                    request_id=response_id, created=created, model=model, chat=chat,
                    usage_info=generation.usage(full=False),
                )
            )  # fmt: skip
        yield b"data: [DONE]\n\n"
    finally:
        generation.abandon()


class SimEngineServer:
    """``create_app`` under uvicorn on ``host:port`` (0: a free port) in this event loop."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app = app
        self._config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", lifespan="on", access_log=False
        )
        self._server = uvicorn.Server(self._config)
        self._task: asyncio.Task[None] | None = None
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self, timeout_s: float = 30.0) -> None:
        self._task = asyncio.create_task(self._server.serve(), name="sim-engine-http")
        async with asyncio.timeout(timeout_s):
            while not self._server.started:
                if self._task.done():
                    self._task.result()
                    raise RuntimeError("the simulated engine's server stopped at start")
                await asyncio.sleep(0.01)
        sockets = [s for server in self._server.servers for s in server.sockets]
        self.port = int(sockets[0].getsockname()[1])

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task
            self._task = None
