"""Client of an agent's token stream (``kvc/stream_frames.py``): ``Generate`` without
gRPC's per-message cost, used when the agent advertises ``NodeInfo.stream_address``; and
the calls it lists in ``NodeInfo.stream_methods`` (``Prefill``, ``GetInfo``,
``Snapshot``, ``WatchEvents``) without gRPC's per-call cost (``unary``, ``stream``).

A ``StreamCall`` behaves as the dispatcher uses a gRPC ``UnaryStreamCall``: ``read()``
answers the next ``GenerateResponse`` (or the called method's message) or
``grpc.aio.EOF``; a failure is the same
``grpc.aio.AioRpcError`` (status code, details, ``ErrorInfo`` trailer) a gRPC call
raises, so error translation, retries and metrics do not change; ``cancel()`` closes the
connection, which makes the agent cancel the generation (and abort its fused Tx). One
call per connection at a time; finished calls return their connection to a small idle
pool per agent. The call's deadline is one timer, not one per message.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any, Final, TypeVar, cast

import grpc
from google.protobuf.message import Message

from kvc.stream_frames import (
    END,
    ERROR,
    GENERATE,
    MESSAGE,
    FrameError,
    FrameReader,
    call_frame,
    frame,
    keep_alive,
    parse_error,
)
from kvc.tls import AGENT_NAME, PlaintextPolicy, TlsFiles, check_plaintext
from kvc.v1 import node_agent_pb2 as pb
from kvc.wire import ERROR_INFO_KEY, MAX_MESSAGE_BYTES

__all__ = ["StreamCall", "TokenStreamClient"]

_MAX_IDLE: Final = 256  # idle connections kept per agent
_CODES: Final = {code.value[0]: code for code in grpc.StatusCode}
_Frame = tuple[int, bytes]
M = TypeVar("M", bound=Message)

# What a StreamCall's messages are: a generation's (batched, the last one carries its
# finish reason), a unary call's one answer, or a stream's messages until END.
_GENERATE: Final = 0
_UNARY: Final = 1
_STREAM: Final = 2


def _rpc_error(
    code: grpc.StatusCode, details: str, error_info: bytes = b""
) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata((ERROR_INFO_KEY, error_info)) if error_info else None
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing or grpc.aio.Metadata(), details)


def _append(message: pb.GenerateResponse, later: pb.GenerateResponse) -> None:
    """``message`` followed by ``later``, as one message: tokens, text and logprobs
    joined; the end (finish reason, stop sequence, usage) is the later one's."""
    message.token_ids.extend(later.token_ids)
    message.text += later.text
    message.logprobs.extend(later.logprobs)
    if later.HasField("timings") and not message.HasField("timings"):
        message.timings.CopyFrom(later.timings)
    if later.finish_reason:
        message.finish_reason = later.finish_reason
        message.stop_sequence = later.stop_sequence
        message.usage.CopyFrom(later.usage)


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self._reader = FrameReader(MAX_MESSAGE_BYTES)
        self.transport: asyncio.Transport | None = None
        self.frames: collections.deque[_Frame | None] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.on_frame: Callable[[], None] | None = None  # set while only END is awaited
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        keep_alive(transport)  # a vanished agent fails the watch instead of hanging it

    def data_received(self, data: bytes) -> None:
        try:
            self.frames.extend(self._reader.feed(data))
        except FrameError:
            self.close()
            self.frames.append(None)
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.frames.append(None)  # end of the stream, whatever was in flight
        self._wake()

    def _wake(self) -> None:
        if self.on_frame is not None:
            self.on_frame()
        elif self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class TokenStreamClient:
    """Calls to one agent's token stream listener at ``address`` (host:port)."""

    def __init__(self, address: str, tls: TlsFiles | None, plaintext: PlaintextPolicy) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"token stream address {address!r} is not host:port")
        if tls is None:
            check_plaintext(address, plaintext, "to " + address)
        self.address = address
        self._host = host.strip("[]")
        self._port = int(port)
        self._ssl = tls.client_ssl_context() if tls is not None else None
        self._idle: list[_Connection] = []

    def generate(self, request: pb.GenerateRequest, *, timeout: float | None) -> StreamCall:
        payload = frame(GENERATE, request.SerializeToString())
        return StreamCall(self, payload, pb.GenerateResponse.FromString, timeout, _GENERATE)

    def stream(
        self, method: str, request: Message, parse: Callable[[bytes], Message]
    ) -> StreamCall:
        """A server-streaming ``method`` (``WatchEvents``): read to ``grpc.aio.EOF``."""
        payload = call_frame(method, request.SerializeToString())
        return StreamCall(self, payload, parse, None, _STREAM)

    async def unary(
        self, method: str, request: Message, parse: Callable[[bytes], M], *, deadline_s: float
    ) -> M:
        """A unary ``method``'s answer within ``deadline_s``; failures raise as the gRPC
        call's do (``DEADLINE_EXCEEDED`` past it)."""
        call = StreamCall(
            self, call_frame(method, request.SerializeToString()), parse, deadline_s, _UNARY
        )
        try:
            reply = await call.read()
        except BaseException:
            call.cancel()
            raise
        if reply is grpc.aio.EOF:
            raise _rpc_error(grpc.StatusCode.INTERNAL, f"token stream: {method} answered nothing")
        return cast(M, reply)

    async def _connection(self) -> _Connection:
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed:
                return connection
        loop = asyncio.get_running_loop()
        extra: dict[str, Any] = {}
        if self._ssl is not None:
            extra = {"ssl": self._ssl, "server_hostname": AGENT_NAME}
        _, protocol = await loop.create_connection(_Connection, self._host, self._port, **extra)
        return protocol

    def _release(self, connection: _Connection) -> None:
        if connection.closed or connection.frames or len(self._idle) >= _MAX_IDLE:
            connection.close()
        else:
            connection.waiter = None
            connection.on_frame = None
            self._idle.append(connection)

    def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()


