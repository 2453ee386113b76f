"""The agent's token stream listener: ``Generate`` over length-prefixed frames
(``kvc/stream_frames.py``) instead of gRPC, for the per-message cost of a long answer.

Each connection serves one call at a time through the servicer's own ``Generate`` —
the same authorization by certificate, the same fused transaction, the same errors —
with a small stand-in for the gRPC servicer context (the verified peer's names, the
error trailer, abort). A closed connection cancels its generation, as a cancelled gRPC
call does. Writes wait while the peer's socket is full (backpressure).

TLS: with the agent's mTLS files, the listener requires a client certificate of the CA
and reloads the files on the next handshake after they change, as the gRPC port does;
without them it is plaintext under the same ``grpc_plaintext`` policy.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import grpc
from google.protobuf.message import DecodeError

from kvc.stream_frames import (
    END,
    GENERATE,
    MESSAGE,
    FrameError,
    FrameReader,
    error_frame,
    frame,
)
from kvc.tls import auth_of_certificate
from kvc.v1 import node_agent_pb2 as pb
from kvc.wire import ERROR_INFO_KEY, MAX_MESSAGE_BYTES

__all__ = ["TokenStreamServer"]

log = logging.getLogger("node_agent.token_stream")

GenerateHandler = Callable[[pb.GenerateRequest, Any], AsyncIterator[pb.GenerateResponse]]


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
    def __init__(self, handler: GenerateHandler, forget: Callable[[_Connection], None]) -> None:
        self._handler = handler
        self._forget = forget
        self._reader = FrameReader(MAX_MESSAGE_BYTES)
        self._transport: asyncio.Transport | None = None
        self._auth: dict[str, list[bytes]] = {}
        self.task: asyncio.Task[None] | None = None
        self._writable: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
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
            if kind != GENERATE or self.task is not None:
                log.warning("token stream: closing a connection: unexpected frame %d", kind)
                self.close()
                return
            self.task = asyncio.get_running_loop().create_task(self._serve(payload))

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
            self._transport.close()

    def _write(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.write(data)

    async def _serve(self, payload: bytes) -> None:
        context = _FrameContext(self._auth)
        try:
            try:
                request = pb.GenerateRequest.FromString(payload)
            except DecodeError:
                raise _Aborted(grpc.StatusCode.INVALID_ARGUMENT, "not a GenerateRequest") from None
            async for message in self._handler(request, context):
                self._write(frame(MESSAGE, message.SerializeToString()))
                if self._writable is not None and not self._writable.done():
                    await self._writable
                if self._transport is None:
                    return
            self._write(frame(END))
        except _Aborted as exc:
            self._write(error_frame(exc.code.value[0], exc.details, context.error_info))
        except Exception as exc:  # the servicer maps agent errors; anything else is a bug
            log.exception("token stream: Generate failed")
            detail = f"internal error: {type(exc).__name__}: {exc}"
            self._write(error_frame(grpc.StatusCode.INTERNAL.value[0], detail, b""))
        finally:
            self.task = None


class TokenStreamServer:
    """Serves ``handler`` (the servicer's ``Generate``) on a TCP port."""

    def __init__(self, handler: GenerateHandler) -> None:
        self._handler = handler
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()

    @property
    def connections(self) -> int:
        """Open connections (conductors keep idle ones for their next call)."""
        return len(self._connections)

    def _connection(self) -> _Connection:
        connection = _Connection(self._handler, self._connections.discard)
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
