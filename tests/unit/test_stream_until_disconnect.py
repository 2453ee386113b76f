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
        self.error: BaseException | None = None
        self.waiting = 0

    async def receive(self) -> dict[str, Any]:
        self.waiting += 1
        await self.gone.wait()
        if self.error is not None:
            raise self.error
        return {"type": "http.disconnect"}


async def _idle_tasks() -> set[asyncio.Task[Any]]:
    await asyncio.sleep(0)
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}


async def test_a_stream_that_ends_leaves_no_listener() -> None:
    client = _Client()
    sent: list[int] = []

    async def stream() -> None:
        for i in range(3):
            await asyncio.sleep(0)
            sent.append(i)

    before = await _idle_tasks()
    await stream_until_disconnect(stream, client.receive)
    assert sent == [0, 1, 2]
    assert await _idle_tasks() == before  # the listener is gone with the stream
    assert client.waiting == 1


async def test_the_client_leaving_ends_the_stream_quietly() -> None:
    client = _Client()
    sent: list[int] = []
    stopped = asyncio.Event()

    async def stream() -> None:
        try:
            for i in range(1_000):
                if i == 5:
                    client.gone.set()
                await asyncio.sleep(0)
                sent.append(i)
        finally:
            stopped.set()

    await stream_until_disconnect(stream, client.receive)  # returns: no exception
    assert stopped.is_set()
    assert 5 <= len(sent) < 10  # stopped at once, not run to its end
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0  # the cancellation was its own
    await asyncio.sleep(0)  # and no cancellation is left pending for the caller


@pytest.mark.parametrize("client_leaves_too", [False, True])
async def test_a_cancellation_from_outside_propagates(client_leaves_too: bool) -> None:
    """Also when the client leaves at the same moment: the outer cancellation is not
    taken for the client's."""
    client = _Client()
    started = asyncio.Event()

    async def stream() -> None:
        started.set()
        await asyncio.sleep(60)

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
        await asyncio.sleep(0)
        raise RuntimeError("engine gone")

    before = await _idle_tasks()
    with pytest.raises(RuntimeError, match="engine gone"):
        await stream_until_disconnect(stream, client.receive)
    assert await _idle_tasks() == before


async def test_an_error_of_receive_propagates() -> None:
    client = _Client()
    client.error = OSError("server failed")

    async def stream() -> None:
        client.gone.set()
        await asyncio.sleep(60)

    with pytest.raises(OSError, match="server failed"):
        await stream_until_disconnect(stream, client.receive)