class StreamCall:
    """One call over the token stream (see the module's docstring)."""

    def __init__(
        self,
        client: TokenStreamClient,
        request: bytes,
        parse: Callable[[bytes], Message],
        timeout: float | None,
        mode: int,
    ) -> None:
        self._client = client
        self._request = request  # the call's whole first frame
        self._parse = parse
        self._mode = mode
        self._timeout = timeout
        self._connection: _Connection | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False
        self._cancelled = False
        self._done = False

    async def _start(self) -> _Connection:
        loop = asyncio.get_running_loop()
        deadline = None
        if self._timeout is not None:
            deadline = loop.time() + self._timeout
            self._timer = loop.call_at(deadline, self._expire)
        try:
            # The deadline holds while connecting too: a host that drops packets would
            # keep a connect waiting for minutes (SYN retries), past the call's deadline.
            async with asyncio.timeout_at(deadline):
                connection = await self._client._connection()
        except TimeoutError:
            self._expired = True
            raise self._fail(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except OSError as exc:
            raise self._fail(grpc.StatusCode.UNAVAILABLE, f"token stream: {exc}") from exc
        assert connection.transport is not None
        self._connection = connection
        connection.transport.write(self._request)
        return connection

    def _expire(self) -> None:
        self._expired = True
        if self._connection is not None:
            self._connection.close()  # the agent cancels the generation

    def _fail(self, code: grpc.StatusCode, details: str, info: bytes = b"") -> Exception:
        self._finish(keep=False)
        if self._expired:
            code, details, info = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", b""
        return _rpc_error(code, details, info)

    def _finish(self, *, keep: bool) -> None:
        self._done = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        connection, self._connection = self._connection, None
        if connection is not None:
            if keep:
                self._client._release(connection)
            else:
                connection.close()

    async def read(self) -> Any:
        """The next message, or ``grpc.aio.EOF`` after the last one."""
        if self._cancelled:  # as a cancelled gRPC call's read
            raise asyncio.CancelledError
        if self._done:
            return grpc.aio.EOF
        connection = self._connection or await self._start()
        frames = connection.frames
        while not frames:
            connection.waiter = asyncio.get_running_loop().create_future()
            try:
                await connection.waiter
            finally:
                connection.waiter = None
            if self._cancelled:  # as a cancelled gRPC call's read
                raise asyncio.CancelledError
        item = frames.popleft()
        if item is None:
            raise self._fail(grpc.StatusCode.UNAVAILABLE, "token stream: connection closed")
        kind, payload = item
        if kind == MESSAGE:
            reply = self._message(payload)
            if self._mode != _GENERATE:
                if self._mode == _UNARY:  # its one answer: END follows to free the line
                    self._done = True
                    self._await_end(connection)
                return reply
            message = cast(pb.GenerateResponse, reply)
            # Messages that arrived together are read as one (tokens in order), as a
            # gRPC relay batches them: no wait, only what is already here.
            while (
                not message.finish_reason
                and frames
                and (queued := frames[0]) is not None
                and queued[0] == MESSAGE
            ):
                frames.popleft()
                _append(message, cast(pb.GenerateResponse, self._message(queued[1])))
            if message.finish_reason:
                # The agent's last message: the call is complete for its reader (who
                # need not read on to EOF, as with gRPC); END follows to free the line.
                self._done = True
                self._await_end(connection)
            return message
        if kind == END:
            self._finish(keep=True)
            return grpc.aio.EOF
        if kind == ERROR:
            try:
                code, details, info = parse_error(payload)
            except FrameError as exc:
                raise self._fail(grpc.StatusCode.INTERNAL, f"token stream: {exc}") from exc
            self._finish(keep=True)
            raise _rpc_error(_CODES.get(code, grpc.StatusCode.UNKNOWN), details, info)
        raise self._fail(grpc.StatusCode.INTERNAL, f"token stream: unexpected frame {kind}")

    def _message(self, payload: bytes) -> Message:
        try:
            return self._parse(payload)
        except Exception as exc:  # DecodeError: a peer that does not speak this
            raise self._fail(grpc.StatusCode.INTERNAL, f"token stream: {exc}") from exc

    def _await_end(self, connection: _Connection) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if connection.frames:
            self._end_arrived(connection)
        else:
            connection.on_frame = lambda: self._end_arrived(connection)

    def _end_arrived(self, connection: _Connection) -> None:
        connection.on_frame = None
        item = connection.frames.popleft()
        clean = item is not None and item[0] == END and not connection.frames
        self._finish(keep=clean)

    def cancel(self) -> bool:
        """Stop the call: the connection is closed, so the agent cancels the generation."""
        if self._done:
            return False
        self._cancelled = True
        self._finish(keep=False)
        return True
