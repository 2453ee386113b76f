"""BlockPool under random interleavings of allocate/commit/abort/retry/expiry (hypothesis).

Engine-mirror calls (``mirror_stored``/``mirror_removed``/``mirror_clear``, as a vLLM
agent makes from the engine's KV events) are interleaved too.

Some ALLOCATE txs ask for a retention (a prompt-cache breakpoint) under a small budget:
a granted retention's keys stay cached until their TTL whatever else happens, unless
the engine itself drops them.

Prompts are short paths over a 3-token alphabet hashed with the real chained block keys
(block_size 1), for two tenants, so prefixes overlap heavily and a pool of 8 blocks is
constantly reusing, sharing in-flight blocks, evicting and running out of capacity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvc.block_keys import BlockKey, compute_block_keys
from node_agent.blocks.pool import BlockPool
from node_agent.blocks.types import (
    AbortResult,
    AllBlocksCleared,
    AllocateParams,
    AllocateResult,
    BlockEvent,
    BlockRemoved,
    BlockRetained,
    BlockState,
    BlockStored,
    CapacityExhausted,
    CommitResult,
    InvalidArgument,
    Retention,
    RetentionOutcome,
    TxClosed,
    TxExpired,
    TxMode,
)

CAPACITY_BLOCKS = 8


@dataclass
class FakeClock:
    now_s: float = 0.0

    def __call__(self) -> float:
        return self.now_s


@dataclass
class OpenTx:
    params: AllocateParams
    result: AllocateResult


@dataclass
class Model:
    open: dict[str, OpenTx] = field(default_factory=dict)
    committed: dict[str, CommitResult] = field(default_factory=dict)
    aborted: dict[str, AbortResult] = field(default_factory=dict)
    expired: set[str] = field(default_factory=set)


prompts = st.lists(st.integers(min_value=0, max_value=2), min_size=1, max_size=6)
tenants = st.sampled_from(["a", "b"])
modes = st.sampled_from([TxMode.ALLOCATE, TxMode.ALLOCATE, TxMode.LOCK_ONLY])
leases = st.sampled_from([0.5, 1.0, 2.0, 5.0])
retains = st.one_of(
    st.none(),
    st.tuples(st.integers(min_value=1, max_value=6), st.sampled_from([1.0, 2.0, 4.0])),
)
picks = st.integers(min_value=0, max_value=1_000)


def snapshot(pool: BlockPool) -> tuple[object, ...]:
    blocks = tuple(
        (pool.block_state(h), pool.block_key(h), pool.get_payload(h))
        for h in range(pool.capacity_blocks)
    )
    return (pool.stats(), blocks, tuple(pool.cached_keys()))


class BlockPoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.pool = BlockPool(
            CAPACITY_BLOCKS,
            self.clock,
            max_lease_s=10.0,
            retention_budget_block_s=12.0,
            max_retained_blocks=4,
            max_retention_s=5.0,
        )
        # Keys a granted retention promised to keep until then (set at commit).
        self.promised: dict[BlockKey, float] = {}
        self.retained_shadow: set[BlockKey] = set()  # retained keys rebuilt from events
        self.model = Model()
        self.shadow: set[BlockKey] = set()  # cached keys rebuilt from events only
        self.engine_removed: set[BlockKey] = set()  # keys ever mirrored as removed
        self.next_tx = 0

    @initialize()
    def start(self) -> None:
        self.pool.check_invariants()

    # ------------------------------------------------------------------ helpers

    def _pick_open(self, pick: int) -> str | None:
        if not self.model.open:
            return None
        ids = sorted(self.model.open)
        return ids[pick % len(ids)]

    def _sync_expired(self, expired: list[str]) -> None:
        for tx_id in expired:
            event("lease expired")
            assert tx_id in self.model.open, f"pool expired unknown tx {tx_id}"
            assert self.model.open[tx_id].result.lease_deadline <= self.clock.now_s
            del self.model.open[tx_id]
            self.model.expired.add(tx_id)

    def _expire_now(self) -> None:
        self._sync_expired(self.pool.expire_leases())

    # ------------------------------------------------------------------ rules

    @rule(tokens=prompts, tenant=tenants, mode=modes, lease_s=leases, retain=retains)
    def allocate(
        self,
        tokens: list[int],
        tenant: str,
        mode: TxMode,
        lease_s: float,
        retain: tuple[int, float] | None,
    ) -> None:
        self._expire_now()  # so a CapacityExhausted can be compared with the state before
        keys = compute_block_keys(tokens, tenant=tenant, model="m", block_size=1)
        tx_id = f"tx{self.next_tx}"
        self.next_tx += 1
        wanted: tuple[Retention, ...] = ()
        if retain is not None and mode is TxMode.ALLOCATE:
            wanted = (Retention(min(retain[0], len(keys)), retain[1]),)
        params = AllocateParams(
            tx_id=tx_id, tenant=tenant, keys=keys, lease_s=lease_s, mode=mode, retain=wanted
        )
        cached_before = self.pool.match_prefix(keys)
        before = snapshot(self.pool)
        events_before = self.pool.take_events()
        self._apply_events(events_before)
        exhausted: CapacityExhausted | None = None
        try:
            result = self.pool.tx_allocate(params)
        except CapacityExhausted as exc:
            exhausted = exc
        if exhausted is not None:
            event("capacity exhausted")
            assert mode is TxMode.ALLOCATE
            assert exhausted.needed_blocks > exhausted.free_blocks
            assert snapshot(self.pool) == before, "CapacityExhausted changed the pool"
            assert self.pool.take_events() == []
            return
        if result.shared_blocks:
            event("shared in-flight blocks")
        if result.reused_blocks:
            event("reused cached prefix")
        if wanted:
            event(f"retention {result.retention.value}")
            granted = result.retention is RetentionOutcome.GRANTED
            assert result.retained_blocks == (wanted[0].blocks if granted else 0)
        else:
            assert result.retention is RetentionOutcome.NONE
        self.model.open[tx_id] = OpenTx(params, result)
        assert result.reused_blocks == cached_before
        assert result.lease_deadline == self.clock.now_s + lease_s
        if mode is TxMode.LOCK_ONLY:
            assert len(result.handles) == cached_before
            assert result.new_blocks == 0
        else:
            assert len(result.handles) == len(keys)
            # The engine writes each in-flight block's content (here: its key).
            for h, key in zip(result.handles, keys, strict=True):
                if self.pool.block_state(h) is BlockState.ALLOCATED:
                    assert self.pool.set_payload(h, key)

    @rule(pick=picks, lease_s=leases)
    def retry_allocate(self, pick: int, lease_s: float) -> None:
        tx_id = self._pick_open(pick)
        if tx_id is None:
            return
        self._expire_now()
        if tx_id not in self.model.open:
            return
        tx = self.model.open[tx_id]
        before = snapshot(self.pool)
        again = self.pool.tx_allocate(
            AllocateParams(
                tx_id=tx_id,
                tenant=tx.params.tenant,
                keys=list(tx.params.keys),
                lease_s=lease_s,
                mode=tx.params.mode,
            )
        )
        assert again == tx.result
        assert snapshot(self.pool) == before, "idempotent retry changed the pool"

    @rule(pick=picks)
    def retry_with_other_keys(self, pick: int) -> None:
        tx_id = self._pick_open(pick)
        if tx_id is None:
            return
        self._expire_now()
        if tx_id not in self.model.open:
            return
        tx = self.model.open[tx_id]
        other = AllocateParams(
            tx_id=tx_id,
            tenant=tx.params.tenant,
            keys=[*tx.params.keys, BlockKey(12345)],
            lease_s=1.0,
            mode=tx.params.mode,
        )
        before = snapshot(self.pool)
        try:
            self.pool.tx_allocate(other)
        except InvalidArgument:
            pass
        else:
            raise AssertionError("retry with other keys was accepted")
        assert snapshot(self.pool) == before

    @rule(pick=picks)
    def commit(self, pick: int) -> None:
        tx_id = self._pick_open(pick)
        if tx_id is None:
            return
        self._expire_now()
        if tx_id not in self.model.open:
            return
        tx = self.model.open.pop(tx_id)
        result = self.pool.tx_commit(tx_id)
        self.model.committed[tx_id] = result
        n = len(tx.result.handles)
        held = list(tx.params.keys)[:n]
        assert set(result.stored_keys) <= set(held)
        if not set(held) & self.engine_removed:  # else dropped at its last unlock (I6)
            for h, key in zip(tx.result.handles, held, strict=True):
                assert self.pool.block_key(h) == key
                assert self.pool.block_state(h) is BlockState.CACHED
            assert self.pool.match_prefix(held) == n
        if tx.result.retention is RetentionOutcome.GRANTED:
            opened_s = tx.result.lease_deadline - tx.params.lease_s
            until = opened_s + tx.params.retain[0].ttl_s
            for key in held[: tx.result.retained_blocks]:
                if key not in self.engine_removed:
                    self.promised[key] = max(self.promised.get(key, 0.0), until)
        if tx.params.mode is TxMode.LOCK_ONLY:
            assert result.stored_keys == ()

    @rule(pick=picks)
    def abort(self, pick: int) -> None:
        tx_id = self._pick_open(pick)
        if tx_id is None:
            return
        self._expire_now()
        if tx_id not in self.model.open:
            return
        tx = self.model.open.pop(tx_id)
        result = self.pool.tx_abort(tx_id)
        self.model.aborted[tx_id] = result
        assert not result.expired
        assert result.released_blocks == len(tx.result.handles)
        assert result.freed_blocks <= tx.result.new_blocks + tx.result.shared_blocks

    @rule(pick=picks)
    def retry_finished(self, pick: int) -> None:
        finished = sorted([*self.model.committed, *self.model.aborted, *self.model.expired])
        if not finished:
            return
        tx_id = finished[pick % len(finished)]
        before = snapshot(self.pool)
        if tx_id in self.model.committed:
            assert self.pool.tx_commit(tx_id) == self.model.committed[tx_id]
        elif tx_id in self.model.aborted:
            assert self.pool.tx_abort(tx_id) == self.model.aborted[tx_id]
            try:
                self.pool.tx_commit(tx_id)
            except TxExpired:
                raise AssertionError("an aborted tx reported as expired") from None
            except TxClosed:
                pass
        else:
            try:
                self.pool.tx_commit(tx_id)
            except TxExpired:
                pass
            else:
                raise AssertionError("commit after expiry succeeded")
            assert self.pool.tx_abort(tx_id).expired
        assert snapshot(self.pool) == before

    @rule()
    def reset(self) -> None:
        """An engine reset: every open tx aborted, every block and retention gone."""
        self._expire_now()
        aborted = self.pool.clear()
        assert set(aborted) == set(self.model.open)
        for tx_id in aborted:
            event("reset with open txs")
            del self.model.open[tx_id]
            self.model.aborted[tx_id] = self.pool.tx_abort(tx_id)  # the remembered answer
        self.promised.clear()
        assert self.pool.stats().cached_blocks == 0

    @rule(dt_s=st.sampled_from([0.25, 0.5, 1.0, 3.0]))
    def advance_clock(self, dt_s: float) -> None:
        self.clock.now_s += dt_s
        due = {
            t for t, tx in self.model.open.items() if tx.result.lease_deadline <= self.clock.now_s
        }
        expired = self.pool.expire_leases()
        assert set(expired) == due
        self._sync_expired(expired)

    @rule(pick=picks, lease_s=leases)
    def extend(self, pick: int, lease_s: float) -> None:
        tx_id = self._pick_open(pick)
        if tx_id is None:
            return
        self._expire_now()
        if tx_id not in self.model.open:
            return
        deadline = self.pool.tx_extend(tx_id, lease_s)
        tx = self.model.open[tx_id]
        tx.result = replace(tx.result, lease_deadline=deadline)
        assert self.pool.get_tx(tx_id) == tx.result

    @rule(tokens=prompts, tenant=tenants)
    def mirror_stored(self, tokens: list[int], tenant: str) -> None:
        keys = compute_block_keys(tokens, tenant=tenant, model="m", block_size=1)
        locked_before = {
            h: self.pool.block_key(h)
            for h in range(CAPACITY_BLOCKS)
            if self.pool.block_state(h) is BlockState.ALLOCATED
        }
        added = self.pool.mirror_stored(keys, None)
        if added:
            event("mirrored stored")
        for h, key in locked_before.items():  # in-flight blocks are left to their tx
            assert self.pool.block_key(h) == key
            assert self.pool.block_state(h) is BlockState.ALLOCATED

    @rule(tokens=prompts, tenant=tenants)
    def mirror_removed(self, tokens: list[int], tenant: str) -> None:
        keys = compute_block_keys(tokens, tenant=tenant, model="m", block_size=1)
        self.engine_removed.update(keys)
        for key in keys:  # the engine's own eviction ends a retention
            self.promised.pop(key, None)
        if self.pool.mirror_removed(keys):
            event("mirrored removed")
        for key in keys:  # gone now, unless a tx holds it
            h = next((h for h in range(CAPACITY_BLOCKS) if self.pool.block_key(h) == key), None)
            if h is not None:
                assert self.pool.stats().locked_blocks > 0

    @rule()
    def mirror_clear(self) -> None:
        held = (self.pool.block_key(h) for h in range(CAPACITY_BLOCKS))
        self.engine_removed.update(k for k in held if k is not None)
        self.promised.clear()
        self.pool.mirror_clear()
        stats = self.pool.stats()
        assert stats.evictable_blocks == 0

    # ------------------------------------------------------------------ invariants

    def _apply_events(self, events: Sequence[BlockEvent]) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                assert not set(ev.keys) & self.shadow, "stored twice without removal"
                self.shadow.update(ev.keys)
            elif isinstance(ev, BlockRemoved):
                event("evicted")
                assert set(ev.keys) <= self.shadow, "removed a key never stored"
                self.shadow.difference_update(ev.keys)
                self.retained_shadow.difference_update(ev.keys)
            elif isinstance(ev, BlockRetained):
                assert set(ev.keys) <= self.shadow, "retained a key never stored"
                if ev.ttl_s:
                    self.retained_shadow.update(ev.keys)
                else:
                    event("retention ended")
                    self.retained_shadow.difference_update(ev.keys)
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.shadow.clear()
                self.retained_shadow.clear()

    @invariant()
    def pool_invariants_hold(self) -> None:
        self.pool.check_invariants()

    @invariant()
    def capacity_never_over_committed(self) -> None:
        stats = self.pool.stats()
        assert stats.allocated_blocks + stats.cached_blocks <= stats.capacity_blocks
        assert stats.free_blocks + stats.allocated_blocks + stats.cached_blocks == CAPACITY_BLOCKS
        assert stats.locked_blocks <= CAPACITY_BLOCKS

    @invariant()
    def held_blocks_keep_their_keys(self) -> None:
        # Locked blocks are never evicted, freed or re-keyed while their tx is open.
        for tx in self.model.open.values():
            keys = list(tx.params.keys)
            for i, h in enumerate(tx.result.handles):
                assert self.pool.block_key(h) == keys[i]
                assert self.pool.block_state(h) is not BlockState.FREE

    @invariant()
    def cached_content_is_never_overwritten(self) -> None:
        for h in range(CAPACITY_BLOCKS):
            if self.pool.block_state(h) is BlockState.CACHED:
                # Mirrored blocks carry no payload: their KV lives in the engine.
                assert self.pool.get_payload(h) in (None, self.pool.block_key(h))

    @invariant()
    def events_rebuild_the_cached_set(self) -> None:
        self._apply_events(self.pool.take_events())
        assert self.shadow == set(self.pool.cached_keys())

    @invariant()
    def retention_keeps_its_promise(self) -> None:
        cached = set(self.pool.cached_keys())
        for key, until in list(self.promised.items()):
            if self.clock.now_s >= until:
                del self.promised[key]
            else:
                assert key in cached, f"retained key {key:#x} evicted before its TTL"

    @invariant()
    def events_rebuild_the_retained_set(self) -> None:
        self._apply_events(self.pool.take_events())
        assert self.retained_shadow == {k for k, _ in self.pool.retained_keys()}

    @invariant()
    def open_txs_match(self) -> None:
        # Expiry is synced whenever the clock moves, so the counts agree exactly.
        assert self.pool.stats().open_txs == len(self.model.open)


BlockPoolMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None
)
TestBlockPoolStateful = BlockPoolMachine.TestCase
