"""The conductor's FastAPI app factory.

``create_app(settings)`` builds an app whose lifespan owns every resource (agent
channels, the poll task) on an ``AsyncExitStack``; nothing is created at import
time. All exception handlers are registered in ``_install_error_handlers``: every
error leaves as the OpenAI envelope with its proper status, never a bare 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator
from secrets import token_hex

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conductor.adapters.agents import AgentFleet
from conductor.adapters.discovery import run_discovery
from conductor.adapters.ratelimit import RateLimiter
from conductor.adapters.replica_hints import ReplicaHinter
from conductor.adapters.shadow import ShadowSync
from conductor.api.admin import router as admin_router
from conductor.api.anthropic import MESSAGES_PATH, anthropic_error_body
from conductor.api.anthropic import router as anthropic_router
from conductor.api.extras import router as extras_router
from conductor.api.openai import router as openai_router
from conductor.api.openapi_doc import install as install_openapi
from conductor.api.ops import router as ops_router
from conductor.api.tool_calls import ParserName
from conductor.api.tool_calls import detect as detect_tool_parser
from conductor.core.prefix_index import PrefixIndex
from conductor.core.scheduler import Scheduler
from conductor.core.tier_index import LowerTierIndex
from conductor.dispatch import Dispatcher
from conductor.errors import (
    ConductorError,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
)
from conductor.metrics import ConductorMetrics
from conductor.settings import ConductorSettings
from conductor.state import AppState
from conductor.tenants import TenantDirectory
from kvc import native
from kvc.registry import connect
from kvc.tokenization import ChatTokenizer
from kvc.version import package_version

log = logging.getLogger("conductor")

_REQUEST_ID_OK = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def _error_response(exc: ConductorError, request_id: str | None, path: str = "") -> JSONResponse:
    """The error as the route's API writes them: Anthropic's body on the Messages API,
    OpenAI's envelope everywhere else."""
    headers = dict(exc.headers)
    if request_id:
        headers["X-Request-Id"] = request_id
    body = anthropic_error_body(exc, request_id) if path == MESSAGES_PATH else None
    return JSONResponse(
        body or exc.to_response_body(), status_code=exc.status_code, headers=headers
    )


# BaseException: raised inside the app's body read, they must pass FastAPI, which turns
# any Exception there into a 400 "error parsing the body", up to the middleware below.
class _BodyTooLarge(BaseException):
    pass


class _BodyTimeout(BaseException):
    pass


