"""coalesce_events: neighbouring block events joined, with the same effect when applied."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from kvc.block_keys import BlockKey
from node_agent.blocks.pool import coalesce_events
from node_agent.blocks.types import (
    AllBlocksCleared,
    BlockEvent,
    BlockMoved,
    BlockRemoved,
    BlockStored,
    KvMedium,
)

_KEYS = st.lists(st.integers(min_value=1, max_value=12).map(BlockKey), min_size=1, max_size=4)


@st.composite
def _events(draw: st.DrawFn) -> list[BlockEvent]:
    out: list[BlockEvent] = []
    for _ in range(draw(st.integers(min_value=0, max_value=12))):
        kind = draw(st.sampled_from(["stored", "chained", "removed", "moved", "cleared"]))
        keys = tuple(draw(_KEYS))
        if kind == "stored":
            out.append(BlockStored(keys, draw(st.none() | st.just(BlockKey(99)))))
        elif kind == "chained":  # continues the previous stored run, when there is one
            last = out[-1] if out else None
            parent = last.keys[-1] if isinstance(last, BlockStored) else None
            out.append(BlockStored(keys, parent))
        elif kind == "removed":
            out.append(BlockRemoved(keys))
        elif kind == "moved":
            out.append(BlockMoved(keys, draw(st.sampled_from(list(KvMedium)))))
        else:
            out.append(AllBlocksCleared())
    return out


def _apply(events: list[BlockEvent]) -> tuple[dict[int, KvMedium], list[tuple[int, int | None]]]:
    """What a shadow of the node ends up with: each key's medium, and each stored key's
    parent in its chain (what an index that follows parents would record)."""
    where: dict[int, KvMedium] = {}
    parents: list[tuple[int, int | None]] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            parent = ev.parent_key
            for key in ev.keys:
                where[key] = KvMedium.DEVICE
                parents.append((key, parent))
                parent = key
        elif isinstance(ev, BlockRemoved):
            for key in ev.keys:
                where.pop(key, None)
        elif isinstance(ev, BlockMoved):
            for key in ev.keys:
                if key in where:
                    where[key] = ev.medium
        else:
            where.clear()
    return where, parents


@given(_events())
@settings(max_examples=300)
def test_coalesced_events_have_the_same_effect(events: list[BlockEvent]) -> None:
    joined = coalesce_events(events)
    assert _apply(joined) == _apply(events)
    assert len(joined) <= len(events)
    for before, after in itertools.pairwise(joined):
        assert not (isinstance(before, BlockRemoved) and isinstance(after, BlockRemoved))


def test_an_eviction_block_by_block_is_one_event() -> None:
    evicted: list[BlockEvent] = [BlockRemoved((BlockKey(k),)) for k in range(1, 65)]
    stored = BlockStored((BlockKey(100), BlockKey(101)), None)
    more = BlockStored((BlockKey(102),), BlockKey(101))
    elsewhere = BlockStored((BlockKey(200),), BlockKey(7))
    assert coalesce_events([*evicted, stored, more, elsewhere]) == [
        BlockRemoved(tuple(BlockKey(k) for k in range(1, 65))),
        BlockStored((BlockKey(100), BlockKey(101), BlockKey(102)), None),
        elsewhere,
    ]
