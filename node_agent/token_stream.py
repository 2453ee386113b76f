"""The agent's token stream listener: ``Generate`` over length-prefixed frames
(``kvc/stream_frames.py``) instead of gRPC, for the per-message cost of a long answer;
and, as ``CALL`` frames, the calls every conductor makes all the time (``GetInfo``,
``Snapshot``, ``WatchEvents``) and a disaggregated request's ``Prefill``, for their
per-call cost.

Each connection serves one call at a time through the servicer's own methods — the
same authorization by certificate, the same fused transaction, the same errors — with a
small stand-in for the gRPC servicer context (the verified peer's names, the error
trailer, abort). A closed connection cancels its generation or stream, as a cancelled
gRPC call does. Writes wait while the peer's socket is full (backpressure).

TLS: with the agent's mTLS files, the listener requires a client certificate of the CA
and reloads the files on the next handshake after they change, as the gRPC port does;
without them it is plaintext under the same ``grpc_plaintext`` policy.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import grpc
from google.protobuf.message import DecodeError, Message

from kvc.stream_frames import (
    CALL,
    CALL_METHODS,
    END,
    GENERATE,
    MESSAGE,
    FrameError,
    FrameReader,
    error_frame,
    frame,
    keep_alive,
)
from kvc.tls import auth_of_certificate
from kvc.v1 import node_agent_pb2 as pb
from kvc.wire import ERROR_INFO_KEY, MAX_MESSAGE_BYTES

__all__ = ["StreamMethod", "TokenStreamServer"]

log = logging.getLogger("node_agent.token_stream")

GenerateHandler = Callable[[pb.GenerateRequest, Any], AsyncIterator[pb.GenerateResponse]]


@dataclass(frozen=True, slots=True)
class StreamMethod:
    """A servicer method served as ``CALL`` frames: how its request parses, and the
    method — a coroutine (unary: one MESSAGE) or an async generator (MESSAGE each)."""

    name: str  # the gRPC method name, a key of ``CALL_METHODS``
    parse: Callable[[bytes], Message]
    unary: Callable[[Any, Any], Awaitable[Message]] | None = None
    streaming: Callable[[Any, Any], AsyncIterator[Message]] | None = None


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _FrameContext:
    """What the servicer's ``Generate`` asks of a gRPC servicer context."""

    def __init__(self, auth: Mapping[str, list[bytes]]) -> None:
        self._auth = auth
        self.error_info = b""

    def auth_context(self) -> Mapping[str, Iterable[bytes]]:
        return self._auth

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, bytes]]) -> None:
        for key, value in metadata:
            if key == ERROR_INFO_KEY:
                self.error_info = value

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Aborted(code, details)


