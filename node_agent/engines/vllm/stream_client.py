"""The vLLM adapter's streamed POST: one lean HTTP/1.1 keep-alive client, or httpx.

Why not httpx for this call
    ``Generate`` on a vLLM node is one streamed ``POST /v1/completions`` per request, on
    loopback, and the agent relays every token. httpx (with httpcore, anyio and h11) cost
    about a third of the agent's CPU per request in ``bench.hot_path``'s profile;
    ``HttpStreamClient`` is an ``asyncio.Protocol`` feeding httptools' C parser (the one
    uvicorn uses), with a small pool of keep-alive connections. The adapter's poll of
    vLLM's ``/metrics`` (twice a second, on every agent, load or not) takes the same
    client's ``get``: through httpx a poll cost ~1.8 ms of the agent's CPU, ~0.2 ms here,
    and on an idle fleet the poll was most of an agent's CPU. Everything else the adapter
    asks of vLLM (health, models, the P/D prefill, calibration) is neither hot nor
    frequent and stays on httpx. ``HttpxStreamClient`` puts the same
    interface on an ``httpx.AsyncClient`` — the adapter uses it when a test hands it an
    httpx transport (a stand-in vLLM without a socket).

Protocol handled
    HTTP/1.1 responses with ``Content-Length`` or ``Transfer-Encoding: chunked`` bodies
    (httptools decodes the chunking), which is what vLLM's server (uvicorn) sends; a body
    that only the connection's close would end fails as a connection closed mid-response.
    A connection goes back to the pool only when its response was read to the end and
    both sides keep it alive;
    one closed by the server, broken by a parse error, or left mid-body (the caller
    stopped reading) is closed. An idle connection older than ``keepalive_expiry_s``
    (4 s: below uvicorn's — and so vLLM's — 5 s default) is not reused, so the client
    does not race the server's idle close. Every wait (connect, headers, each body chunk)
    is bounded; a timeout or a broken connection raises ``StreamClientError``.

Complexity: O(bytes) per response; O(1) per chunk besides the parser.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Protocol, cast

import httptools
import httpx

__all__ = [
    "HttpStreamClient",
    "HttpxStreamClient",
    "StreamClientError",
    "StreamResponse",
    "StreamingPost",
]

_KEEPALIVE_EXPIRY_S = 4.0


class StreamClientError(Exception):
    """The request could not be sent or its response not read (connection, timeout)."""


class StreamResponse(Protocol):
    """A response whose status and headers have arrived; the body is read on demand."""

    @property
    def status(self) -> int: ...

    def aiter_bytes(self) -> AsyncIterator[bytes]: ...

    async def aread(self) -> bytes: ...


class StreamingPost(Protocol):
    """POST a body and stream the response (``async with client.post(...) as resp``);
    ``get`` reads a whole small answer."""

    def post(
        self, path: str, body: bytes, headers: Mapping[str, str]
    ) -> contextlib.AbstractAsyncContextManager[StreamResponse]: ...

    async def get(self, path: str, timeout_s: float) -> tuple[int, bytes]: ...

    async def aclose(self) -> None: ...


class _Connection(asyncio.Protocol):
    """One keep-alive connection; parses one response at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.received = False  # any byte of the current response arrived
        self.idle_since = 0.0
        self._parser: httptools.HttpResponseParser | None = None
        self._chunks: deque[bytes] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._error: StreamClientError | None = None
        self.status = 0
        self.headers_done = False
        self.message_done = False
        self.keep_alive = False

    # ---------------------------------------------------------------- transport
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCP transport is not an asyncio.Transport subclass, but has its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received = True
        if self._parser is None:  # bytes with no request outstanding: unusable now
            self._fail(StreamClientError("the server sent data with no request outstanding"))
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(StreamClientError(f"malformed HTTP response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.message_done:
            self._fail(StreamClientError(f"the connection closed mid-response ({exc or 'EOF'})"))
        self._wake()

    # ------------------------------------------------------------ parser hooks
    def on_headers_complete(self) -> None:
        assert self._parser is not None
        self.status = self._parser.get_status_code()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._wake()

    def on_message_complete(self) -> None:
        assert self._parser is not None
        self.message_done = True
        self.keep_alive = self._parser.should_keep_alive()
        self._wake()

    # ------------------------------------------------------------------- use
    def send(self, request: bytes) -> None:
        assert self.transport is not None
        self._parser = httptools.HttpResponseParser(self)
        self._chunks.clear()
        self._error = None
        self.received = False
        self.status = 0
        self.headers_done = self.message_done = self.keep_alive = False
        self.transport.write(request)

    def reusable(self) -> bool:
        return self.message_done and self.keep_alive and not self.closed and self._error is None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _fail(self, error: StreamClientError) -> None:
        if self._error is None:
            self._error = error
        self._wake()
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout_s, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    async def wait_headers(self, timeout_s: float) -> None:
        while not self.headers_done:
            self._raise_if_failed()
            await self._wait(timeout_s)
        self._raise_if_failed()

    async def next_chunk(self, timeout_s: float) -> bytes | None:
        """All the body that has arrived since the last call (so a reader that lags
        gets several events at once), or None at its end."""
        while True:
            if self._chunks:
                if len(self._chunks) == 1:
                    return self._chunks.popleft()
                joined = b"".join(self._chunks)
                self._chunks.clear()
                return joined
            if self.message_done:
                return None
            self._raise_if_failed()
            await self._wait(timeout_s)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(StreamClientError("timed out waiting for the server"))


class _LeanResponse:
    def __init__(self, conn: _Connection, read_timeout_s: float) -> None:
        self._conn = conn
        self._timeout_s = read_timeout_s

    @property
    def status(self) -> int:
        return self._conn.status

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        while (chunk := await self._conn.next_chunk(self._timeout_s)) is not None:
            yield chunk

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_bytes()])


