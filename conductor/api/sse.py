"""Server-sent events framing of a streamed generation (OpenAI's ``stream: true``).

After the first byte the status is 200: a failure ends the stream with an
``{"error": …}`` event and ``[DONE]``, as OpenAI does.

The last events (the usage chunk and ``[DONE]``, or the error) leave as the body's end
in one write, and the generation's books (the scheduler's, the request's metrics) are
closed after it: the client's response is complete before the conductor's bookkeeping.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from functools import partial

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from conductor.api.admission import Admitted
from conductor.api.schemas import SSE_DONE, sse_data
from conductor.errors import ConductorError
from conductor.generation import TokenDelta, UsageCounts

# (delta, None) for each token delta, then (None, usage) once at the end; None: no event.
ChunkMaker = Callable[[TokenDelta | None, UsageCounts | None], str | None]
# The last event(s) of a stream that failed after it began.
ErrorEvent = Callable[[ConductorError], str]


class FinalEvent(str):
    """The stream's last bytes: ``GenerationResponse`` sends them as the body's end."""

    __slots__ = ()


def openai_error_event(exc: ConductorError) -> str:
    """OpenAI's convention: an ``{"error": …}`` data event, then ``[DONE]``."""
    return sse_data(json.dumps(exc.to_response_body())) + SSE_DONE


async def sse_events(
    adm: Admitted,
    make_chunk: ChunkMaker,
    first_event: str | None,
    *,
    on_error: ErrorEvent = openai_error_event,
    done: str = SSE_DONE,
) -> AsyncGenerator[str, None]:
    """Stream chunks, then ``done``; on error send ``on_error``'s events; always close
    the generation. The last item is a ``FinalEvent`` (the tail and ``done``, or the
    error's events); the generation is closed when the reader closes this generator
    or reads past it. ``first_event`` leaves with the first delta's events, in one
    write: admission returns once the first token exists, so nothing waits for it."""
    outcome = "cancelled"
    usage: UsageCounts | None = None
    pending = first_event or ""  # not yet sent
    try:
        stream = adm.stream
        async for delta in stream:
            if delta.usage is not None:
                usage = delta.usage
            event = pending + (make_chunk(delta, None) or "")
            pending = ""
            if event:
                yield event
            if stream.finished:
                break
        tail = make_chunk(None, usage)
        outcome = "success"  # every token is out; only the tail and ``done`` are left
        yield FinalEvent(pending + (tail or "") + done)
    except ConductorError as exc:
        outcome = "upstream_error"
        yield FinalEvent(pending + on_error(exc))
    finally:
        await adm.stream.aclose()
        adm.finish(outcome, usage)


class GenerationResponse(StreamingResponse):
    """The SSE response of one admitted generation. However it ends (the last event, an
    error, or the client gone, even before the first event was produced) the
    generation is closed and its request counted exactly once."""

    def __init__(
        self,
        adm: Admitted,
        make_chunk: ChunkMaker,
        first_event: str | None,
        request_id: str,
        *,
        on_error: ErrorEvent = openai_error_event,
        done: str = SSE_DONE,
    ) -> None:
        self._adm = adm
        self._events = sse_events(adm, make_chunk, first_event, on_error=on_error, done=done)
        headers = {
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            "X-Request-Id": request_id,
        }
        super().__init__(
            self._events, media_type="text/event-stream", headers={**headers, **adm.headers}
        )

    async def stream_response(self, send: Send) -> None:
        """Starlette's, except that a ``FinalEvent`` ends the body in the same write and
        the events are not read on: the generation is closed after (``__call__``)."""
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        async for chunk in self._events:
            last = chunk.__class__ is FinalEvent
            await send(
                {"type": "http.response.body", "body": chunk.encode(), "more_body": not last}
            )
            if last:
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if self.background is None and _spec_version(scope) < (2, 4):
                await stream_until_disconnect(partial(self.stream_response, send), receive)
            else:
                await super().__call__(scope, receive, send)
        finally:
            # Started, the generator closes itself in its ``finally``; never started
            # (cancelled at the response start), only ``abandon`` closes the generation.
            await self._events.aclose()
            await self._adm.abandon()


async def stream_until_disconnect(stream: Callable[[], Awaitable[None]], receive: Receive) -> None:
    """Starlette's streaming for servers of ASGI spec < 2.4 (uvicorn: a send to a client
    that left does not raise), without its anyio task group: ``stream`` runs in this
    task while one plain task waits for ``http.disconnect`` and cancels this one when
    the client goes. Same outcomes: the client gone ends the response quietly; an error
    of ``stream`` or of ``receive``, or a cancellation from outside, propagates."""
    streamer = asyncio.current_task()
    assert streamer is not None
    failure: list[BaseException] = []  # what stopped the listener, if not the client

    async def listen() -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the streaming task
            failure.append(exc)
        streamer.cancel()

    listener = asyncio.create_task(listen())
    try:
        await stream()
    except asyncio.CancelledError:
        if listener.done() and not listener.cancelled() and streamer.uncancel() == 0:
            if failure:
                raise failure[0] from None
            return  # the client went away: the response ends here
        raise
    finally:
        listener.cancel()


def _spec_version(scope: Scope) -> tuple[int, ...]:
    return tuple(map(int, scope.get("asgi", {}).get("spec_version", "2.0").split(".")))
