"""The conductor's view of a running generation: tokens relayed several to a message
still count their time between tokens per token (the decode cost model learns from it)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import grpc
import pytest

from conductor.generation import GenerationStream, Placed
from kvc.v1 import node_agent_pb2 as pb


class _ReadSide:
    """The read side of a gRPC server stream (grpc's object, not one of ours)."""

    def __init__(self, messages: list[pb.GenerateResponse]) -> None:
        self._messages = messages

    async def read(self) -> pb.GenerateResponse | object:
        return self._messages.pop(0) if self._messages else grpc.aio.EOF

    def cancel(self) -> bool:
        return True


async def test_a_message_of_k_tokens_counts_k_gaps(monkeypatch: pytest.MonkeyPatch) -> None:
    clock: Iterator[float] = itertools.count(0.0, 0.3)  # each read 0.3 s after the last
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    closed: list[tuple[list[float], int, str | None]] = []
    messages = [
        pb.GenerateResponse(token_ids=[2, 3, 4]),  # three tokens in 0.3 s: 0.1 s each
        pb.GenerateResponse(token_ids=[5], finish_reason=pb.FINISH_REASON_LENGTH),
    ]
    stream = GenerationStream(
        _ReadSide(messages),
        pb.GenerateResponse(token_ids=[1]),
        Placed("p", "p", "both", "both", 0, 0, 0),
        lambda gaps, tokens, reason: closed.append((gaps, tokens, reason)),
    )
    deltas = [delta async for delta in stream]
    assert [d.token_ids for d in deltas] == [(1,), (2, 3, 4), (5,)]
    gaps, tokens, reason = closed[0]
    assert gaps == pytest.approx([0.1, 0.1, 0.1, 0.3])
    assert tokens == 5
    assert reason == "length"
    assert stream.mean_gap_s == pytest.approx(0.15)