class RequestContextMiddleware:
    """Assigns ``X-Request-Id`` (accepted when sane, else generated), echoes it on
    every response, refuses bodies over ``max_body_bytes`` with 413, and a body that
    has not arrived in full ``body_timeout_s`` after the request began with 408 (a
    slow client cannot hold a connection and its task for ever)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float = 30.0) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        incoming = headers.get("x-request-id", "")
        request_id = incoming if _REQUEST_ID_OK.match(incoming) else f"req-{token_hex(16)}"
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                raw = [
                    (k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"
                ]
                raw.append((b"x-request-id", request_id.encode()))
                message["headers"] = raw
            await send(message)

        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(scope, receive, send_with_id)
            return
        received = 0
        body_done = False
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s

        async def counting_receive() -> Message:
            nonlocal received, body_done
            if body_done:  # afterwards: waiting for the client to go (no deadline)
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise _BodyTimeout from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise _BodyTooLarge
                body_done = not message.get("more_body", False)
            return message

        try:
            await self.app(scope, counting_receive, send_with_id)
        except _BodyTooLarge:
            if started:
                raise
            await self._too_large(scope, receive, send_with_id)
        except _BodyTimeout:
            if started:
                raise
            exc = RequestTimeout(
                f"The request body did not arrive within {self.body_timeout_s:g} s.", param=None
            )
            response = _error_response(exc, None, scope.get("path", ""))
            response.headers["Connection"] = "close"  # the rest of the body is not read
            await response(scope, receive, send_with_id)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        exc = PayloadTooLarge(
            f"Request body exceeds the limit of {self.max_body_bytes} bytes.", param=None
        )
        await _error_response(exc, None, scope.get("path", ""))(scope, receive, send)


def _install_error_handlers(app: FastAPI) -> None:
    def rid(request: Request) -> str | None:
        return getattr(request.state, "request_id", None)

    async def on_conductor_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ConductorError)
        if exc.status_code >= 500:
            log.warning("request %s failed: %s", rid(request), exc.message)
        return _error_response(exc, rid(request), request.url.path)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        err = InvalidRequest.from_validation_errors(exc.errors())
        return _error_response(err, rid(request), request.url.path)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            err: ConductorError = NotFound(f"Unknown path {request.url.path}.")
        else:
            err = ConductorError(str(exc.detail), code=None)
            err.status_code = exc.status_code  # type: ignore[misc]
            err.error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error_response(err, rid(request), request.url.path)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request %s: unexpected error", rid(request), exc_info=exc)
        return _error_response(ConductorError(), rid(request), request.url.path)

    app.add_exception_handler(ConductorError, on_conductor_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)


def _tool_parser(settings: ConductorSettings, tokenizer: ChatTokenizer) -> ParserName | None:
    choice = settings.tool_call_parser
    if choice == "none":
        return None
    if choice == "auto":
        return detect_tool_parser(tokenizer.chat_template_source)
    return choice


def create_app(
    settings: ConductorSettings, *, poll_agents: bool = True, follow_events: bool = True
) -> FastAPI:
    """Build the conductor app. The switches turn the background loops off (tests):
    ``poll_agents`` (GetInfo health poll), ``follow_events`` (shadow index sync)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            native.log_if_missing(log)
            tokenizer = await asyncio.to_thread(ChatTokenizer.from_dir, settings.model)
            model_name = settings.resolved_served_model_name()
            metrics = ConductorMetrics(redis=bool(settings.redis_url))
            fleet = AgentFleet(
                settings.agents,
                model=model_name,
                rpc_timeout_s=settings.rpc_timeout_s,
                observe_call=metrics.record_agent_call,
                tls=settings.tls_files(),
                plaintext=settings.grpc_plaintext,
                token_stream=settings.token_stream,
            )
            stack.push_async_callback(fleet.aclose)
            redis = connect(settings.redis_url) if settings.redis_url else None
            if redis is not None:
                stack.push_async_callback(redis.aclose)
                metrics.set_redis_up(True)
            tenants = TenantDirectory(
                default_tenant=settings.default_tenant,
                default_requests_per_minute=settings.default_requests_per_minute,
                default_tokens_per_minute=settings.default_tokens_per_minute,
                api_keys=settings.api_keys,
                tenants_file=settings.tenants_file,
                redis=redis,
                keys_in_redis=settings.api_keys_in_redis,
            )
            limiter = RateLimiter(redis, on_redis_state=metrics.set_redis_up)
            index = PrefixIndex()
            lower_tiers = LowerTierIndex(index.max_keys_per_node)
            dispatcher = Dispatcher(
                fleet,
                index,
                Scheduler(settings.scheduler_config()),
                model=model_name,
                lease_s=settings.lease_s,
                rpc_timeout_s=settings.rpc_timeout_s,
                request_timeout_s=settings.request_timeout_s,
                max_waiting=settings.max_waiting_requests,
                telemetry=metrics,
                lower_tiers=lower_tiers,
                affinity_slack_s=settings.prompt_cache_affinity_slack_s,
                prompt_cache_min_tokens=settings.prompt_cache_min_tokens,
            )
            stack.push_async_callback(dispatcher.drain)
            state = AppState(
                settings=settings,
                tokenizer=tokenizer,
                fleet=fleet,
                index=index,
                dispatcher=dispatcher,
                metrics=metrics,
                model_name=model_name,
                tenants=tenants,
                limiter=limiter,
                tool_parser=_tool_parser(settings, tokenizer),
            )
            app.state.conductor = state
            await fleet.refresh_all()
            stop = asyncio.Event()
            tasks: list[asyncio.Task[None]] = []
            if poll_agents:
                tasks.append(asyncio.create_task(fleet.run(settings.agent_poll_interval_s, stop)))
            if redis is not None:
                tasks.append(
                    asyncio.create_task(
                        run_discovery(
                            fleet,
                            redis,
                            model=model_name,
                            static=settings.agents,
                            interval_s=settings.agent_poll_interval_s,
                            stop=stop,
                            on_redis_state=metrics.set_redis_up,
                            grace_s=settings.registry_grace_s,
                        )
                    )
                )
            if follow_events:
                shadow = ShadowSync(
                    fleet, index, on_lag=metrics.event_lag.observe, lower=lower_tiers
                )
                tasks.append(asyncio.create_task(shadow.run(stop)))
                hinter = ReplicaHinter(fleet, index)
                tasks.append(
                    asyncio.create_task(hinter.run(settings.replica_hints_interval_s, stop))
                )

            async def stop_background() -> None:
                stop.set()
                for task in tasks:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

            stack.push_async_callback(stop_background)
            log.info(
                "conductor serving model %s with %d agent(s) configured",
                model_name,
                len(settings.agents),
            )
            yield
            state.draining = True

    app = FastAPI(
        title="kv-conductor",
        version=package_version(),
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
    )
    _install_error_handlers(app)
    app.include_router(openai_router)
    app.include_router(anthropic_router)
    app.include_router(ops_router)
    app.include_router(extras_router)
    app.include_router(admin_router)
    install_openapi(app)
    app.add_middleware(
        RequestContextMiddleware,
        max_body_bytes=settings.max_request_bytes,
        body_timeout_s=settings.body_timeout_s,
    )
    return app
