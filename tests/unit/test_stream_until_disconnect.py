"""The streamed response's own disconnect watch (``conductor.api.sse``): the outcomes of
Starlette's task-group streaming, for each way a stream can end."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from conductor.api.sse import stream_until_disconnect


class _Client:
    """The ASGI ``receive`` of one request whose body has been read: it waits until
    the test says the client left (or that the server failed)."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()
        self.listening = asyncio.Event()  # the listener is waiting in receive()
        self.error: BaseException | None = None

    async def receive(self) -> dict[str, Any]:
        self.listening.set()
        await self.gone.wait()
        if self.error is not None:
            raise self.error
        return {"type": "http.disconnect"}


async def _forever() -> None:
    """A stream's next token that never comes (until the task is cancelled)."""
    await asyncio.Event().wait()


async def _unfinished_tasks() -> set[asyncio.Task[Any]]:
    """Tasks other than this one that do not end within a second."""
    others = {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}
    if others:
        await asyncio.wait(others, timeout=1.0)
    return {t for t in others if not t.done()}


async def test_a_stream_that_ends_leaves_no_listener() -> None:
    client = _Client()
    sent: list[int] = []

    async def stream() -> None:
        await asyncio.wait_for(client.listening.wait(), timeout=5.0)
        sent.extend(range(3))

    before = await _unfinished_tasks()
    await stream_until_disconnect(stream, client.receive)
    assert sent == [0, 1, 2]
    assert await _unfinished_tasks() == before  # the listener is gone with the stream


async def test_the_client_leaving_ends_the_stream_quietly() -> None:
    client = _Client()
    sent: list[int] = []
    stopped = asyncio.Event()

    async def stream() -> None:
        try:
            sent.extend(range(5))
            client.gone.set()
            await _forever()  # the next token: the client's leaving ends the wait
        finally:
            stopped.set()

    await stream_until_disconnect(stream, client.receive)  # returns: no exception
    assert stopped.is_set()
    assert sent == [0, 1, 2, 3, 4]
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0  # the cancellation was its own
    # And none is left pending for the caller: its next wait completes.
    done, _ = await asyncio.wait([asyncio.ensure_future(client.gone.wait())], timeout=1.0)
    assert len(done) == 1


@pytest.mark.parametrize("client_leaves_too", [False, True])
async def test_a_cancellation_from_outside_propagates(client_leaves_too: bool) -> None:
    """Also when the client leaves at the same moment: the outer cancellation is not
    taken for the client's."""
    client = _Client()
    started = asyncio.Event()

    async def stream() -> None:
        started.set()
        await _forever()

    task = asyncio.create_task(stream_until_disconnect(stream, client.receive))
    await started.wait()
    task.cancel()
    if client_leaves_too:
        client.gone.set()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_error_of_the_stream_propagates() -> None:
    client = _Client()

    async def stream() -> None:
        await asyncio.wait_for(client.listening.wait(), timeout=5.0)
        raise RuntimeError("engine gone")

    before = await _unfinished_tasks()
    with pytest.raises(RuntimeError, match="engine gone"):
        await stream_until_disconnect(stream, client.receive)
    assert await _unfinished_tasks() == before


async def test_an_error_of_receive_propagates() -> None:
    client = _Client()
    client.error = OSError("server failed")

    async def stream() -> None:
        client.gone.set()
        await _forever()

    with pytest.raises(OSError, match="server failed"):
        await stream_until_disconnect(stream, client.receive)
