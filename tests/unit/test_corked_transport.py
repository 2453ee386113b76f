"""``conductor.http_server.CorkedTransport``: what one turn of the event loop writes
leaves in one write at the turn's end; closing flushes, aborting drops, and a transport
closing by itself gets nothing more."""

from __future__ import annotations

import asyncio
from typing import Any

from conductor.http_server import CorkedTransport
from tests.conftest import loop_turn


class _Socket(asyncio.Transport):
    """The socket side (asyncio's object): records writes."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closing = False
        self.aborted = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.aborted = self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return 7

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 1)}.get(name, default)


async def test_one_turn_of_writes_is_one_write() -> None:
    sock = _Socket()
    corked = CorkedTransport(sock, asyncio.get_running_loop())
    corked.write(b"HTTP/1.1 200 OK\r\n\r\n")
    corked.write(b"")  # nothing to send: no effect
    corked.write(bytearray(b"data: a\n\n"))
    assert sock.writes == []
    assert corked.get_write_buffer_size() == 7 + 19 + 9
    await loop_turn()
    assert sock.writes == [b"HTTP/1.1 200 OK\r\n\r\ndata: a\n\n"]
    corked.write(b"data: b\n\n")  # a later turn: a write of its own
    await loop_turn()
    assert sock.writes[1:] == [b"data: b\n\n"]
    assert corked.get_extra_info("peername") == ("127.0.0.1", 1)


async def test_close_flushes_abort_drops_and_a_closing_socket_gets_nothing() -> None:
    loop = asyncio.get_running_loop()
    sock = _Socket()
    corked = CorkedTransport(sock, loop)
    corked.writelines([b"a", b"b"])
    corked.close()
    assert sock.writes == [b"ab"]
    assert corked.is_closing()
    await loop_turn()
    assert sock.writes == [b"ab"]

    sock = _Socket()
    corked = CorkedTransport(sock, loop)
    corked.write(b"lost")
    corked.abort()
    await loop_turn()
    assert sock.writes == []
    assert sock.aborted

    sock = _Socket()
    corked = CorkedTransport(sock, loop)
    corked.write(b"late")
    sock.closing = True  # the peer went away within the turn
    await loop_turn()
    assert sock.writes == []
