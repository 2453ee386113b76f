"""BlockPool: allocation, reuse, sharing, eviction, leases, every error path, idempotency."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import pytest

from kvc.block_keys import BlockKey
from node_agent.blocks.pool import BlockPool
from node_agent.blocks.types import (
    AbortResult,
    AllBlocksCleared,
    AllocateParams,
    AllocateResult,
    BlockPoolError,
    BlockRemoved,
    BlockState,
    BlockStored,
    CapacityExhausted,
    CommitResult,
    InvalidArgument,
    PoolStats,
    TenantMismatch,
    TenantQuotaExceeded,
    TxClosed,
    TxExpired,
    TxMode,
    TxNotFound,
)


@dataclass
class FakeClock:
    now_s: float = 100.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, dt_s: float) -> None:
        self.now_s += dt_s


def K(*values: int) -> list[BlockKey]:
    return [BlockKey(v) for v in values]


def params(
    tx_id: str,
    keys: Sequence[int],
    *,
    lease_s: float = 10.0,
    mode: TxMode = TxMode.ALLOCATE,
    tenant: str = "t",
) -> AllocateParams:
    return AllocateParams(tx_id=tx_id, tenant=tenant, keys=K(*keys), lease_s=lease_s, mode=mode)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pool(clock: FakeClock) -> BlockPool:
    return BlockPool(capacity_blocks=8, clock=clock, max_lease_s=60.0)


def full_state(pool: BlockPool) -> tuple[object, ...]:
    """Everything observable about a pool, for 'left exactly unchanged' checks."""
    blocks = tuple(
        (pool.block_state(h), pool.block_key(h), pool.get_payload(h))
        for h in range(pool.capacity_blocks)
    )
    return (pool.stats(), blocks, tuple(pool.cached_keys()))


def commit_fresh(pool: BlockPool, tx_id: str, keys: Sequence[int]) -> AllocateResult:
    result = pool.tx_allocate(params(tx_id, keys))
    pool.tx_commit(tx_id)
    return result


# ----------------------------------------------------------------- construction


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity_blocks": 0},
        {"capacity_blocks": -1},
        {"capacity_blocks": 4, "max_lease_s": 0.0},
        {"capacity_blocks": 4, "max_lease_s": math.inf},
        {"capacity_blocks": 4, "max_lease_s": math.nan},
        {"capacity_blocks": 4, "max_finished_txs": 0},
        {"capacity_blocks": 4, "max_tx_id_len": 0},
    ],
)
def test_constructor_validation(kwargs: dict[str, float], clock: FakeClock) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - any message
        BlockPool(clock=clock, **kwargs)  # type: ignore[arg-type]


# ----------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (params("", [1]), "tx_id"),
        (params("x" * 257, [1]), "tx_id"),
        (params("tx", [1], lease_s=0.0), "lease_s"),
        (params("tx", [1], lease_s=-1.0), "lease_s"),
        (params("tx", [1], lease_s=60.5), "lease_s"),
        (params("tx", [1], lease_s=math.nan), "lease_s"),
        (params("tx", [1], lease_s=math.inf), "lease_s"),
        (params("tx", []), "empty"),
        (params("tx", [1, -1]), "uint64"),
        (params("tx", [2**64]), "uint64"),
        (params("tx", [1, 2, 1]), "repeat"),
        (
            AllocateParams(tx_id="tx", tenant="t", keys=[True], lease_s=1.0),  # type: ignore[list-item]
            "uint64",
        ),
        (
            AllocateParams(tx_id="tx", tenant="t", keys=K(1), lease_s=1.0, mode="x"),  # type: ignore[arg-type]
            "mode",
        ),
        (AllocateParams(tx_id="tx", tenant=None, keys=K(1), lease_s=1.0), "tenant"),  # type: ignore[arg-type]
        (AllocateParams(tx_id="tx", tenant="t", keys=K(1), lease_s=1.0, key_layout=3), "layout"),
        (AllocateParams(tx_id="tx", tenant="t", keys=K(1), lease_s=1.0, key_layout=0), "layout"),
        (
            AllocateParams(tx_id="tx", tenant="t", keys=K(1), lease_s=1.0, key_layout=True),
            "layout",
        ),
    ],
)
def test_allocate_validation_leaves_pool_unchanged(
    pool: BlockPool, bad: AllocateParams, match: str
) -> None:
    commit_fresh(pool, "warm", [7, 8])
    pool.take_events()
    before = full_state(pool)
    with pytest.raises(InvalidArgument, match=match):
        pool.tx_allocate(bad)
    assert full_state(pool) == before
    assert pool.take_events() == []
    pool.check_invariants()


def test_max_key_is_accepted(pool: BlockPool) -> None:
    result = pool.tx_allocate(params("tx", [0, 2**64 - 1]))
    assert result.new_blocks == 2


@pytest.mark.parametrize("handle", [-1, 8, 100])
def test_payload_bad_handle(pool: BlockPool, handle: int) -> None:
    with pytest.raises(InvalidArgument, match="handle"):
        pool.get_payload(handle)
    with pytest.raises(InvalidArgument, match="handle"):
        pool.set_payload(handle, b"kv")


def test_payload_on_free_block_is_invalid(pool: BlockPool) -> None:
    with pytest.raises(InvalidArgument, match="free"):
        pool.set_payload(0, b"kv")
    assert pool.get_payload(0) is None


@pytest.mark.parametrize("lease_s", [0.0, -1.0, 61.0, math.nan])
def test_extend_validation(pool: BlockPool, lease_s: float) -> None:
    pool.tx_allocate(params("tx", [1]))
    with pytest.raises(InvalidArgument, match="lease_s"):
        pool.tx_extend("tx", lease_s)


# ----------------------------------------------------------------- allocate / commit


def test_fresh_allocate_then_commit(pool: BlockPool, clock: FakeClock) -> None:
    result = pool.tx_allocate(params("tx", [10, 11, 12], lease_s=5.0))
    assert result == AllocateResult(
        tx_id="tx",
        handles=(0, 1, 2),
        reused_blocks=0,
        new_blocks=3,
        lease_deadline=clock.now_s + 5.0,
        shared_blocks=0,
    )
    assert pool.stats() == PoolStats(
        capacity_blocks=8,
        free_blocks=5,
        cached_blocks=0,
        allocated_blocks=3,
        locked_blocks=3,
        open_txs=1,
        evictable_blocks=0,
    )
    assert pool.match_prefix(K(10, 11)) == 0  # allocated is not cached yet
    assert [pool.block_state(h) for h in result.handles] == [BlockState.ALLOCATED] * 3
    assert pool.take_events() == []

    commit = pool.tx_commit("tx")
    assert commit == CommitResult("tx", tuple(K(10, 11, 12)), 3)
    assert pool.take_events() == [BlockStored(tuple(K(10, 11, 12)), None)]
    assert pool.match_prefix(K(10, 11, 12, 13)) == 3
    assert pool.match_prefix(K(9, 10)) == 0
    assert sorted(pool.cached_keys()) == K(10, 11, 12)
    stats = pool.stats()
    assert (stats.cached_blocks, stats.locked_blocks, stats.open_txs) == (3, 0, 0)
    assert stats.evictable_blocks == 3
    pool.check_invariants()


def test_reuse_cached_prefix(pool: BlockPool) -> None:
    first = commit_fresh(pool, "a", [1, 2, 3])
    pool.take_events()
    second = pool.tx_allocate(params("b", [1, 2, 3, 4, 5]))
    assert second.handles[:3] == first.handles
    assert (second.reused_blocks, second.new_blocks, second.shared_blocks) == (3, 2, 0)
    assert pool.stats().locked_blocks == 5
    assert pool.tx_commit("b").stored_keys == tuple(K(4, 5))
    assert pool.take_events() == [BlockStored(tuple(K(4, 5)), BlockKey(3))]
    pool.check_invariants()


def test_reused_blocks_counts_only_the_contiguous_prefix(pool: BlockPool) -> None:
    commit_fresh(pool, "a", [1, 2])
    commit_fresh(pool, "b", [5, 6])
    result = pool.tx_allocate(params("c", [1, 9, 5, 7]))
    assert (result.reused_blocks, result.new_blocks, result.shared_blocks) == (1, 2, 0)
    assert pool.block_key(result.handles[2]) == 5  # the later cached block is reused too
    pool.take_events()
    assert pool.tx_commit("c").stored_keys == tuple(K(9, 7))
    assert pool.take_events() == [
        BlockStored(tuple(K(9)), BlockKey(1)),
        BlockStored(tuple(K(7)), BlockKey(5)),
    ]
    pool.check_invariants()


def test_lock_only_locks_the_cached_prefix(pool: BlockPool) -> None:
    first = commit_fresh(pool, "a", [1, 2, 3])
    result = pool.tx_allocate(params("src", [1, 2, 9, 3], mode=TxMode.LOCK_ONLY))
    assert result.handles == first.handles[:2]
    assert (result.reused_blocks, result.new_blocks) == (2, 0)
    stats = pool.stats()
    assert (stats.locked_blocks, stats.allocated_blocks, stats.free_blocks) == (2, 0, 5)
    pool.take_events()
    assert pool.tx_commit("src") == CommitResult("src", (), 2)
    assert pool.take_events() == []
    assert pool.stats().locked_blocks == 0


def test_lock_only_with_nothing_cached_opens_an_empty_tx(pool: BlockPool) -> None:
    result = pool.tx_allocate(params("src", [1, 2], mode=TxMode.LOCK_ONLY))
    assert result.handles == ()
    assert pool.stats().open_txs == 1
    assert pool.tx_abort("src") == AbortResult("src", 0, 0, expired=False)


def test_lock_only_keys_longer_than_capacity(pool: BlockPool) -> None:
    commit_fresh(pool, "a", [1, 2])
    result = pool.tx_allocate(params("src", range(1, 9), mode=TxMode.LOCK_ONLY))
    assert result.reused_blocks == 2


@pytest.mark.parametrize("mode", list(TxMode))
def test_more_keys_than_the_pool_holds_are_refused_before_any_work(
    pool: BlockPool, mode: TxMode
) -> None:
    with pytest.raises(CapacityExhausted, match="need 200000 new blocks"):
        pool.tx_allocate(params("big", range(1, 200_001), mode=mode))
    assert pool.stats().open_txs == 0


# ----------------------------------------------------------------- in-flight sharing


def test_in_flight_key_is_shared_not_duplicated(pool: BlockPool) -> None:
    a = pool.tx_allocate(params("a", [1, 2, 3]))
    b = pool.tx_allocate(params("b", [1, 2, 4]))
    assert b.handles[:2] == a.handles[:2]
    assert (b.reused_blocks, b.shared_blocks, b.new_blocks) == (0, 2, 1)
    assert pool.stats().allocated_blocks == 4  # 1, 2, 3, 4: one block per key
    pool.check_invariants()

    assert pool.tx_abort("a") == AbortResult("a", freed_blocks=1, released_blocks=3, expired=False)
    assert [pool.block_key(h) for h in b.handles] == K(1, 2, 4)  # b keeps 1 and 2
    assert pool.tx_commit("b").stored_keys == tuple(K(1, 2, 4))
    assert pool.match_prefix(K(1, 2, 4)) == 3
    pool.check_invariants()


def test_shared_block_first_committer_wins(pool: BlockPool) -> None:
    a = pool.tx_allocate(params("a", [1, 2, 3]))
    b = pool.tx_allocate(params("b", [1, 2, 4]))
    assert pool.set_payload(a.handles[0], "kv-1-by-a")
    assert pool.set_payload(b.handles[0], "kv-1-by-b")  # still in flight: both may write
    pool.take_events()
    assert pool.tx_commit("a").stored_keys == tuple(K(1, 2, 3))
    # Committed content is immutable: b's late write is refused, not applied.
    assert not pool.set_payload(b.handles[0], "late")
    assert pool.get_payload(b.handles[0]) == "kv-1-by-b"
    assert pool.stats().locked_blocks == 3  # b still locks 1, 2 and its own 4
    assert pool.tx_commit("b").stored_keys == tuple(K(4))
    assert pool.take_events() == [
        BlockStored(tuple(K(1, 2, 3)), None),
        BlockStored(tuple(K(4)), BlockKey(2)),
    ]
    pool.check_invariants()


def test_abort_of_sharer_after_owner_commit_keeps_cached_blocks(pool: BlockPool) -> None:
    pool.tx_allocate(params("a", [1, 2]))
    pool.tx_allocate(params("b", [1, 2, 3]))
    pool.tx_commit("a")
    assert pool.tx_abort("b").freed_blocks == 1  # only 3; 1 and 2 are cached now
    assert pool.match_prefix(K(1, 2, 3)) == 2
    pool.check_invariants()


# ----------------------------------------------------------------- capacity and eviction


def test_capacity_exhausted_leaves_pool_exactly_unchanged(pool: BlockPool) -> None:
    commit_fresh(pool, "a", [1, 2, 3])  # 3 cached, evictable
    pool.tx_allocate(params("b", [20, 21, 22, 23]))  # 4 locked
    pool.take_events()
    before = full_state(pool)
    # Reuses 1, 2, 3 (so they are not evictable for it) and needs 2 new: only 1 free.
    with pytest.raises(CapacityExhausted) as info:
        pool.tx_allocate(params("c", [1, 2, 3, 30, 31]))
    assert (info.value.needed_blocks, info.value.free_blocks) == (2, 1)
    assert full_state(pool) == before
    assert pool.take_events() == []
    # Nothing was remembered: the same tx_id may try again once space frees.
    pool.tx_abort("b")
    assert pool.tx_allocate(params("c", [1, 2, 3, 30, 31])).new_blocks == 2
    pool.check_invariants()


def test_request_larger_than_pool(pool: BlockPool) -> None:
    with pytest.raises(CapacityExhausted) as info:
        pool.tx_allocate(params("big", range(1, 10)))
    assert (info.value.needed_blocks, info.value.free_blocks) == (9, 8)
    assert isinstance(info.value, BlockPoolError)


def test_eviction_is_lru_and_tail_first(pool: BlockPool, clock: FakeClock) -> None:
    old = commit_fresh(pool, "old", [1, 2, 3])
    clock.advance(1)
    commit_fresh(pool, "new", [4, 5, 6])
    clock.advance(1)
    pool.take_events()
    result = pool.tx_allocate(params("c", [7, 8, 9, 10]))  # 2 free + 2 evicted
    assert pool.take_events() == [BlockRemoved(tuple(K(3, 2)))]
    assert set(result.handles) == {6, 7, old.handles[2], old.handles[1]}
    assert pool.match_prefix(K(1)) == 1  # the head of the old prompt survives
    assert pool.match_prefix(K(1, 2)) == 1
    assert pool.match_prefix(K(4, 5, 6)) == 3
    pool.check_invariants()


def test_reuse_refreshes_lru_position(pool: BlockPool, clock: FakeClock) -> None:
    commit_fresh(pool, "a", [1])
    commit_fresh(pool, "b", [2])
    clock.advance(1)
    commit_fresh(pool, "a2", [1])  # touch 1: now 2 is the oldest
    pool.tx_allocate(params("fill", range(10, 17)))  # 6 free + 1 eviction
    assert pool.match_prefix(K(1)) == 1
    assert pool.match_prefix(K(2)) == 0


def test_locked_blocks_are_never_evicted(pool: BlockPool) -> None:
    commit_fresh(pool, "a", [1, 2, 3, 4])
    pool.tx_allocate(params("src", [1, 2, 3, 4], mode=TxMode.LOCK_ONLY))
    before = full_state(pool)
    with pytest.raises(CapacityExhausted) as info:
        pool.tx_allocate(params("c", range(10, 15)))
    assert (info.value.needed_blocks, info.value.free_blocks) == (5, 4)
    assert full_state(pool) == before
    assert pool.tx_allocate(params("d", range(10, 14))).new_blocks == 4
    assert pool.match_prefix(K(1, 2, 3, 4)) == 4


def test_eviction_and_abort_drop_payloads(pool: BlockPool) -> None:
    a = pool.tx_allocate(params("a", [1, 2]))
    pool.set_payload(a.handles[0], "kv1")
    pool.set_payload(a.handles[1], "kv2")
    pool.tx_commit("a")
    assert pool.get_payload(a.handles[0]) == "kv1"
    b = pool.tx_allocate(params("b", [5]))
    pool.set_payload(b.handles[0], "kv5")
    pool.tx_abort("b")
    assert pool.get_payload(b.handles[0]) is None
    pool.tx_allocate(params("fill", range(10, 18)))  # evicts both cached blocks
    assert pool.get_payload(a.handles[0]) is None
    assert pool.get_payload(a.handles[1]) is None


# ----------------------------------------------------------------- idempotency


def test_allocate_retry_returns_the_same_result(pool: BlockPool) -> None:
    first = pool.tx_allocate(params("tx", [1, 2, 3], lease_s=5.0))
    stats = pool.stats()
    again = pool.tx_allocate(params("tx", [1, 2, 3], lease_s=30.0))  # lease is not identity
    assert again == first
    assert pool.stats() == stats
    pool.check_invariants()


@pytest.mark.parametrize(
    "changed",
    [
        params("tx", [1, 2]),
        params("tx", [1, 2, 4]),
        params("tx", [1, 2, 3], tenant="other"),
        params("tx", [1, 2, 3], mode=TxMode.LOCK_ONLY),
        replace(params("tx", [1, 2, 3]), key_layout=1),
    ],
)
def test_allocate_retry_with_other_params_is_invalid(
    pool: BlockPool, changed: AllocateParams
) -> None:
    pool.tx_allocate(params("tx", [1, 2, 3]))
    before = full_state(pool)
    with pytest.raises(InvalidArgument, match="different parameters"):
        pool.tx_allocate(changed)
    assert full_state(pool) == before


def test_commit_and_abort_retries(pool: BlockPool) -> None:
    pool.tx_allocate(params("c", [1]))
    commit = pool.tx_commit("c")
    assert pool.tx_commit("c") == commit
    pool.tx_allocate(params("a", [2]))
    abort = pool.tx_abort("a")
    assert pool.tx_abort("a") == abort
    pool.check_invariants()


Call = Callable[[BlockPool], object]
_CALLS: dict[str, Call] = {
    "allocate": lambda p: p.tx_allocate(params("tx", [1])),
    "commit": lambda p: p.tx_commit("tx"),
    "abort": lambda p: p.tx_abort("tx"),
    "extend": lambda p: p.tx_extend("tx", 1.0),
    "get_tx": lambda p: p.get_tx("tx"),
}


def _finish(pool: BlockPool, clock: FakeClock, how: str) -> None:
    if how == "unknown":
        return
    pool.tx_allocate(params("tx", [1], lease_s=5.0))
    if how == "committed":
        pool.tx_commit("tx")
    elif how == "aborted":
        pool.tx_abort("tx")
    elif how == "expired":
        clock.advance(5.0)  # deadline reached exactly: expired
        assert pool.expire_leases() == ["tx"]


# (how the tx ended, call) -> expected exception type, or None for an idempotent success
_FINISHED_TABLE: list[tuple[str, str, type[BlockPoolError] | None]] = [
    ("unknown", "commit", TxNotFound),
    ("unknown", "abort", TxNotFound),
    ("unknown", "extend", TxNotFound),
    ("unknown", "get_tx", TxNotFound),
    ("committed", "allocate", TxClosed),
    ("committed", "commit", None),
    ("committed", "abort", TxClosed),
    ("committed", "extend", TxClosed),
    ("committed", "get_tx", TxClosed),
    ("aborted", "allocate", TxClosed),
    ("aborted", "commit", TxClosed),
    ("aborted", "abort", None),
    ("aborted", "extend", TxClosed),
    ("aborted", "get_tx", TxClosed),
    ("expired", "allocate", TxExpired),
    ("expired", "commit", TxExpired),
    ("expired", "abort", None),
    ("expired", "extend", TxExpired),
    ("expired", "get_tx", TxExpired),
]


@pytest.mark.parametrize(("how", "call", "error"), _FINISHED_TABLE)
def test_calls_on_finished_txs(
    pool: BlockPool,
    clock: FakeClock,
    how: str,
    call: str,
    error: type[BlockPoolError] | None,
) -> None:
    _finish(pool, clock, how)
    before = full_state(pool)
    if error is None:
        first = _CALLS[call](pool)
        assert _CALLS[call](pool) == first
    else:
        with pytest.raises(error) as info:
            _CALLS[call](pool)
        assert type(info.value) is error  # TxExpired only for expiry, not for abort
    assert full_state(pool) == before
    pool.check_invariants()


def test_closed_carries_outcome(pool: BlockPool) -> None:
    pool.tx_allocate(params("tx", [1]))
    pool.tx_abort("tx")
    with pytest.raises(TxClosed, match="aborted") as info:
        pool.tx_commit("tx")
    assert info.value.outcome == "aborted"


def test_expired_abort_result_says_expired(pool: BlockPool, clock: FakeClock) -> None:
    pool.tx_allocate(params("tx", [1, 2], lease_s=1.0))
    clock.advance(2.0)
    assert pool.tx_abort("tx") == AbortResult("tx", 2, 2, expired=True)


def test_finished_memory_is_bounded_by_count(clock: FakeClock) -> None:
    pool = BlockPool(capacity_blocks=4, clock=clock, max_finished_txs=2)
    for i in range(3):
        pool.tx_allocate(params(f"tx{i}", [i]))
        pool.tx_commit(f"tx{i}")
    with pytest.raises(TxNotFound):
        pool.tx_commit("tx0")
    assert pool.tx_commit("tx2").stored_keys == tuple(K(2))
    pool.check_invariants()


def test_finished_memory_is_bounded_by_keys(clock: FakeClock) -> None:
    pool = BlockPool(capacity_blocks=8, clock=clock, max_finished_keys=5)
    pool.tx_allocate(params("a", [1, 2, 3]))
    pool.tx_commit("a")
    pool.tx_allocate(params("b", [4, 5, 6]))
    pool.tx_commit("b")  # 6 retained keys > 5: "a" is forgotten
    with pytest.raises(TxNotFound):
        pool.tx_commit("a")
    assert pool.tx_commit("b").stored_keys == tuple(K(4, 5, 6))
    pool.check_invariants()


# ----------------------------------------------------------------- leases


def test_lease_expiry_aborts_by_itself(pool: BlockPool, clock: FakeClock) -> None:
    commit_fresh(pool, "warm", [1])
    pool.tx_allocate(params("tx", [1, 2, 3], lease_s=2.0))
    clock.advance(1.999)
    assert pool.expire_leases() == []
    clock.advance(0.001)
    stats = pool.stats()  # lazily expires
    assert (stats.open_txs, stats.locked_blocks, stats.allocated_blocks) == (0, 0, 0)
    assert stats.cached_blocks == 1  # the reused cached block stays cached
    assert pool.expire_leases() == []
    with pytest.raises(TxExpired):
        pool.tx_commit("tx")
    pool.check_invariants()


def test_expiry_is_lazy_at_every_operation(pool: BlockPool, clock: FakeClock) -> None:
    pool.tx_allocate(params("old", range(8), lease_s=1.0))
    clock.advance(1.0)
    # A full pool frees itself on the next allocate: no explicit expire_leases needed.
    assert pool.tx_allocate(params("new", range(8))).new_blocks == 8


def test_extend_moves_the_deadline(pool: BlockPool, clock: FakeClock) -> None:
    pool.tx_allocate(params("tx", [1], lease_s=2.0))
    clock.advance(1.0)
    assert pool.tx_extend("tx", 5.0) == clock.now_s + 5.0
    clock.advance(4.0)  # past the first deadline
    assert pool.expire_leases() == []
    assert pool.get_tx("tx").lease_deadline == clock.now_s + 1.0
    assert pool.tx_allocate(params("tx", [1])).lease_deadline == clock.now_s + 1.0
    clock.advance(1.0)
    assert pool.expire_leases() == ["tx"]
    pool.check_invariants()


def test_expiry_order_and_many_extends(pool: BlockPool, clock: FakeClock) -> None:
    pool.tx_allocate(params("late", [1], lease_s=3.0))
    pool.tx_allocate(params("early", [2], lease_s=1.0))
    for _ in range(3000):  # stale heap entries are compacted
        pool.tx_extend("late", 3.0)
    clock.advance(3.0)
    assert pool.expire_leases() == ["early", "late"]
    pool.check_invariants()


# ----------------------------------------------------------------- clear and events


def test_clear_aborts_everything(pool: BlockPool) -> None:
    commit_fresh(pool, "a", [1, 2])
    pool.tx_allocate(params("open", [1, 2, 3]))
    pool.take_events()
    assert pool.clear() == ["open"]
    assert pool.take_events() == [AllBlocksCleared()]
    stats = pool.stats()
    assert (stats.free_blocks, stats.open_txs, stats.locked_blocks) == (8, 0, 0)
    assert pool.cached_keys() == []
    with pytest.raises(TxClosed):
        pool.tx_commit("open")
    pool.check_invariants()


def test_take_events_drains(pool: BlockPool) -> None:
    commit_fresh(pool, "a", [1])
    assert pool.take_events() == [BlockStored(tuple(K(1)), None)]
    assert pool.take_events() == []


def test_check_invariants_detects_corruption(pool: BlockPool) -> None:
    pool.tx_allocate(params("tx", [1, 2]))
    pool.check_invariants()
    pool._blocks[0].lock_count = 0  # simulate a lost lock
    with pytest.raises(AssertionError, match="I3"):
        pool.check_invariants()


# ----------------------------------------------------------------- tenants


def test_a_tenant_cannot_touch_another_tenants_blocks(pool: BlockPool) -> None:
    commit_fresh(pool, "a", [1, 2, 3])  # tenant "t"
    open_b = pool.tx_allocate(params("t-open", [5, 6]))
    before = full_state(pool)
    for mode in TxMode:
        for keys in ([1, 2, 3], [9, 2], [5]):  # cached, cached mid-list, in flight
            with pytest.raises(TenantMismatch):
                pool.tx_allocate(params(f"x-{mode}-{keys}", keys, mode=mode, tenant="evil"))
    assert full_state(pool) == before
    assert pool.locked_by_tenant("evil") == 0
    assert pool.tx_allocate(params("own", [1, 2, 3, 4])).reused_blocks == 3
    assert open_b.handles
    pool.check_invariants()


def test_tenant_lock_limit_counts_a_shared_prefix_once(clock: FakeClock) -> None:
    pool = BlockPool(capacity_blocks=8, clock=clock, max_lease_s=60.0, max_tenant_locked_blocks=4)
    alone = pool.tx_allocate(params("alone", [40, 41, 42, 43, 44, 45], tenant="solo"))
    assert alone.new_blocks == 6  # alone on the node: the whole pool, past the limit
    pool.tx_abort("alone")
    pool.tx_allocate(params("other-holds", [30], tenant="u"))  # now the pool is shared
    commit_fresh(pool, "warm", [1, 2])
    for i in range(5):  # five requests on one cached prefix: 2 blocks locked, not 10
        pool.tx_allocate(params(f"r{i}", [1, 2]))
    assert pool.locked_by_tenant("t") == 2
    pool.tx_allocate(params("more", [1, 2, 3, 4]))
    assert pool.locked_by_tenant("t") == 4
    before = full_state(pool)
    with pytest.raises(TenantQuotaExceeded):
        pool.tx_allocate(params("over", [7]))
    assert full_state(pool) == before
    other = pool.tx_allocate(params("other", [20, 21, 22], tenant="u"))  # its own room
    assert other.new_blocks == 3
    pool.tx_abort("more")
    assert pool.locked_by_tenant("t") == 2
    pool.tx_allocate(params("over", [7]))
    pool.check_invariants()
