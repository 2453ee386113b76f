"""The streamed response's end (``conductor.api.sse``): the last events leave as the
body's end in one write, and only then are the generation's books and the request's
account closed — on success and on a failure mid-stream."""

from __future__ import annotations

from typing import Any, cast

import grpc

from conductor.api.admission import Admitted
from conductor.api.sse import GenerationResponse
from conductor.generation import GenerationStream, Placed, TokenDelta, UsageCounts
from kvc.v1 import node_agent_pb2 as pb


class _ReadSide:
    """The read side of a gRPC server stream (grpc's object, not one of ours)."""

    def __init__(self, messages: list[pb.GenerateResponse | Exception]) -> None:
        self._messages = messages

    async def read(self) -> pb.GenerateResponse | object:
        if not self._messages:
            return grpc.aio.EOF
        item = self._messages.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self) -> bool:
        return True


class _Account:
    """A request's account as the response closes it (the log is the test's); as the
    real one, it counts the first close only."""

    def __init__(self, log: list[str]) -> None:
        self._log = log
        self._closed = False

    def close(self, outcome: str, stream: object = None, usage: object = None) -> None:
        if not self._closed:
            self._closed = True
            self._log.append(f"account {outcome}")


def _response(messages: list[pb.GenerateResponse | Exception], log: list[str]) -> Any:
    stream = GenerationStream(
        _ReadSide(messages),
        pb.GenerateResponse(token_ids=[1], text="a"),
        Placed("p", "p", "both", "both", 0, 0, 0),
        lambda gaps, tokens, reason: log.append(f"books {tokens} {reason}"),
    )
    adm = Admitted(account=cast(Any, _Account(log)), stream=stream, headers={})

    def make_chunk(delta: TokenDelta | None, usage: UsageCounts | None) -> str | None:
        if delta is None:
            return None if usage is None else f"data: usage {usage.completion_tokens}\n\n"
        return f"data: {delta.text}\n\n"

    return GenerationResponse(adm, make_chunk, "data: role\n\n", "req-1")


async def _run(response: Any, log: list[str]) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body":
            log.append(f"body more={message['more_body']}")

    async def receive() -> dict[str, Any]:  # the client stays (spec 2.4: never asked)
        raise AssertionError("not read")

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    await response(scope, receive, send)
    return sent


async def test_the_body_ends_in_one_write_before_the_books_close() -> None:
    log: list[str] = []
    usage = pb.GenerateUsage(prompt_tokens=3, completion_tokens=3)
    messages: list[pb.GenerateResponse | Exception] = [
        pb.GenerateResponse(token_ids=[2], text="b"),
        pb.GenerateResponse(
            token_ids=[3], text="c", finish_reason=pb.FINISH_REASON_LENGTH, usage=usage
        ),
    ]
    sent = await _run(_response(messages, log), log)
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert bodies == [
        b"data: role\n\n" + b"data: a\n\n",  # the first event and the first token: one write
        b"data: b\n\n",
        b"data: c\n\n",
        b"data: usage 3\n\n" + b"data: [DONE]\n\n",  # the tail and [DONE]: one write
    ]
    assert log == [
        "body more=True",
        "body more=True",
        "body more=True",
        "body more=False",  # the client has the whole response...
        "books 3 length",  # ...before the scheduler's books
        "account success",  # and the request's account close
    ]


async def test_a_failure_mid_stream_ends_the_body_with_the_error_then_counts_it() -> None:
    log: list[str] = []
    failure = grpc.aio.AioRpcError(
        grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "boom"
    )
    sent = await _run(_response([pb.GenerateResponse(token_ids=[2], text="b"), failure], log), log)
    last = sent[-1]
    assert last["more_body"] is False
    assert b'"error"' in last["body"]
    assert last["body"].endswith(b"data: [DONE]\n\n")
    # The failed call closed its books as it failed; the account closes after the body.
    assert log == [
        "body more=True",
        "body more=True",
        "books 2 None",
        "body more=False",
        "account upstream_error",
    ]
