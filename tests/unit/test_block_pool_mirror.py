"""BlockPool's engine mirror: an engine-owned cache (vLLM) reported into the ledger.

``mirror_stored``/``mirror_removed``/``mirror_clear`` mark blocks CACHED or free outside
any Tx, within capacity, and never take a block from under a lock (I6).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from conductor.core.prefix_index import ApplyOutcome, NodeId, PrefixIndex
from conductor.core.tier_index import LowerTierIndex, Medium, TierHits, apply_node_event
from kvc.block_keys import BlockKey
from node_agent.blocks.pool import BlockPool
from node_agent.blocks.types import (
    AllocateParams,
    BlockEvent,
    BlockMoved,
    BlockRemoved,
    BlockState,
    BlockStored,
    CapacityExhausted,
    InvalidArgument,
    KvMedium,
)


@dataclass
class FakeClock:
    now_s: float = 100.0

    def __call__(self) -> float:
        return self.now_s


def K(*values: int) -> list[BlockKey]:
    return [BlockKey(v) for v in values]


def allocate(pool: BlockPool, tx_id: str, keys: Sequence[int]) -> None:
    pool.tx_allocate(AllocateParams(tx_id=tx_id, tenant="t", keys=K(*keys), lease_s=10.0))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pool(clock: FakeClock) -> BlockPool:
    return BlockPool(capacity_blocks=4, clock=clock, max_lease_s=60.0)


def test_stored_keys_become_cached_and_evictable(pool: BlockPool) -> None:
    assert pool.mirror_stored(K(1, 2, 3), None) == 3
    assert pool.take_events() == [BlockStored(tuple(K(1, 2, 3)), None)]
    assert pool.match_prefix(K(1, 2, 3)) == 3
    stats = pool.stats()
    assert (stats.cached_blocks, stats.evictable_blocks, stats.free_blocks) == (3, 3, 1)
    assert all(pool.get_payload(h) is None for h in range(4))  # the KV lives in the engine
    pool.check_invariants()


def test_stored_continues_a_chain_and_reports_runs(pool: BlockPool) -> None:
    pool.mirror_stored(K(1), None)
    pool.take_events()
    # 1 is known already: only 2 and 3 are new, chained after 1.
    assert pool.mirror_stored(K(1, 2, 3), None) == 2
    assert pool.take_events() == [BlockStored(tuple(K(2, 3)), BlockKey(1))]
    assert pool.mirror_stored(K(4), BlockKey(3)) == 1
    assert pool.take_events() == [BlockStored(tuple(K(4)), BlockKey(3))]


def test_stored_refreshes_lru_and_evicts_the_oldest(pool: BlockPool, clock: FakeClock) -> None:
    pool.mirror_stored(K(1, 2, 3, 4), None)
    clock.now_s += 1
    pool.mirror_stored(K(1), None)  # 1 becomes the most recently used
    pool.take_events()
    assert pool.mirror_stored(K(5), BlockKey(9)) == 1
    assert pool.take_events() == [BlockRemoved(tuple(K(2))), BlockStored(tuple(K(5)), BlockKey(9))]
    assert set(pool.cached_keys()) == set(K(1, 3, 4, 5))
    pool.check_invariants()


def test_stored_never_evicts_its_own_keys_nor_locked_blocks(pool: BlockPool) -> None:
    allocate(pool, "a", [10, 11])  # two blocks locked by an open Tx
    assert pool.mirror_stored(K(1, 2, 3), None) == 2  # room for two; 3 is skipped
    assert set(pool.cached_keys()) == set(K(1, 2))
    assert pool.stats().locked_blocks == 2
    pool.check_invariants()


def test_stored_leaves_an_allocated_key_to_its_tx(pool: BlockPool) -> None:
    allocate(pool, "a", [1, 2])
    pool.take_events()
    assert pool.mirror_stored(K(1, 2), None) == 0
    h = pool.get_tx("a").handles[0]
    assert pool.block_state(h) is BlockState.ALLOCATED
    pool.tx_commit("a")
    assert pool.take_events() == [BlockStored(tuple(K(1, 2)), None)]
    assert pool.match_prefix(K(1, 2)) == 2


def test_mirrored_blocks_are_reused_by_a_tx(pool: BlockPool) -> None:
    pool.mirror_stored(K(1, 2), None)
    result = pool.tx_allocate(AllocateParams(tx_id="a", tenant="t", keys=K(1, 2, 3), lease_s=5))
    assert (result.reused_blocks, result.new_blocks) == (2, 1)


def test_capacity_counts_mirrored_blocks(pool: BlockPool) -> None:
    pool.mirror_stored(K(1, 2), None)
    allocate(pool, "a", [1, 2])  # locks the two mirrored blocks
    with pytest.raises(CapacityExhausted) as exc:
        allocate(pool, "b", [5, 6, 7])
    assert (exc.value.needed_blocks, exc.value.free_blocks) == (3, 2)


def test_removed_frees_unlocked_blocks_and_ignores_unknown(pool: BlockPool) -> None:
    pool.mirror_stored(K(1, 2, 3), None)
    pool.take_events()
    assert pool.mirror_removed(K(2, 99)) == 1
    assert pool.take_events() == [BlockRemoved(tuple(K(2)))]
    assert set(pool.cached_keys()) == set(K(1, 3))
    assert pool.stats().free_blocks == 2
    pool.check_invariants()


def test_removed_while_locked_waits_for_the_last_unlock(pool: BlockPool) -> None:
    pool.mirror_stored(K(1, 2), None)
    allocate(pool, "a", [1, 2])
    allocate(pool, "b", [1])
    pool.take_events()
    assert pool.mirror_removed(K(1)) == 0  # locked: never taken from under a lock
    assert pool.take_events() == []
    pool.check_invariants()
    pool.tx_commit("a")
    assert pool.take_events() == []  # "b" still holds it
    assert pool.match_prefix(K(1)) == 1
    pool.tx_abort("b")
    assert pool.take_events() == [BlockRemoved(tuple(K(1)))]
    assert pool.cached_keys() == K(2)
    pool.check_invariants()


def test_removed_allocated_block_is_dropped_after_commit(pool: BlockPool) -> None:
    allocate(pool, "a", [1, 2])
    pool.take_events()
    pool.mirror_removed(K(2))
    pool.tx_commit("a")
    assert pool.take_events() == [
        BlockStored(tuple(K(1, 2)), None),
        BlockRemoved(tuple(K(2))),
    ]
    assert pool.cached_keys() == K(1)
    pool.check_invariants()


def test_removed_allocated_block_then_abort_frees_it_once(pool: BlockPool) -> None:
    allocate(pool, "a", [1])
    pool.mirror_removed(K(1))
    pool.tx_abort("a")
    assert pool.stats().free_blocks == 4
    pool.check_invariants()


def test_a_new_store_cancels_a_pending_removal(pool: BlockPool) -> None:
    pool.mirror_stored(K(1), None)
    allocate(pool, "a", [1])
    pool.mirror_removed(K(1))
    pool.mirror_stored(K(1), None)  # the engine recomputed and cached it again
    pool.tx_commit("a")
    assert pool.match_prefix(K(1)) == 1
    pool.check_invariants()


def test_clear_drops_unlocked_and_marks_locked(pool: BlockPool) -> None:
    pool.mirror_stored(K(1, 2, 3), None)
    allocate(pool, "a", [1])
    pool.take_events()
    assert pool.mirror_clear() == 2
    (removed,) = pool.take_events()
    assert isinstance(removed, BlockRemoved)
    assert set(removed.keys) == set(K(2, 3))
    assert pool.stats().open_txs == 1  # the Tx goes on; only its block is marked
    pool.tx_commit("a")
    assert pool.take_events() == [BlockRemoved(tuple(K(1)))]
    assert pool.cached_keys() == []
    pool.check_invariants()


def test_bad_keys_are_rejected_and_change_nothing(pool: BlockPool) -> None:
    with pytest.raises(InvalidArgument):
        pool.mirror_stored([BlockKey(1), BlockKey(2**64)], None)
    assert pool.cached_keys() == []
    assert pool.take_events() == []


def test_engine_host_copies_turn_device_evictions_into_moves(pool: BlockPool) -> None:
    """vLLM's CPU offloading: a key with a host copy survives a device eviction (moved
    to HOST), is gone only when both copies are; the conductor's shadow follows."""
    index, lower = PrefixIndex(), LowerTierIndex()
    node = NodeId("vllm-0")
    index.reset_node(node, "e", 0, ())
    lower.reset_node(node, "e", 0, (), ())
    seq = 0

    def publish(events: list[BlockEvent] | None = None) -> None:
        nonlocal seq
        for ev in pool.take_events() if events is None else events:
            seq += 1
            if isinstance(ev, BlockStored):
                outcome = apply_node_event(index, lower, node, "e", seq, stored=ev.keys)
            elif isinstance(ev, BlockRemoved):
                outcome = apply_node_event(index, lower, node, "e", seq, removed=ev.keys)
            else:
                assert isinstance(ev, BlockMoved)
                moved = (Medium(ev.medium), ev.keys)
                outcome = apply_node_event(index, lower, node, "e", seq, moved=moved)
            assert outcome is ApplyOutcome.APPLIED

    pool.mirror_stored(K(1, 2), None)
    assert pool.mirror_host_stored(K(1, 2)) == 2
    publish()
    assert pool.tier_keys(KvMedium.HOST) == []  # both copies: the device one counts
    assert lower.hits(K(1, 2), index.match(K(1, 2))) == {}
    pool.mirror_removed(K(2))
    events = pool.take_events()
    assert events == [BlockMoved((BlockKey(2),), KvMedium.HOST)]
    publish(events)
    assert pool.tier_keys(KvMedium.HOST) == K(2)
    assert index.match(K(1, 2)) == {node: 2}  # still held, one of them in host memory
    assert lower.hits(K(1, 2), {node: 2}) == {node: TierHits(1, 0)}
    pool.mirror_stored(K(2), BlockKey(1))  # vLLM loaded it back onto the device
    publish()
    assert lower.hits(K(1, 2), {node: 2}) == {}
    pool.mirror_removed(K(2))
    pool.mirror_host_removed(K(2))
    publish()
    assert index.match(K(1, 2)) == {node: 1}
    assert pool.mirror_host_removed(K(1)) == 1  # its device copy stays: no event
    assert pool.take_events() == []
    pool.mirror_host_stored(K(7))  # a host copy of a key the pool never held
    pool.mirror_clear()
    publish()
    assert index.match(K(1)) == {}
    assert index.match(K(7)) == {}
    pool.check_invariants()
