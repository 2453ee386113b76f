"""Retention in the block pool: prompt-cache breakpoints kept out of eviction until
their TTL, refreshed on hits, bounded per tenant and per node."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvc.block_keys import BlockKey
from node_agent.blocks.pool import BlockPool
from node_agent.blocks.types import (
    AllocateParams,
    BlockRetained,
    InvalidArgument,
    Retention,
    RetentionOutcome,
    TxMode,
)


@dataclass
class Clock:
    now_s: float = 0.0

    def __call__(self) -> float:
        return self.now_s


def keys(base: int, n: int) -> list[BlockKey]:
    return [BlockKey(base + i) for i in range(n)]


def run(
    pool: BlockPool,
    tx_id: str,
    ks: list[BlockKey],
    *,
    tenant: str = "t",
    retain: tuple[Retention, ...] = (),
) -> RetentionOutcome:
    result = pool.tx_allocate(AllocateParams(tx_id, tenant, ks, 5.0, retain=retain))
    pool.tx_commit(tx_id)
    pool.check_invariants()
    return result.retention


def test_retained_blocks_survive_a_flood_until_their_ttl() -> None:
    clock = Clock()
    pool = BlockPool(8, clock, retention_budget_block_s=None)
    system = keys(100, 4)
    assert run(pool, "a", system, retain=(Retention(2, 60.0),)) is RetentionOutcome.GRANTED
    assert pool.stats().retained_blocks == 2
    for i in range(10):  # unrelated traffic fills the pool many times over
        clock.now_s += 1.0
        run(pool, f"flood{i}", keys(1000 * (i + 1), 6))
    assert pool.match_prefix(system) == 2  # the breakpoint's blocks, not the tail
    clock.now_s = 61.5  # past the TTL (last use at 0): evictable again, oldest first
    run(pool, "after", keys(99_000, 6))
    assert pool.match_prefix(system) == 0
    assert pool.stats().retained_blocks == 0


def test_a_hit_restarts_the_ttl() -> None:
    clock = Clock()
    pool = BlockPool(8, clock)
    system = keys(100, 2)
    run(pool, "a", system, retain=(Retention(2, 10.0),))
    clock.now_s = 8.0
    run(pool, "hit", [*system, BlockKey(7)])  # no retention asked: a hit still refreshes
    clock.now_s = 15.0  # 15 s after the grant, 7 s after the hit
    run(pool, "flood", keys(5000, 6))
    assert pool.match_prefix(system) == 2
    clock.now_s = 18.5
    run(pool, "flood2", keys(6000, 8))
    assert pool.match_prefix(system) == 0


def test_each_key_takes_the_longest_ttl_covering_it() -> None:
    clock = Clock()
    pool = BlockPool(8, clock)
    ks = keys(100, 4)
    run(pool, "a", ks, retain=(Retention(1, 3600.0), Retention(3, 300.0)))
    left = dict(pool.retained_keys())
    assert left == {ks[0]: 3600.0, ks[1]: 300.0, ks[2]: 300.0}


def test_over_budget_serves_without_retention_and_leaves_others_alone() -> None:
    clock = Clock()
    pool = BlockPool(32, clock, retention_budget_block_s=1000.0)
    mine = keys(100, 4)
    assert run(pool, "a", mine, tenant="a", retain=(Retention(4, 200.0),)) is (
        RetentionOutcome.GRANTED
    )  # 800 block-s of 1000
    more = keys(200, 2)
    result = pool.tx_allocate(AllocateParams("a2", "a", more, 5.0, retain=(Retention(2, 200.0),)))
    assert result.retention is RetentionOutcome.OVER_BUDGET
    assert result.retained_blocks == 0
    assert result.new_blocks == 2  # served all the same
    pool.tx_commit("a2")
    assert pool.retention_of("a") == (4, 800.0)
    theirs = keys(300, 4)  # another tenant has its own budget
    assert run(pool, "b", theirs, tenant="b", retain=(Retention(4, 200.0),)) is (
        RetentionOutcome.GRANTED
    )
    clock.now_s = 100.0  # half of a's outstanding retention has run: room again
    assert pool.retention_of("a") == (4, 400.0)
    assert run(pool, "a3", more, tenant="a", retain=(Retention(2, 200.0),)) is (
        RetentionOutcome.GRANTED
    )
    assert {k for k, _ in pool.retained_keys()} >= set(theirs)
    assert pool.retentions_refused[RetentionOutcome.OVER_BUDGET] == 1


def test_refreshing_ones_own_retention_costs_only_the_extension() -> None:
    clock = Clock()
    pool = BlockPool(16, clock, retention_budget_block_s=500.0)
    ks = keys(100, 4)
    assert run(pool, "a", ks, retain=(Retention(4, 100.0),)) is RetentionOutcome.GRANTED
    clock.now_s = 50.0  # outstanding 200; the hit refreshes to 400 (free of charge)
    assert run(pool, "b", ks, retain=(Retention(4, 100.0),)) is RetentionOutcome.GRANTED
    assert pool.retention_of("t") == (4, 400.0)


def test_a_ttl_past_the_nodes_longest_is_refused_not_invalid() -> None:
    pool = BlockPool(8, Clock(), max_retention_s=600.0)
    assert run(pool, "a", keys(100, 2), retain=(Retention(2, 3600.0),)) is (
        RetentionOutcome.TOO_LONG
    )
    assert pool.stats().retained_blocks == 0
    assert pool.match_prefix(keys(100, 2)) == 2  # served and cached all the same


def test_the_node_keeps_room_for_automatic_caching() -> None:
    clock = Clock()
    pool = BlockPool(8, clock)  # at most half the pool retained by default
    assert run(pool, "a", keys(100, 4), retain=(Retention(4, 60.0),)) is (RetentionOutcome.GRANTED)
    assert run(pool, "b", keys(200, 2), retain=(Retention(1, 60.0),)) is (
        RetentionOutcome.NODE_FULL
    )
    run(pool, "c", keys(300, 4))  # the other half still serves new work
    assert pool.stats().retained_blocks == 4


def test_an_aborted_grant_frees_its_fresh_blocks_and_their_retention() -> None:
    clock = Clock()
    pool = BlockPool(8, clock, retention_budget_block_s=100.0)
    result = pool.tx_allocate(
        AllocateParams("a", "t", keys(100, 2), 5.0, retain=(Retention(2, 50.0),))
    )
    assert result.retention is RetentionOutcome.GRANTED
    pool.tx_abort("a")
    pool.check_invariants()
    assert pool.stats().retained_blocks == 0
    assert pool.retention_of("t") == (0, 0.0)


def test_events_announce_grants_and_ends() -> None:
    clock = Clock()
    pool = BlockPool(8, clock)
    ks = keys(100, 3)
    run(pool, "a", ks, retain=(Retention(2, 30.0),))
    events = [e for e in pool.take_events() if isinstance(e, BlockRetained)]
    assert events == [BlockRetained((ks[0], ks[1]), 30.0)]
    clock.now_s = 31.0
    pool.expire_leases()
    assert [e for e in pool.take_events() if isinstance(e, BlockRetained)] == [
        BlockRetained((ks[0], ks[1]), 0.0)
    ]


def test_the_engine_dropping_a_retained_block_ends_its_retention() -> None:
    clock = Clock()
    pool = BlockPool(8, clock)
    ks = keys(100, 2)
    run(pool, "a", ks, retain=(Retention(2, 30.0),))
    assert pool.mirror_removed([ks[0]]) == 1
    pool.check_invariants()
    assert [k for k, _ in pool.retained_keys()] == [ks[1]]


@pytest.mark.parametrize(
    ("retain", "mode"),
    [
        ((Retention(0, 10.0),), TxMode.ALLOCATE),
        ((Retention(3, 10.0),), TxMode.ALLOCATE),  # more blocks than keys
        ((Retention(1, 0.0),), TxMode.ALLOCATE),
        ((Retention(1, float("inf")),), TxMode.ALLOCATE),
        ((Retention(1, 10.0),), TxMode.LOCK_ONLY),
    ],
)
def test_bad_retention_is_invalid_and_changes_nothing(
    retain: tuple[Retention, ...], mode: TxMode
) -> None:
    pool = BlockPool(8, Clock())
    before = pool.stats()
    with pytest.raises(InvalidArgument):
        pool.tx_allocate(AllocateParams("a", "t", keys(1, 2), 5.0, mode=mode, retain=retain))
    assert pool.stats() == before


def test_a_retention_granted_after_a_reset_still_ends() -> None:
    """``clear()`` empties the deadline heap: a block retained again afterwards must get
    an entry of its own, or its retention would never end."""
    clock = Clock()
    pool = BlockPool(8, clock)
    ks = keys(100, 2)
    run(pool, "a", ks, retain=(Retention(2, 3.0),))
    clock.now_s = 1.0
    pool.clear()
    clock.now_s = 2.0
    run(pool, "b", ks, retain=(Retention(2, 5.0),))
    clock.now_s = 100.0
    pool.expire_leases()
    pool.check_invariants()
    assert pool.stats().retained_blocks == 0
    assert pool.stats().evictable_blocks == 2
