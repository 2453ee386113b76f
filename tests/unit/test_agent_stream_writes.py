"""The agent's token stream writes what one turn of its event loop produced in one
write (``node_agent.token_stream``): a generation's last message and the END after it
reach the conductor as one segment, not two."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from kvc.stream_frames import END, GENERATE, MESSAGE, FrameReader, frame
from kvc.v1 import node_agent_pb2 as pb
from node_agent.token_stream import _Connection
from tests.conftest import loop_turn, wait_until


class _Transport:
    """The socket side of a connection (asyncio's object): records each write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


async def _served(
    handler: Any, transport: _Transport | None = None
) -> tuple[_Transport, list[list[tuple[int, bytes]]]]:
    transport = transport or _Transport()
    connection = _Connection(handler, {}, lambda _: None)
    connection.connection_made(transport)  # type: ignore[arg-type]
    connection.data_received(frame(GENERATE, b""))
    assert connection.task is not None
    await connection.task
    await loop_turn()  # the write queued at the task's end
    reader = FrameReader(1 << 20)
    return transport, [reader.feed(data) for data in transport.writes]


async def test_the_last_message_and_its_end_leave_in_one_write() -> None:
    gate = asyncio.Event()

    async def handler(request: pb.GenerateRequest, context: Any) -> AsyncIterator[Any]:
        yield pb.GenerateResponse(token_ids=[1], text="a")
        await gate.wait()  # the next tokens come later, in a turn of their own
        yield pb.GenerateResponse(token_ids=[2], text="b", finish_reason=pb.FINISH_REASON_STOP)

    transport = _Transport()
    served = asyncio.ensure_future(_served(handler, transport))
    await wait_until(lambda: len(transport.writes) == 1, poll_s=0)  # the first one is out
    gate.set()
    _, writes = await served
    assert [[kind for kind, _ in frames] for frames in writes] == [[MESSAGE], [MESSAGE, END]]
    assert pb.GenerateResponse.FromString(writes[1][0][1]).finish_reason


async def test_an_error_after_a_message_leaves_with_it_and_nothing_is_lost() -> None:
    async def handler(request: pb.GenerateRequest, context: Any) -> AsyncIterator[Any]:
        yield pb.GenerateResponse(token_ids=[1], text="a")
        raise RuntimeError("boom")

    transport, writes = await _served(handler)
    kinds = [kind for frames in writes for kind, _ in frames]
    assert kinds[0] == MESSAGE
    assert len(kinds) == 2
    assert len(transport.writes) == 1


async def test_a_closed_connection_sends_what_was_written_first() -> None:
    async def handler(request: pb.GenerateRequest, context: Any) -> AsyncIterator[Any]:
        yield pb.GenerateResponse()

    transport = _Transport()
    connection = _Connection(handler, {}, lambda _: None)
    connection.connection_made(transport)  # type: ignore[arg-type]
    connection._write(b"x")
    connection.close()
    assert transport.writes == [b"x"]
    assert transport.closed
    await loop_turn()  # the queued flush finds nothing left
    assert transport.writes == [b"x"]
