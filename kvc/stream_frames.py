"""The token stream's wire format: ``Generate``, ``Prefill``, and the agent info and
events a conductor follows, without gRPC's per-call and per-message cost.

A conductor's ``Generate`` call carries one request and then one message per token
batch for the whole generation: over gRPC (``grpc.aio``) each streamed message costs
tens of microseconds of CPU on each side, which for long answers is most of the CPU the
conductor and its agents spend on a request (docs/benchmarks.md, "The request hot
path"). An agent started with ``--stream-port`` also serves ``Generate`` on a plain TCP
listener (TLS with the same mTLS files when those are set) speaking these frames; the
messages are the same protobufs, the errors the same gRPC status codes and
``ErrorInfo``. The same listener serves the calls a conductor makes of every agent all
the time — the ``GetInfo`` poll, ``Snapshot`` and the ``WatchEvents`` stream — and a
disaggregated request's ``Prefill``, as ``CALL`` frames, when the agent lists them in
``NodeInfo.stream_methods``: over gRPC a unary call costs ~20–30× and a streamed message
~6–8× what a frame does (``bench/stream_cost.py``).

A frame is a 5-byte header — payload length (uint32, little-endian) and a kind (one
byte) — and the payload:

=========  ==========  ============================================================
kind       direction   payload
=========  ==========  ============================================================
GENERATE   → agent     a ``GenerateRequest``
CALL       → agent     the method (one byte: ``CALL_METHODS``), then its request
MESSAGE    ← agent     a ``GenerateResponse`` (or the called method's response)
END        ← agent     nothing: the generation ended OK
ERROR      ← agent     status code (uint16 LE), details length (uint32 LE), details
                       (UTF-8), then an ``ErrorInfo`` (may be empty)
=========  ==========  ============================================================

One call at a time per connection; a connection is reused after END or ERROR. A unary
call's answer is one MESSAGE, then END; a streaming call's, MESSAGE frames until END or
ERROR. A method the agent does not serve there ends with ERROR ``UNIMPLEMENTED``. The
caller cancels a call by closing its connection (the agent then cancels the generation
or the stream, as gRPC cancellation does).
"""

from __future__ import annotations

import socket
import struct
from typing import Any, Final

__all__ = [
    "CALL",
    "CALL_METHODS",
    "END",
    "ERROR",
    "GENERATE",
    "HEADER",
    "MESSAGE",
    "FrameError",
    "FrameReader",
    "call_frame",
    "error_frame",
    "frame",
    "keep_alive",
    "parse_error",
]

HEADER: Final = struct.Struct("<IB")
_ERROR_HEAD: Final = struct.Struct("<HI")

GENERATE: Final = 1
MESSAGE: Final = 2
END: Final = 3
ERROR: Final = 4
CALL: Final = 5

# A CALL frame's first byte, by gRPC method name (a name's code never changes).
CALL_METHODS: Final = {"GetInfo": 1, "Snapshot": 2, "WatchEvents": 3, "Prefill": 4}


# TCP keepalive on every token stream connection, as gRPC's channels have it: a peer
# that vanished without closing (a host lost, a partition) is found within
# KEEPALIVE_IDLE_S + KEEPALIVE_PROBES * KEEPALIVE_INTERVAL_S (60 s), and the stream
# waiting on it (a conductor's WatchEvents) fails and starts over instead of waiting
# for ever.
KEEPALIVE_IDLE_S: Final = 30
KEEPALIVE_INTERVAL_S: Final = 10
KEEPALIVE_PROBES: Final = 3


def keep_alive(transport: Any) -> None:
    """Switch TCP keepalive on for ``transport``'s socket (the timings where the
    platform lets them be set)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
    ):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


class FrameError(Exception):
    """The peer sent something that is not a frame of this protocol."""


def frame(kind: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload), kind) + payload


def call_frame(method: str, request: bytes) -> bytes:
    """A CALL frame of ``method`` (a key of ``CALL_METHODS``) with ``request``."""
    return frame(CALL, bytes((CALL_METHODS[method],)) + request)


def error_frame(code: int, details: str, info: bytes) -> bytes:
    text = details.encode("utf-8", errors="replace")
    return frame(ERROR, _ERROR_HEAD.pack(code, len(text)) + text + info)


def parse_error(payload: bytes) -> tuple[int, str, bytes]:
    """(status code, details, ErrorInfo bytes) of an ERROR frame's payload."""
    if len(payload) < _ERROR_HEAD.size:
        raise FrameError("short ERROR frame")
    code, n = _ERROR_HEAD.unpack_from(payload)
    end = _ERROR_HEAD.size + n
    if end > len(payload):
        raise FrameError("ERROR frame details overrun")
    return code, payload[_ERROR_HEAD.size : end].decode("utf-8", errors="replace"), payload[end:]


class FrameReader:
    """Cuts frames out of a byte stream fed in any pieces."""

    def __init__(self, max_payload: int) -> None:
        self._buffer = bytearray()
        self._max = max_payload

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """The frames ``data`` completes, in order; ``FrameError`` on an oversized one."""
        buffer = self._buffer
        buffer += data
        frames: list[tuple[int, bytes]] = []
        at = 0
        size = HEADER.size
        while len(buffer) - at >= size:
            length, kind = HEADER.unpack_from(buffer, at)
            if length > self._max:
                raise FrameError(f"a frame of {length} bytes exceeds {self._max}")
            if len(buffer) - at < size + length:
                break
            frames.append((kind, bytes(buffer[at + size : at + size + length])))
            at += size + length
        if at:
            del buffer[:at]
        return frames
