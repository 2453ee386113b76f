"""The one place agent exceptions become gRPC status codes (and ``ErrorInfo`` trailers).

Every RPC method of ``NodeAgentService`` is wrapped in ``maps_errors``: the agent's own
exceptions (``node_agent.errors``, the pool's ``BlockPoolError``) raised by a unary
method, or by a streaming one before or between its messages, abort the call with the
status below; the reasons a conductor acts on travel in an ``ErrorInfo`` under
``kvc.wire.ERROR_INFO_KEY``.

============================  ====================  ===========================
exception                     status                ErrorInfo.reason
============================  ====================  ===========================
Draining                      UNAVAILABLE           draining
CapacityExhausted             RESOURCE_EXHAUSTED    capacity (+ needed, free)
EngineBusy                    RESOURCE_EXHAUSTED    busy
TenantQuotaExceeded           RESOURCE_EXHAUSTED    tenant_quota
TenantMismatch, NotPermitted  PERMISSION_DENIED     —
InvalidArgument, Prompt…      INVALID_ARGUMENT      —
Unsupported                   UNIMPLEMENTED         unsupported
TxNotFound, NotStaged         NOT_FOUND             —
TxClosed, ContentMissing      FAILED_PRECONDITION   —
TransferError                 UNAVAILABLE           transfer
any other of them             INTERNAL (logged)     —
============================  ====================  ===========================
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn, TypeVar, cast

import grpc

from kvc.v1 import node_agent_pb2 as pb
from kvc.wire import ERROR_INFO_KEY
from node_agent.blocks.types import (
    BlockPoolError,
    CapacityExhausted,
    InvalidArgument,
    TenantMismatch,
    TenantQuotaExceeded,
    TxClosed,
    TxNotFound,
)
from node_agent.errors import (
    ContentMissing,
    Draining,
    EngineBusy,
    EngineError,
    NotPermitted,
    NotStaged,
    PromptRejected,
    TransferError,
    Unsupported,
)

__all__ = ["AGENT_ERRORS", "Context", "abort", "grpc_error", "maps_errors"]

log = logging.getLogger("node_agent")

Context = grpc.aio.ServicerContext[Any, Any]
AGENT_ERRORS = (
    BlockPoolError,
    EngineError,
    TransferError,
    NotStaged,
    ContentMissing,
    NotPermitted,
)

F = TypeVar("F", bound=Callable[..., Any])


def grpc_error(exc: Exception) -> tuple[grpc.StatusCode, str, pb.ErrorInfo | None]:
    """(status, message, trailer) for one of the agent's exceptions."""
    if isinstance(exc, Draining):
        return grpc.StatusCode.UNAVAILABLE, str(exc), pb.ErrorInfo(reason="draining")
    if isinstance(exc, CapacityExhausted):
        info = pb.ErrorInfo(
            reason="capacity", needed_blocks=exc.needed_blocks, free_blocks=exc.free_blocks
        )
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), info
    if isinstance(exc, TenantQuotaExceeded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), pb.ErrorInfo(reason="tenant_quota")
    if isinstance(exc, TenantMismatch | NotPermitted):
        return grpc.StatusCode.PERMISSION_DENIED, str(exc), None
    if isinstance(exc, EngineBusy):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), pb.ErrorInfo(reason="busy")
    if isinstance(exc, Unsupported):
        return grpc.StatusCode.UNIMPLEMENTED, str(exc), pb.ErrorInfo(reason="unsupported")
    if isinstance(exc, InvalidArgument | PromptRejected):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc), None
    if isinstance(exc, TxNotFound | NotStaged):
        return grpc.StatusCode.NOT_FOUND, str(exc), None
    if isinstance(exc, TxClosed | ContentMissing):  # expired/finished tx; blocks lack KV
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc), None
    if isinstance(exc, TransferError):  # the peer failed us; this node itself is fine
        return grpc.StatusCode.UNAVAILABLE, str(exc), pb.ErrorInfo(reason="transfer")
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}", None


async def abort(context: Context, exc: Exception) -> NoReturn:
    """End the call with ``exc``'s status (and its ``ErrorInfo`` trailer)."""
    code, message, info = grpc_error(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("internal error: %s", message, exc_info=exc)
    if info is not None:
        context.set_trailing_metadata(((ERROR_INFO_KEY, info.SerializeToString()),))
    await context.abort(code, message)
    raise AssertionError("context.abort returned")  # pragma: no cover


def maps_errors(method: F) -> F:
    """Wrap a unary (``async def``) or server-streaming (async generator) RPC method so
    that the agent's exceptions end the call with their status (``abort``)."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self: object, request: object, context: Context) -> AsyncIterator[Any]:
            try:
                async for msg in method(self, request, context):
                    yield msg
            except AGENT_ERRORS as exc:
                await abort(context, exc)

        return cast(F, stream)

    @functools.wraps(method)
    async def unary(self: object, request: object, context: Context) -> Any:
        try:
            return await method(self, request, context)
        except AGENT_ERRORS as exc:
            await abort(context, exc)

    return cast(F, unary)
