"""EventLog: strictly increasing sequence numbers, bounded replay, gap detection."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvc.block_keys import BlockKey
from node_agent.blocks.events import EventLog
from node_agent.blocks.types import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored


def test_sequence_starts_at_one_and_increments() -> None:
    log: EventLog[str] = EventLog(epoch="e1", max_buffered=4)
    assert log.last_seq == 0
    assert len(log) == 0
    assert [log.append(x) for x in "abc"] == [1, 2, 3]
    assert log.last_seq == 3
    assert log.epoch == "e1"


@pytest.mark.parametrize(
    ("appended", "from_seq", "expected"),
    [
        (0, 1, []),  # empty log, caught up
        (0, 0, []),  # 0 reads as "from the beginning"
        (0, 2, None),  # ahead of an empty log: other epoch
        (3, 1, [(1, "e1"), (2, "e2"), (3, "e3")]),
        (3, 0, [(1, "e1"), (2, "e2"), (3, "e3")]),
        (3, 3, [(3, "e3")]),
        (3, 4, []),  # caught up
        (3, 5, None),  # from the future
        (6, 3, [(3, "e3"), (4, "e4"), (5, "e5"), (6, "e6")]),  # exactly the oldest buffered
        (6, 2, None),  # evicted from the ring: resync
        (6, 1, None),
        (6, 0, None),
        (6, 7, []),
    ],
)
def test_since(appended: int, from_seq: int, expected: list[tuple[int, str]] | None) -> None:
    log: EventLog[str] = EventLog(epoch="e", max_buffered=4)
    for i in range(1, appended + 1):
        log.append(f"e{i}")
    assert log.since(from_seq) == expected


def test_first_buffered_seq_and_len() -> None:
    log: EventLog[int] = EventLog(epoch="e", max_buffered=3)
    assert log.first_buffered_seq == 1
    for i in range(5):
        log.append(i)
    assert log.first_buffered_seq == 3
    assert len(log) == 3


def test_max_events_limits_a_batch() -> None:
    log: EventLog[int] = EventLog(epoch="e", max_buffered=10)
    for i in range(1, 8):
        log.append(i * 10)
    assert log.since(2, max_events=3) == [(2, 20), (3, 30), (4, 40)]
    assert log.since(6, max_events=10) == [(6, 60), (7, 70)]
    with pytest.raises(ValueError, match="max_events"):
        log.since(1, max_events=0)


@pytest.mark.parametrize("max_buffered", [0, -1])
def test_max_buffered_must_be_positive(max_buffered: int) -> None:
    with pytest.raises(ValueError, match="max_buffered"):
        EventLog(epoch="e", max_buffered=max_buffered)


def test_carries_block_events() -> None:
    log: EventLog[BlockEvent] = EventLog(epoch="boot-1", max_buffered=8)
    events: list[BlockEvent] = [
        BlockStored((BlockKey(1), BlockKey(2)), None),
        BlockRemoved((BlockKey(2),)),
        AllBlocksCleared(),
    ]
    for ev in events:
        log.append(ev)
    assert log.since(1) == list(enumerate(events, start=1))


def test_none_events_are_storable() -> None:
    log: EventLog[None] = EventLog(epoch="e", max_buffered=2)
    log.append(None)
    assert log.since(1) == [(1, None)]


@settings(max_examples=100, deadline=None)
@given(
    max_buffered=st.integers(min_value=1, max_value=8),
    appended=st.integers(min_value=0, max_value=30),
    from_seq=st.integers(min_value=0, max_value=35),
)
def test_since_matches_a_list_model(max_buffered: int, appended: int, from_seq: int) -> None:
    log: EventLog[int] = EventLog(epoch="e", max_buffered=max_buffered)
    everything = [(log.append(i * 7), i * 7) for i in range(appended)]
    got = log.since(from_seq)
    start = max(from_seq, 1)
    oldest = max(1, appended - max_buffered + 1)
    if start > appended + 1 or start < oldest:
        assert got is None
    else:
        assert got == everything[start - 1 :]
        assert all(b[0] == a[0] + 1 for a, b in itertools.pairwise(got))