class _Connection(asyncio.Protocol):
    def __init__(
        self,
        handler: GenerateHandler,
        methods: Mapping[int, StreamMethod],
        forget: Callable[[_Connection], None],
    ) -> None:
        self._handler = handler
        self._methods = methods
        self._forget = forget
        self._reader = FrameReader(MAX_MESSAGE_BYTES)
        self._transport: asyncio.Transport | None = None
        self._auth: dict[str, list[bytes]] = {}
        self.task: asyncio.Task[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        self._pending: list[bytes] = []  # frames written this turn of the loop

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        keep_alive(transport)  # a vanished conductor's stream ends instead of lingering
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None:
            self._auth = auth_of_certificate(ssl_object.getpeercert() or {})

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._reader.feed(data)
        except FrameError as exc:
            log.warning("token stream: closing a connection: %s", exc)
            self.close()
            return
        for kind, payload in frames:
            if kind not in (GENERATE, CALL) or self.task is not None:
                log.warning("token stream: closing a connection: unexpected frame %d", kind)
                self.close()
                return
            serve = self._serve(payload) if kind == GENERATE else self._call(payload)
            self.task = asyncio.get_running_loop().create_task(serve)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.task is not None:
            self.task.cancel()  # the caller went away: as a cancelled gRPC call
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._transport = None
        self._forget(self)

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def close(self) -> None:
        if self._transport is not None:
            self._flush()
            self._transport.close()

    def _write(self, data: bytes) -> None:
        """Frames written in one turn of the event loop leave in one write, at its end:
        a generation's last message and the END after it (one segment, one wakeup of
        the conductor instead of two), an answer and its END."""
        if self._transport is None:
            return
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and self._transport is not None:
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    async def _serve(self, payload: bytes) -> None:
        context = _FrameContext(self._auth)
        try:
            try:
                request = pb.GenerateRequest.FromString(payload)
            except DecodeError:
                raise _Aborted(grpc.StatusCode.INVALID_ARGUMENT, "not a GenerateRequest") from None
            await self._stream(self._handler(request, context))
        except _Aborted as exc:
            self._write(error_frame(exc.code.value[0], exc.details, context.error_info))
        except Exception as exc:  # the servicer maps agent errors; anything else is a bug
            self._internal_error("Generate", exc)
        finally:
            self.task = None

    async def _call(self, payload: bytes) -> None:
        """A ``CALL`` frame: the method its first byte names, on the request after it."""
        context = _FrameContext(self._auth)
        method = self._methods.get(payload[0]) if payload else None
        name = method.name if method is not None else "CALL"
        try:
            if method is None:
                code = payload[0] if payload else None
                raise _Aborted(
                    grpc.StatusCode.UNIMPLEMENTED, f"no method {code} on this token stream"
                )
            try:
                request = method.parse(payload[1:])
            except DecodeError:
                raise _Aborted(grpc.StatusCode.INVALID_ARGUMENT, f"not a {name} request") from None
            if method.streaming is not None:
                await self._stream(method.streaming(request, context))
            else:
                assert method.unary is not None
                reply = await method.unary(request, context)
                self._write(frame(MESSAGE, reply.SerializeToString()) + frame(END))
        except _Aborted as exc:
            self._write(error_frame(exc.code.value[0], exc.details, context.error_info))
        except Exception as exc:  # the servicer maps agent errors; anything else is a bug
            self._internal_error(name, exc)
        finally:
            self.task = None

    async def _stream(self, messages: AsyncIterator[Message]) -> None:
        """Each message as a MESSAGE frame (waiting while the peer's socket is full),
        then END; nothing more once the connection is gone."""
        async for message in messages:
            self._write(frame(MESSAGE, message.SerializeToString()))
            if self._writable is not None and not self._writable.done():
                await self._writable
            if self._transport is None:
                return
        self._write(frame(END))

    def _internal_error(self, name: str, exc: Exception) -> None:
        log.exception("token stream: %s failed", name)
        detail = f"internal error: {type(exc).__name__}: {exc}"
        self._write(error_frame(grpc.StatusCode.INTERNAL.value[0], detail, b""))


class TokenStreamServer:
    """Serves ``handler`` (the servicer's ``Generate``), and ``methods`` as ``CALL``
    frames, on a TCP port."""

    def __init__(self, handler: GenerateHandler, methods: Iterable[StreamMethod] = ()) -> None:
        self._handler = handler
        self._methods = {CALL_METHODS[m.name]: m for m in methods}
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()

    @property
    def method_names(self) -> list[str]:
        """The methods served besides ``Generate`` (``NodeInfo.stream_methods``)."""
        return sorted(m.name for m in self._methods.values())

    @property
    def calls(self) -> int:
        """Calls running now (a conductor's ``WatchEvents`` runs as long as it follows)."""
        return sum(1 for c in self._connections if c.task is not None)

    @property
    def connections(self) -> int:
        """Open connections (conductors keep idle ones for their next call)."""
        return len(self._connections)

    def _connection(self) -> _Connection:
        connection = _Connection(self._handler, self._methods, self._connections.discard)
        self._connections.add(connection)
        return connection

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        """Listen; returns the bound port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._connection, host, port, ssl=ssl_context)
        bound: int = self._server.sockets[0].getsockname()[1]
        return bound

    async def stop(self, grace_s: float) -> None:
        """Stop listening, let running generations finish for up to ``grace_s``, then
        close every connection (what still runs is cancelled)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        running = [c.task for c in self._connections if c.task is not None]
        if running and grace_s > 0:
            await asyncio.wait(running, timeout=grace_s)
        for connection in list(self._connections):
            connection.close()
