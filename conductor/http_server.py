"""The conductor's HTTP server settings for uvicorn, and the one thing uvicorn lacks: a
deadline on a request's headers.

uvicorn closes a connection that stays idle ``timeout_keep_alive`` after a response,
but nothing bounds a connection that never sends its first byte, or sends headers a
byte at a time (slowloris): each holds a socket and a protocol object for ever.
``HeaderDeadlineProtocol`` closes such a connection ``header_timeout_s`` after it opened
(or after a request's first byte) unless the request's headers are complete by then,
answering 408 first. Bodies have their own deadline (``body_timeout_s``, in
``conductor.app.RequestContextMiddleware``); ``max_connections`` caps open connections
(uvicorn answers 503 past it).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from conductor.settings import ConductorSettings

__all__ = ["CorkedTransport", "HeaderDeadlineProtocol", "uvicorn_config"]

# Between the streams' error events at the shutdown deadline and uvicorn cancelling what
# is left: time for the events to leave.
SHUTDOWN_FLUSH_S = 2.0

_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)
_TIMEOUT_BODY = (
    b'{"error":{"message":"The request headers did not arrive in time.",'
    b'"type":"invalid_request_error","param":null,"code":"request_timeout"}}'
)


class CorkedTransport(asyncio.Transport):
    """A connection's transport whose writes in one turn of the event loop leave as one,
    at the turn's end: uvicorn writes a response's headers and each body message apart,
    so a streamed answer's headers and first events (ready together: admission returns
    with the first token) were two writes and two segments, and a JSON answer's headers
    and body too. Closing, aborting and handing the connection on flush (or drop) what
    is queued first; flow control is the wrapped transport's."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending = []
        self._transport.abort()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._flush()
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on each request's headers."""

    header_timeout_s: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.write(_TIMEOUT_RESPONSE % (len(_TIMEOUT_BODY), _TIMEOUT_BODY))
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = CorkedTransport(transport, self.loop)
        self._arm()  # until the first request's headers are in

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()  # a later request on a kept-alive connection

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        self._disarm()  # idle from here on: uvicorn's keep-alive timeout applies
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def uvicorn_config(settings: ConductorSettings, app: Any, log_level: str) -> uvicorn.Config:
    """The conductor's uvicorn configuration: its address, keep-alive, the header
    deadline, the connection cap and the graceful-shutdown bound."""
    protocol = type(
        "ConductorHttpProtocol",
        (HeaderDeadlineProtocol,),
        {"header_timeout_s": settings.header_timeout_s},
    )
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level.lower(),
        access_log=settings.access_log,
        http=protocol,
        timeout_keep_alive=settings.keepalive_timeout_s,
        timeout_graceful_shutdown=math.ceil(settings.shutdown_timeout_s + SHUTDOWN_FLUSH_S),
        limit_concurrency=settings.max_connections,
    )