class HttpStreamClient:
    """Keep-alive HTTP/1.1 to one ``http://host:port`` (see the module docstring)."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 600.0,
        keepalive_expiry_s: float = _KEEPALIVE_EXPIRY_S,
        max_idle: int = 256,
    ) -> None:
        url = httpx.URL(base_url)
        if url.scheme != "http" or not url.host:
            raise ValueError(f"HttpStreamClient needs an http://host:port URL, got {base_url!r}")
        self._host = url.host
        self._port = url.port or 80
        self._prefix = url.raw_path.decode("ascii").rstrip("/")
        self._host_header = f"{self._host}:{self._port}".encode("ascii")
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._keepalive_expiry_s = keepalive_expiry_s
        self._max_idle = max_idle
        self._idle: list[_Connection] = []
        self._closed = False

    async def _connection(self) -> tuple[_Connection, bool]:
        """A pooled connection (True) or a new one (False)."""
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < self._keepalive_expiry_s:
                return conn, True
            conn.close()
        return await self._connect(), False

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(_Connection, self._host, self._port)
        except (OSError, TimeoutError) as exc:
            raise StreamClientError(
                f"cannot connect to {self._host}:{self._port}: {exc or 'timed out'}"
            ) from exc
        return conn

    def _release(self, conn: _Connection) -> None:
        if conn.reusable() and not self._closed and len(self._idle) < self._max_idle:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()

    @contextlib.asynccontextmanager
    async def post(
        self, path: str, body: bytes, headers: Mapping[str, str]
    ) -> AsyncIterator[StreamResponse]:
        head = [
            b"POST ", (self._prefix + path).encode("ascii"), b" HTTP/1.1\r\nHost: ",
            self._host_header, b"\r\nContent-Type: application/json\r\nContent-Length: ",
            str(len(body)).encode("ascii"), b"\r\n",
        ]  # fmt: skip
        for name, value in headers.items():
            head += [name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n"]
        head.append(b"\r\n")
        async with self._exchange(b"".join(head) + body, self._read_timeout_s) as response:
            yield response

    async def get(self, path: str, timeout_s: float) -> tuple[int, bytes]:
        """``GET path``: (status, whole body), every wait bounded by ``timeout_s``."""
        request = b"".join(
            [b"GET ", (self._prefix + path).encode("ascii"), b" HTTP/1.1\r\nHost: ",
             self._host_header, b"\r\n\r\n"]
        )  # fmt: skip
        async with self._exchange(request, timeout_s) as response:
            return response.status, await response.aread()

    @contextlib.asynccontextmanager
    async def _exchange(self, request: bytes, timeout_s: float) -> AsyncIterator[_LeanResponse]:
        if self._closed:
            raise StreamClientError("the client is closed")
        conn, reused = await self._connection()
        try:
            conn.send(request)
            try:
                await conn.wait_headers(timeout_s)
            except StreamClientError:
                # A pooled connection the server closed as we reused it (nothing came
                # back, so the request was not read): once more on a new connection.
                if not (reused and conn.closed and not conn.received):
                    raise
                conn.close()
                conn = await self._connect()
                conn.send(request)
                await conn.wait_headers(timeout_s)
            yield _LeanResponse(conn, timeout_s)
        finally:
            self._release(conn)

    async def aclose(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()


class _HttpxResponse:
    def __init__(self, response: httpx.Response) -> None:
        self._response = response

    @property
    def status(self) -> int:
        return self._response.status_code

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_bytes():
                yield chunk
        except httpx.HTTPError as exc:
            raise StreamClientError(f"{type(exc).__name__}: {exc}") from exc

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_bytes()])


class HttpxStreamClient:
    """``StreamingPost`` over an ``httpx.AsyncClient`` (a test's stand-in transport)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    @contextlib.asynccontextmanager
    async def post(
        self, path: str, body: bytes, headers: Mapping[str, str]
    ) -> AsyncIterator[StreamResponse]:
        request_headers = {"Content-Type": "application/json", **headers}
        try:
            async with self._client.stream(
                "POST", path, content=body, headers=request_headers
            ) as response:
                yield _HttpxResponse(response)
        except httpx.HTTPError as exc:
            raise StreamClientError(f"{type(exc).__name__}: {exc}") from exc

    async def get(self, path: str, timeout_s: float) -> tuple[int, bytes]:
        try:
            response = await self._client.get(path, timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise StreamClientError(f"{type(exc).__name__}: {exc}") from exc
        return response.status_code, response.content

    async def aclose(self) -> None:
        """The httpx client belongs to the adapter, which closes it."""
