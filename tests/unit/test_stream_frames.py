"""The token stream's frames (kvc/stream_frames.py): cut the same whatever the reads."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conductor.adapters.token_stream import _append
from kvc.stream_frames import (
    END,
    ERROR,
    GENERATE,
    MESSAGE,
    FrameError,
    FrameReader,
    error_frame,
    frame,
    parse_error,
)
from kvc.v1 import node_agent_pb2 as pb

FRAMES = st.lists(
    st.tuples(st.sampled_from([GENERATE, MESSAGE, END]), st.binary(max_size=300)), max_size=8
)


@given(frames=FRAMES, data=st.data())
def test_any_reads_give_the_same_frames(
    frames: list[tuple[int, bytes]], data: st.DataObject
) -> None:
    wire = b"".join(frame(kind, payload) for kind, payload in frames)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(wire)), max_size=10)))
    reader = FrameReader(max_payload=1024)
    got: list[tuple[int, bytes]] = []
    for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True):
        got += reader.feed(wire[a:b])
    assert got == frames


def test_an_error_frame_carries_the_status_details_and_error_info() -> None:
    ((kind, payload),) = FrameReader(1024).feed(error_frame(8, "no room: ü", b"\x08\x01"))
    assert kind == ERROR
    assert parse_error(payload) == (8, "no room: ü", b"\x08\x01")
    with pytest.raises(FrameError):
        parse_error(b"\x01")
    with pytest.raises(FrameError):
        parse_error(b"\x08\x00\xff\x00\x00\x00")  # details longer than the frame


def test_an_oversized_frame_is_refused_before_it_is_read() -> None:
    reader = FrameReader(max_payload=16)
    with pytest.raises(FrameError, match="exceeds"):
        reader.feed(frame(MESSAGE, b"x" * 17)[:5])  # the header alone tells


def test_messages_read_together_join_in_order() -> None:
    first = pb.GenerateResponse(token_ids=[1, 2], text="ab")
    first.timings.prefill_s = 0.5
    first.logprobs.add(logprob=-0.25)
    first.logprobs.add(logprob=-0.125)
    last = pb.GenerateResponse(
        token_ids=[3], text="c", finish_reason=pb.FINISH_REASON_STOP, stop_sequence="."
    )
    last.usage.completion_tokens = 3
    last.logprobs.add(logprob=-0.5)
    _append(first, last)
    assert (list(first.token_ids), first.text) == ([1, 2, 3], "abc")
    assert [lp.logprob for lp in first.logprobs] == [-0.25, -0.125, -0.5]
    assert first.timings.prefill_s == 0.5
    assert (first.finish_reason, first.stop_sequence) == (pb.FINISH_REASON_STOP, ".")
    assert first.usage.completion_tokens == 3
