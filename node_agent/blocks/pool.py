"""The node agent's authoritative paged block table (Mooncake §5.3 TxAllocate/Commit/Abort).

Model
    ``capacity_blocks`` blocks with integer handles ``0..capacity-1``. Each block is

    * FREE      — on the free list, no key, no payload;
    * ALLOCATED — owned by one or more OPEN transactions, keyed, content not yet valid;
    * CACHED    — committed: content valid, findable by key, reusable by later requests.

    ``key -> handle`` holds every non-free block: at most one block per key, ever. A block's
    ``lock_count`` is the number of open transactions holding it. CACHED blocks with no
    lock sit in an LRU (``OrderedDict``, oldest first) and are the only eviction victims.

Transactions
    ``tx_allocate`` (mode ALLOCATE) walks the keys: a CACHED key is reused and locked; a key
    ALLOCATED by another open tx (two conductors racing on one prefix) is *shared*: this tx
    joins its owners and locks it — no second block is ever made for a key; a missing key
    gets a fresh block (from the free list, else by evicting LRU victims). It reports
    ``reused_blocks`` = the contiguous CACHED prefix, ``shared_blocks`` and ``new_blocks``.
    Capacity is checked before anything changes, so ``CapacityExhausted`` leaves the pool
    exactly as it was. Mode LOCK_ONLY (source side of a node-to-node copy) locks the
    longest CACHED prefix and allocates nothing.

    ``tx_commit`` turns the tx's ALLOCATED blocks CACHED (first committer of a shared block
    wins; content for one key is the same whoever computed it) and releases its locks.
    ``tx_abort`` releases its locks and frees the ALLOCATED blocks no other open tx owns.
    A lease (``lease_s`` <= ``max_lease_s``) bounds every tx: when it runs out the tx is
    aborted by itself (``expire_leases``, also run lazily at the start of each operation).
    Locks are released tail-first, so the tail of a prompt is evicted before its head.

Idempotency (by ``tx_id``)
    * allocate retry, tx open, same ``(tenant, mode, keys)`` -> the same result, nothing
      allocated again (``lease_s`` is not part of the identity; use ``tx_extend``);
      different keys/tenant/mode -> ``InvalidArgument``;
    * commit retry of a committed tx -> the same ``CommitResult``;
    * abort retry of an aborted or expired tx -> the same ``AbortResult``;
    * commit (or extend, or allocate) of an expired tx -> ``TxExpired``; of an aborted tx,
      or abort/allocate of a committed one -> ``TxClosed``.
    Finished txs are remembered in a bounded FIFO (``max_finished_txs`` entries and
    ``max_finished_keys`` retained keys, whichever binds first); beyond it a retry gets
    ``TxNotFound``.

Exceptions::

    BlockPoolError
     ├── InvalidArgument       malformed tx_id / keys / lease / handle   (INVALID_ARGUMENT)
     ├── TxNotFound            unknown or forgotten tx_id                 (NOT_FOUND)
     ├── TxClosed              tx already finished another way            (FAILED_PRECONDITION)
     │    └── TxExpired        its lease ran out, it was aborted          (FAILED_PRECONDITION)
     ├── CapacityExhausted     needed_blocks > free_blocks (free+evictable) (RESOURCE_EXHAUSTED)
     ├── TenantQuotaExceeded   the tenant would lock more than its share   (RESOURCE_EXHAUSTED)
     └── TenantMismatch        a key stored or held by another tenant     (PERMISSION_DENIED)

Tenants
    A block remembers the tenant whose tx created it (blocks mirrored from an engine's
    own cache have none). A tx naming a key whose block belongs to another tenant is
    refused before anything changes: a tenant cannot lock, read or overwrite another's
    KV even when it learns the keys. While another tenant holds locks, a tenant may
    take its own locked blocks to at most ``max_tenant_locked_blocks`` (a prefix shared
    by many txs counts once); alone on the node, it may use the whole pool. A tx
    naming more keys than ``capacity_blocks`` is ``CapacityExhausted`` before any
    per-key work (a 700,000-key request costs nothing).

Mirroring an engine-owned cache (vLLM)
    An engine that keeps KV in its own paged cache reports what it cached and evicted
    (vLLM's KV events). ``mirror_stored`` marks those keys CACHED outside any tx: a key
    already CACHED is refreshed in the LRU, a key ALLOCATED by an open tx is left to that
    tx's commit, a new key takes a free block, else the LRU victim, else it is skipped
    (conservative: a key missing here costs a recompute, never a wrong answer).
    ``mirror_removed`` frees unlocked CACHED blocks at once; a locked or ALLOCATED one is
    only *marked* and freed when its last lock is released (I6) — a mirror never takes a
    block from under a lock. A later ``mirror_stored`` of a marked key unmarks it.
    ``mirror_clear`` is ``mirror_removed`` of every key. All three queue the usual events.

Lower tiers (``lower``: ``node_agent.blocks.tiers.LowerTiers``, optional)
    An LRU victim that holds content is *demoted* (L2 host memory, then L3 disk) instead
    of dropped, queued as ``BlockMoved(keys, HOST|DISK)``; what falls off L3 is
    ``BlockRemoved``. ``tx_allocate`` *promotes* a demoted key of the reused prefix back
    into a fresh block of the pool (it needs room like any new block; content read
    before anything changes, so ``CapacityExhausted`` still leaves everything as it
    was): the block is CACHED at once, counted in ``reused_blocks`` and
    ``promoted_blocks``, queued as ``BlockMoved(keys, DEVICE)``. A demoted key past the
    reused prefix is discarded (the tx recomputes it; ``BlockRemoved``), as is one whose
    file proves damaged (a miss, never loaded). Tenants hold across tiers. LOCK_ONLY
    (the source of a pull) promotes the demoted blocks that continue its prefix too, as
    far as there is room without touching what it locks: a peer pulls from this node's
    host memory and disk as well.

Replica-aware eviction (``replicas_elsewhere``, optional: how many other nodes hold a
    key, as the conductor's shadow sees it)
    Victims are still taken in LRU order, but one that another node also holds is
    dropped instead of demoted: the lower tiers keep the fleet's last copies. Evaluated
    in the simulator (docs/benchmarks.md, ``kv-tiers``): it does not pay on the
    synthetic trace, so it stays off unless asked for.

Donate before evict (``donate``, optional: the owner's offer to a peer)
    A victim that leaves the node for good (no lower tier takes it) and was hot here
    (reused at least ``donate_min_hits`` times, donated fewer than ``donate_max_hops``
    times before) is handed to ``donate`` as a ``Donation`` (key, tenant, content, how
    long it sat unused, the key before it in its prefix) after it left: the owner decides
    whether it is the fleet's last copy and which peer takes it (``accept_donation``
    there). A peer holding the block's parent (only there can it ever be reused)
    accepts it into a free block, or in place of its own LRU victim when that one sat
    unused longer than the donation did (the fleet keeps the more recently used of the
    two); the donated block enters its LRU as most recently used, keeping its idle
    time, and is announced ``BlockStored``. A pool in the middle of an eviction (the
    donor, or a peer whose own displaced victim is being offered on) accepts nothing,
    so offers never re-enter a pool mid-allocation; each hop moves a block idle longer
    than the last, so chains end.
    The simulator (``ClusterConfig.donate_before_evict``) and the agents
    (``donate_before_evict``, ``node_agent.donation``) wire it; evaluated in the
    simulator (docs/benchmarks.md, ``donate-before-evict``) it does not pay, so it is off
    unless asked for.

Retention (prompt-cache breakpoints: ``AllocateParams.retain``)
    A retained block is a lock with another kind of lease: CACHED and unlocked, it stays
    out of the LRU until its retention deadline, so no eviction takes it. ``tx_allocate``
    (ALLOCATE) with ``retain=(Retention(blocks, ttl_s), ...)`` retains the first
    ``blocks`` keys for ``ttl_s`` after their last use (several breakpoints: each key
    takes the longest TTL covering it). The retention is granted or refused when the tx
    opens, as a whole, and never refuses the tx itself: refused, the request is served
    with ordinary LRU caching and ``AllocateResult.retention`` says why —

    * ``OVER_BUDGET``: the tenant's outstanding retention, the sum over its retained
      blocks of the seconds left, plus what this grant adds, would pass
      ``retention_budget_block_s`` (KV block-seconds per tenant; None: unlimited);
    * ``NODE_FULL``: more than ``max_retained_blocks`` blocks would be retained
      (default half the pool, so automatic caching and new work always keep room);
    * ``TOO_LONG``: a TTL longer than ``max_retention_s``.

    Granted, the blocks are retained from the allocation on (an aborted tx's fresh
    blocks are freed with their retention; one another open tx shares keeps it, charged
    as granted, and is cached when that tx commits); every later hit on a retained block (either
    mode) restarts its TTL, free of charge, as Anthropic's cache does. A retention
    never outlives its block's content: ``clear()`` and an engine eviction
    (``mirror_removed``) end it. When it runs out (``_expire_due``, lazily at each
    call) the block joins the LRU as its oldest entry. Events: ``BlockRetained(keys,
    ttl_s)`` for a grant's cached keys when the tx opens and for the retained keys a
    commit caches (or holds), ``BlockRetained(keys, 0)`` when retentions end.

Events
    Queued, never sent: ``take_events()`` drains ``BlockStored`` (on commit, newly cached
    keys as contiguous runs in prefix order, with the parent key), ``BlockRemoved`` (on
    eviction) and ``AllBlocksCleared`` (on ``clear()``). The owner drains after each call.

Knobs
    ``capacity_blocks``, ``max_lease_s``, ``max_finished_txs``, ``max_finished_keys``,
    ``max_tx_id_len``. Time comes from the injected monotonic ``clock`` (seconds).

Complexity
    allocate O(k + e) for k keys and e evictions; commit/abort O(k); lease expiry
    O(log t) per tx via a deadline heap; ``stats`` O(1); ``check_invariants`` O(capacity).

Invariants (checked by ``check_invariants``)
    I1  free + allocated + cached == capacity (so allocated + cached <= capacity).
    I2  key -> handle is a bijection onto the non-free blocks; free blocks have no key,
        payload, lock or owner.
    I3  lock_count of each block == number of open txs holding it; every ALLOCATED block
        has >= 1 owner, every owner is an open tx holding it; CACHED blocks have no owner.
    I4  the LRU holds exactly the CACHED blocks with lock_count == 0 and no retention:
        a locked, allocated (in-use) or retained block is never evicted, and eviction is
        the only way a cached block's content goes away besides ``clear()``.
    I5  every open tx has a finite lease deadline and a heap entry for it.
    I6  every key marked removed-by-the-engine belongs to a locked (or ALLOCATED) block.
    I7  each tenant's lock count is the number of its blocks with a lock, and the
        blocks of one open tx are its tenant's or nobody's; free blocks have no tenant.
    I8  a key is in the pool or in one lower tier, never both.
    I9  retained blocks are non-free, each charged to a tenant and with a heap entry
        due no later than its deadline; each tenant's retained count and deadline sum
        are those of its retained blocks.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

from kvc.block_keys import KEY_BITS, KEY_LAYOUTS, BlockKey, is_key_layout
from node_agent.blocks.tiers import LowerTiers, TierMove
from node_agent.blocks.types import (
    AbortResult,
    AllBlocksCleared,
    AllocateParams,
    AllocateResult,
    BlockEvent,
    BlockMoved,
    BlockRemoved,
    BlockRetained,
    BlockState,
    BlockStored,
    CapacityExhausted,
    CommitResult,
    InvalidArgument,
    KvMedium,
    PoolStats,
    Retention,
    RetentionOutcome,
    TenantMismatch,
    TenantQuotaExceeded,
    TxClosed,
    TxExpired,
    TxMode,
    TxNotFound,
)
from node_agent.kv import KvContent, is_kv_content

__all__ = ["BlockPool", "Donation"]

_KEY_LIMIT = 2**KEY_BITS


# ------------------------------------------------------------------ internal records


@dataclass(frozen=True, slots=True)
class Donation:
    """A hot block leaving its node for good, offered to a peer (donate before evict)."""

    key: BlockKey
    parent: BlockKey | None  # the key before it in its prefix (None: the first, or unknown)
    tenant: str | None
    content: KvContent
    idle_s: float  # how long it sat unused on the donor when it left (clocks differ)
    hits: int  # times it was reused on the donor
    hops: int  # donations of this content so far, this one included


@dataclass(slots=True)
class _Block:
    handle: int
    state: BlockState = BlockState.FREE
    key: BlockKey | None = None
    lock_count: int = 0
    last_used_s: float = 0.0
    hits: int = 0  # times a tx reused it as part of its cached prefix
    parent: BlockKey | None = None  # the key before it in the tx that made it (None: root)
    hops: int = 0  # donated here from a peer: how many times its content was donated
    payload: object | None = None
    owners: set[str] = field(default_factory=set)  # open txs that allocated/joined it
    tenant: str | None = None  # whose tx created it (None: mirrored from the engine)
    retain_until_s: float = 0.0  # retention deadline (0: not retained)
    retain_ttl_s: float = 0.0  # what a hit extends the retention by
    retained_by: str | None = None  # the tenant the retention is charged to
    retain_heaped_s: float = 0.0  # this block's live entry in the retention heap (0: none)


@dataclass(slots=True)
class _Tx:
    tx_id: str
    tenant: str
    key_layout: int
    mode: TxMode
    keys: tuple[BlockKey, ...]
    handles: tuple[int, ...]
    deadline_s: float
    result: AllocateResult


@dataclass(slots=True)
class _TenantRetention:
    blocks: int = 0
    deadline_sum_s: float = 0.0  # sum of its blocks' retention deadlines

    def outstanding(self, now: float) -> float:
        """Block-seconds of retention still to run."""
        return max(0.0, self.deadline_sum_s - self.blocks * now)


class _Outcome(enum.Enum):
    COMMITTED = "committed"
    ABORTED = "aborted"
    EXPIRED = "expired"


@dataclass(frozen=True, slots=True)
class _Finished:
    outcome: _Outcome
    commit: CommitResult | None = None
    abort: AbortResult | None = None

    @property
    def retained_keys(self) -> int:
        return len(self.commit.stored_keys) if self.commit is not None else 0


def _is_uint64(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _KEY_LIMIT


def _check_keys(keys: Sequence[object]) -> None:
    """Raise ``InvalidArgument`` naming the first key that is not a uint64. The common
    case (plain ints in range, as protobuf hands them over) is checked in three C-level
    passes; only otherwise is each key looked at in Python (a prompt has up to thousands
    of keys, and this runs in every allocation and mirrored event)."""
    if keys and set(map(type, keys)) == {int}:
        ints = cast("Sequence[int]", keys)
        if min(ints) >= 0 and max(ints) < _KEY_LIMIT:
            return
    for key in keys:
        if not _is_uint64(key):
            raise InvalidArgument(f"key {key!r} is not a uint64")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


# ----------------------------------------------------------------------- the pool


class BlockPool:
    """Paged block table with leased transactions. Not thread-safe: one owner calls it."""

    def __init__(
        self,
        capacity_blocks: int,
        clock: Callable[[], float],
        max_lease_s: float = 600.0,
        *,
        max_finished_txs: int = 65_536,
        max_finished_keys: int = 262_144,
        max_tx_id_len: int = 256,
        max_tenant_locked_blocks: int | None = None,
        lower: LowerTiers | None = None,
        replicas_elsewhere: Callable[[BlockKey], int] | None = None,
        retention_budget_block_s: float | None = None,
        max_retained_blocks: int | None = None,
        max_retention_s: float = 3600.0,
        donate: Callable[[Donation], bool] | None = None,
        donate_min_hits: int = 1,
        donate_max_hops: int = 1,
    ) -> None:
        if isinstance(capacity_blocks, bool) or capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be > 0, got {capacity_blocks!r}")
        if not (0 < max_lease_s < math.inf):
            raise ValueError(f"max_lease_s must be finite and > 0, got {max_lease_s!r}")
        if max_finished_txs <= 0 or max_finished_keys < 0 or max_tx_id_len <= 0:
            raise ValueError("max_finished_txs and max_tx_id_len must be > 0")
        if retention_budget_block_s is not None and not retention_budget_block_s >= 0:
            raise ValueError("retention_budget_block_s must be >= 0")
        if not (0 < max_retention_s < math.inf):
            raise ValueError(f"max_retention_s must be finite and > 0, got {max_retention_s!r}")
        if max_retained_blocks is not None and not 0 <= max_retained_blocks <= capacity_blocks:
            raise ValueError("max_retained_blocks must lie in [0, capacity_blocks]")
        if donate_min_hits < 0 or donate_max_hops < 1:
            raise ValueError("donate_min_hits must be >= 0 and donate_max_hops >= 1")
        self.capacity_blocks = capacity_blocks
        self.max_lease_s = max_lease_s
        self.retention_budget_block_s = retention_budget_block_s
        self.max_retained_blocks = (
            capacity_blocks // 2 if max_retained_blocks is None else max_retained_blocks
        )
        self.max_retention_s = max_retention_s
        self._retained = 0  # blocks with a retention
        self._retention_heap: list[tuple[float, int]] = []  # (deadline, handle), lazy
        self._retention_by_tenant: dict[str, _TenantRetention] = {}
        self.retentions_granted = 0  # txs whose retention was granted (a metric)
        self.retentions_refused: dict[RetentionOutcome, int] = {
            RetentionOutcome.OVER_BUDGET: 0,
            RetentionOutcome.NODE_FULL: 0,
            RetentionOutcome.TOO_LONG: 0,
        }
        self._clock = clock
        self._max_finished_txs = max_finished_txs
        self._max_finished_keys = max_finished_keys
        self._max_tx_id_len = max_tx_id_len
        self.max_tenant_locked_blocks = max_tenant_locked_blocks  # None: no limit
        self._locked_by_tenant: dict[str, int] = {}  # each tenant's locked blocks

        self._blocks = [_Block(h) for h in range(capacity_blocks)]
        self._free: list[int] = list(range(capacity_blocks - 1, -1, -1))  # pop() -> lowest
        self._by_key: dict[BlockKey, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # CACHED, unlocked; oldest first
        self._n_cached = 0
        self._n_allocated = 0
        self._n_locked = 0

        self._txs: dict[str, _Tx] = {}
        self._deadlines: list[tuple[float, str]] = []  # heap; stale entries skipped lazily
        self._finished: OrderedDict[str, _Finished] = OrderedDict()
        self._finished_keys = 0
        self._events: list[BlockEvent] = []
        # Keys the engine evicted while a tx held them: freed on their last unlock (I6).
        self._engine_dropped: set[BlockKey] = set()
        self.leases_expired = 0  # txs aborted by lease expiry so far (a metric)
        # L2/L3 below this pool (None or disabled: an evicted block is gone).
        self.lower = lower if lower is not None and lower.enabled else None
        # Replica-aware eviction: how many other nodes hold a key (the conductor's view).
        self._replicas_elsewhere = replicas_elsewhere
        # Keys whose KV the engine keeps a host-memory copy of (vLLM's CPU offloading):
        # a device eviction of one of them is a move to HOST, not a removal.
        self._engine_host: set[BlockKey] = set()
        # Lower-tier hits brought back into the pool, by the tier they came from (a metric).
        self.promoted_blocks: dict[KvMedium, int] = {KvMedium.HOST: 0, KvMedium.DISK: 0}
        # Donate before evict: the owner's offer of a hot victim to a peer.
        self._donate = donate
        self._donate_min_hits = donate_min_hits
        self._donate_max_hops = donate_max_hops
        self._evicting = False  # inside ``_evict``: no donation may enter meanwhile
        self.donated_blocks = 0  # victims a peer took (metrics)
        self.accepted_donations = 0  # blocks taken from peers
        self.donation_hits = 0  # reuses of blocks taken from peers

    # ------------------------------------------------------------------ transactions

    def tx_allocate(self, params: AllocateParams) -> AllocateResult:
        """Open a tx holding ``params.keys`` (see the module docstring for the rules)."""
        self._expire_due()
        keys = self._validate_allocate(params)
        tx_id = params.tx_id
        open_tx = self._txs.get(tx_id)
        if open_tx is not None:
            opened = (open_tx.tenant, open_tx.mode, open_tx.keys, open_tx.key_layout)
            if opened != (params.tenant, params.mode, keys, params.key_layout):
                raise InvalidArgument(f"tx {tx_id!r} was opened with different parameters")
            # The retention was decided when the tx opened; a retry gets that answer.
            return open_tx.result
        self._raise_if_finished(tx_id)

        tenant = params.tenant
        self._check_tenant(tenant, keys)
        lock_only = params.mode is TxMode.LOCK_ONLY
        deadline = self._clock() + params.lease_s
        if lock_only:
            result = self._lend(tenant, keys, deadline, tx_id)
        else:
            if self.max_tenant_locked_blocks is not None and self._others_hold_locks(tenant):
                held = [self._blocks[h] for k in keys if (h := self._by_key.get(k)) is not None]
                self._check_quota(tenant, held, fresh=len(keys) - len(held))
            result = self._allocate(tx_id, tenant, keys, deadline)
            if params.retain:
                result = self._retain(tenant, result, params.retain)
        self._txs[tx_id] = _Tx(
            tx_id=tx_id,
            tenant=params.tenant,
            key_layout=params.key_layout,
            mode=params.mode,
            keys=keys,
            handles=result.handles,
            deadline_s=deadline,
            result=result,
        )
        heapq.heappush(self._deadlines, (deadline, tx_id))
        self._compact_deadlines()
        return result

    def tx_commit(self, tx_id: str) -> CommitResult:
        """Cache the tx's ALLOCATED blocks and release its locks. Idempotent."""
        self._expire_due()
        tx = self._txs.get(tx_id)
        if tx is None:
            done = self._lookup_finished(tx_id)
            if done.commit is not None:
                return done.commit
            raise self._closed(tx_id, done)

        stored: list[BlockKey] = []
        run: list[BlockKey] = []
        run_parent: BlockKey | None = None
        for i, h in enumerate(tx.handles):
            block = self._blocks[h]
            if block.state is BlockState.ALLOCATED:
                key = tx.keys[i]
                block.state = BlockState.CACHED
                block.owners.clear()  # other sharers keep their locks, no longer owners
                self._n_allocated -= 1
                self._n_cached += 1
                stored.append(key)
                if not run:
                    run_parent = tx.keys[i - 1] if i > 0 else None
                run.append(key)
            elif run:
                self._events.append(BlockStored(tuple(run), run_parent))
                run = []
        if run:
            self._events.append(BlockStored(tuple(run), run_parent))
        # Its own retained blocks, and blocks another tx's grant retained while in flight.
        retained = {h for h in tx.handles if self._blocks[h].retain_until_s}
        if retained:
            self._announce_retained(tuple(h for h in tx.handles if h in retained))
        self._release_locks(tx.handles)
        del self._txs[tx_id]
        result = CommitResult(tx_id, tuple(stored), len(tx.handles))
        self._remember(tx_id, _Finished(_Outcome.COMMITTED, commit=result))
        return result

    def tx_abort(self, tx_id: str) -> AbortResult:
        """Release the tx's locks and free the blocks only it owned. Idempotent."""
        self._expire_due()
        tx = self._txs.get(tx_id)
        if tx is None:
            done = self._lookup_finished(tx_id)
            if done.abort is not None:
                return done.abort
            raise self._closed(tx_id, done)
        return self._abort(tx, expired=False)

    def tx_extend(self, tx_id: str, lease_s: float) -> float:
        """Set the tx's deadline to ``now + lease_s``; returns the new deadline."""
        self._expire_due()
        self._validate_lease(lease_s)
        tx = self._txs.get(tx_id)
        if tx is None:
            done = self._lookup_finished(tx_id)
            raise self._closed(tx_id, done)
        tx.deadline_s = self._clock() + lease_s
        tx.result = replace(tx.result, lease_deadline=tx.deadline_s)
        heapq.heappush(self._deadlines, (tx.deadline_s, tx_id))
        self._compact_deadlines()
        return tx.deadline_s

    def get_tx(self, tx_id: str) -> AllocateResult:
        """The allocation of an OPEN tx (e.g. a Prefill call naming its tx)."""
        self._expire_due()
        tx = self._txs.get(tx_id)
        if tx is None:
            done = self._lookup_finished(tx_id)
            raise self._closed(tx_id, done)
        return tx.result

    def expire_leases(self) -> list[str]:
        """Abort every tx whose lease deadline has passed; returns their ids."""
        return self._expire_due()

    def clear(self) -> list[str]:
        """Engine reset: abort every open tx, drop every block, queue ``AllBlocksCleared``.

        Returns the ids of the aborted txs (they are remembered as aborted).
        """
        aborted = list(self._txs)
        for tx_id in aborted:
            self._abort(self._txs[tx_id], expired=False)
        for block in self._blocks:
            if block.state is BlockState.CACHED:
                self._drop_cached(block)
        if self.lower is not None:
            self.lower.clear()
        self._engine_host.clear()
        self._deadlines.clear()
        self._retention_heap.clear()
        for block in self._blocks:  # their heap entries are gone with the heap
            block.retain_heaped_s = 0.0
        self._events.append(AllBlocksCleared())
        return aborted

    # ------------------------------------------------------------------ engine mirror

    def mirror_stored(self, keys: Sequence[BlockKey], parent_key: BlockKey | None) -> int:
        """The engine cached ``keys`` (a chain after ``parent_key``): mark them CACHED.

        Outside any tx; never touches a locked or ALLOCATED block and never evicts a key
        of this call. Queues ``BlockRemoved`` for LRU victims, then ``BlockStored`` for
        the keys it added as contiguous runs. Returns the number of keys added.
        """
        self._expire_due()
        _check_keys(keys)
        added: set[BlockKey] = set()
        evicted: list[BlockKey] = []
        runs: list[BlockStored] = []
        run: list[BlockKey] = []
        run_parent: BlockKey | None = None
        now = self._clock()
        prev = parent_key
        for key in keys:
            self._engine_dropped.discard(key)
            h = self._by_key.get(key)
            if h is not None:
                block = self._blocks[h]
                if block.state is BlockState.CACHED and block.lock_count == 0:
                    if not block.retain_until_s:
                        self._lru.move_to_end(h)
                    block.last_used_s = now
            else:
                h = self._take_block_for_mirror(added, evicted)
                if h is not None:
                    block = self._blocks[h]
                    block.state = BlockState.CACHED
                    block.key = key
                    block.last_used_s = now
                    self._by_key[key] = h
                    self._n_cached += 1
                    self._lru[h] = None
                    added.add(key)
                    if not run:
                        run_parent = prev
                    run.append(key)
                    prev = key
                    continue
            if run:
                runs.append(BlockStored(tuple(run), run_parent))
                run = []
            prev = key
        if run:
            runs.append(BlockStored(tuple(run), run_parent))
        if evicted:
            self._events.append(BlockRemoved(tuple(evicted)))
        self._events.extend(runs)
        return len(added)

    def mirror_removed(self, keys: Sequence[BlockKey]) -> int:
        """The engine evicted ``keys``: free them, or mark them while a tx holds them (I6).

        Unknown keys are ignored. Queues ``BlockRemoved`` for the keys freed now and
        returns how many that is.
        """
        self._expire_due()
        dropped: list[BlockKey] = []
        for key in keys:
            h = self._by_key.get(key)
            if h is None:
                continue
            block = self._blocks[h]
            if block.state is BlockState.CACHED and block.lock_count == 0:
                dropped.append(self._drop_cached(block))
            else:
                self._engine_dropped.add(key)
        if dropped:
            self._left_device(dropped)
        return len(dropped)

    def mirror_clear(self) -> int:
        """The engine dropped its whole cache: ``mirror_removed`` of every key held, and
        its host copies."""
        host_only = [k for k in self._engine_host if k not in self._by_key]
        self._engine_host.clear()
        if host_only:
            self._events.append(BlockRemoved(tuple(host_only)))
        return self.mirror_removed(list(self._by_key))

    def mirror_host_stored(self, keys: Sequence[BlockKey]) -> int:
        """The engine copied ``keys`` to its host memory (it keeps the device copy too).
        A key not in the pool is held again, in HOST: ``BlockMoved``. Returns how many
        keys gained a host copy."""
        self._expire_due()
        added = 0
        back: list[BlockKey] = []
        for key in keys:
            if not _is_uint64(key):
                raise InvalidArgument(f"key {key!r} is not a uint64")
            if key in self._engine_host:
                continue
            self._engine_host.add(key)
            added += 1
            if key not in self._by_key:
                back.append(key)
        if back:
            self._events.append(BlockMoved(tuple(back), KvMedium.HOST))
        return added

    def mirror_host_removed(self, keys: Sequence[BlockKey]) -> int:
        """The engine dropped the host copies of ``keys``; those not in the pool are
        gone from the node (``BlockRemoved``). Returns how many copies were dropped."""
        self._expire_due()
        dropped = 0
        gone: list[BlockKey] = []
        for key in keys:
            if key in self._engine_host:
                self._engine_host.discard(key)
                dropped += 1
                if key not in self._by_key:
                    gone.append(key)
        if gone:
            self._events.append(BlockRemoved(tuple(gone)))
        return dropped

    def _left_device(self, keys: Sequence[BlockKey]) -> None:
        """Queue events for keys the pool no longer holds: a move to HOST for those the
        engine keeps in host memory, a removal for the rest."""
        host = self._engine_host
        kept = [k for k in keys if k in host] if host else []
        gone = [k for k in keys if k not in host] if kept else list(keys)
        if gone:
            self._events.append(BlockRemoved(tuple(gone)))
        if kept:
            self._events.append(BlockMoved(tuple(kept), KvMedium.HOST))

    def _take_block_for_mirror(
        self, protected: set[BlockKey], evicted: list[BlockKey]
    ) -> int | None:
        """A free block, else the LRU victim unless this same call added it."""
        if self._free:
            return self._free.pop()
        victim = next(iter(self._lru), None)
        if victim is None or self._blocks[victim].key in protected:
            return None
        for move in self._evict_block(self._blocks[victim]):
            if move.medium is None:
                evicted.append(move.key)
            else:
                self._queue_moves([move])
        return self._free.pop()

    # ------------------------------------------------------------------ payloads

    def set_payload(self, handle: int, obj: object) -> bool:
        """Store the engine's data (e.g. KV tensors) for an ALLOCATED block.

        Returns False, storing nothing, when the block is already CACHED: its content is
        immutable once committed (a shared block committed by another tx first — same
        key, same content). A FREE block or a bad handle is ``InvalidArgument``.
        """
        block = self._block(handle)
        if block.state is BlockState.FREE:
            raise InvalidArgument(f"block {handle} is free")
        if block.state is BlockState.CACHED:
            return False
        block.payload = obj
        return True

    def get_payload(self, handle: int) -> object | None:
        return self._block(handle).payload

    # ------------------------------------------------------------------ queries

    def match_prefix(self, keys: Sequence[BlockKey]) -> int:
        """Number of leading ``keys`` that are CACHED here (read-only, LRU untouched)."""
        n = 0
        for key in keys:
            h = self._by_key.get(key)
            if h is None or self._blocks[h].state is not BlockState.CACHED:
                break
            n += 1
        return n

    def block_state(self, handle: int) -> BlockState:
        return self._block(handle).state

    def block_key(self, handle: int) -> BlockKey | None:
        return self._block(handle).key

    def stats(self) -> PoolStats:
        self._expire_due()
        return PoolStats(
            capacity_blocks=self.capacity_blocks,
            free_blocks=len(self._free),
            cached_blocks=self._n_cached,
            allocated_blocks=self._n_allocated,
            locked_blocks=self._n_locked,
            open_txs=len(self._txs),
            evictable_blocks=len(self._lru),
            retained_blocks=self._retained,
        )

    def cached_keys(self) -> list[BlockKey]:
        """Every CACHED key (locked or not), in handle order: the snapshot payload."""
        return [b.key for b in self._blocks if b.state is BlockState.CACHED and b.key is not None]

    def tier_keys(self, medium: KvMedium) -> list[BlockKey]:
        """The keys held in a lower tier (HOST or DISK) and not in the pool: demoted
        ones (oldest first), then, for HOST, the engine's own host copies."""
        keys = [] if self.lower is None else self.lower.keys(medium)
        if medium is KvMedium.HOST and self._engine_host:
            keys.extend(k for k in self._engine_host if k not in self._by_key)
        return keys

    @property
    def engine_host_blocks(self) -> int:
        """Host-memory copies the engine keeps (vLLM's CPU offloading)."""
        return len(self._engine_host)

    def take_events(self) -> list[BlockEvent]:
        """Drain the queued block events, oldest first, neighbours of a kind joined
        (``coalesce_events``)."""
        self._drain_lost()
        events, self._events = self._events, []
        return coalesce_events(events)

    # ------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` when I1..I7 (module docstring) do not hold. O(capacity)."""
        counts = dict.fromkeys(BlockState, 0)
        for block in self._blocks:
            counts[block.state] += 1
        _require(
            counts[BlockState.FREE] + counts[BlockState.ALLOCATED] + counts[BlockState.CACHED]
            == self.capacity_blocks,
            "I1: states do not add up to capacity",
        )
        _require(counts[BlockState.FREE] == len(self._free), "I1: free list size")
        _require(len(set(self._free)) == len(self._free), "I1: free list duplicates")
        _require(counts[BlockState.ALLOCATED] == self._n_allocated, "I1: allocated counter")
        _require(counts[BlockState.CACHED] == self._n_cached, "I1: cached counter")

        _require(
            len(self._by_key) == self.capacity_blocks - len(self._free),
            "I2: key map size != non-free blocks",
        )
        for key, h in self._by_key.items():
            block = self._blocks[h]
            _require(block.key == key, f"I2: key map {key} -> block {h} keyed {block.key}")
            _require(block.state is not BlockState.FREE, f"I2: key {key} maps to free {h}")
        for h in self._free:
            block = self._blocks[h]
            _require(block.state is BlockState.FREE, f"I2: block {h} on free list not free")
            _require(
                block.key is None
                and block.payload is None
                and block.lock_count == 0
                and block.tenant is None
                and not block.owners,
                f"I2: free block {h} keeps key/payload/lock/owner",
            )

        holders: dict[int, int] = {}
        for tx in self._txs.values():
            _require(len(set(tx.handles)) == len(tx.handles), f"I3: tx {tx.tx_id} repeats")
            for h in tx.handles:
                holders[h] = holders.get(h, 0) + 1
                block = self._blocks[h]
                _require(block.state is not BlockState.FREE, f"I3: tx holds free block {h}")
            for i, h in enumerate(tx.handles):
                _require(
                    self._blocks[h].key == tx.keys[i],
                    f"I3: tx {tx.tx_id} handle {h} no longer holds its key",
                )
        n_locked = 0
        for block in self._blocks:
            _require(
                block.lock_count == holders.get(block.handle, 0),
                f"I3: block {block.handle} lock_count {block.lock_count}"
                f" != holders {holders.get(block.handle, 0)}",
            )
            n_locked += block.lock_count > 0
            if block.state is BlockState.ALLOCATED:
                _require(bool(block.owners), f"I3: allocated block {block.handle} has no owner")
                for owner in block.owners:
                    owner_tx = self._txs.get(owner)
                    _require(
                        owner_tx is not None and block.handle in owner_tx.handles,
                        f"I3: owner {owner} of block {block.handle} is not holding it",
                    )
            else:
                _require(not block.owners, f"I3: non-allocated block {block.handle} owned")
            evictable = (
                block.state is BlockState.CACHED
                and block.lock_count == 0
                and not block.retain_until_s
            )
            _require(
                (block.handle in self._lru) == evictable,
                f"I4: LRU membership of block {block.handle} wrong",
            )
        _require(n_locked == self._n_locked, "I3: locked counter")
        for key in self._engine_dropped:
            dropped = self._by_key.get(key)
            _require(
                dropped is not None and self._blocks[dropped].lock_count > 0,
                f"I6: engine-evicted key {key} is not held by a lock",
            )

        live = {tx_id for d, tx_id in self._deadlines if self._txs.get(tx_id) is not None}
        _require(live == set(self._txs), "I5: open tx without a deadline heap entry")
        for tx in self._txs.values():
            _require(math.isfinite(tx.deadline_s), f"I5: tx {tx.tx_id} has no finite lease")
            _require(
                (tx.deadline_s, tx.tx_id) in self._deadlines,
                f"I5: tx {tx.tx_id} deadline not in heap",
            )
        _require(len(self._finished) <= self._max_finished_txs, "finished memory bound")
        _require(
            self._finished_keys == sum(f.retained_keys for f in self._finished.values()),
            "finished key counter",
        )
        if self.lower is not None:
            for medium in (KvMedium.HOST, KvMedium.DISK):
                for key in self.lower.keys(medium):
                    _require(key not in self._by_key, f"I8: key {key:#x} in the pool and L2/L3")
        retained: dict[str, list[float]] = {}
        heaped = set(self._retention_heap)
        for block in self._blocks:
            if block.retain_until_s:
                h = block.handle
                _require(block.state is not BlockState.FREE, f"I9: free block {h} retained")
                _require(block.retained_by is not None, f"I9: block {h} charged to no one")
                assert block.retained_by is not None
                retained.setdefault(block.retained_by, []).append(block.retain_until_s)
                _require(
                    0 < block.retain_heaped_s <= block.retain_until_s
                    and (block.retain_heaped_s, block.handle) in heaped,
                    f"I9: retained block {block.handle} has no due heap entry",
                )
        _require(sum(map(len, retained.values())) == self._retained, "I9: retained counter")
        _require(set(retained) == set(self._retention_by_tenant), "I9: retaining tenants")
        for tenant, deadlines in retained.items():
            mine = self._retention_by_tenant[tenant]
            _require(mine.blocks == len(deadlines), f"I9: {tenant}'s retained count")
            _require(
                math.isclose(mine.deadline_sum_s, sum(deadlines), rel_tol=1e-9, abs_tol=1e-6),
                f"I9: {tenant}'s retention deadline sum",
            )
        by_tenant: dict[str, int] = {}
        for block in self._blocks:
            if block.tenant is not None and block.lock_count:
                by_tenant[block.tenant] = by_tenant.get(block.tenant, 0) + 1
        _require(by_tenant == self._locked_by_tenant, "I7: tenant lock counts")
        for tx in self._txs.values():
            for h in tx.handles:
                holder = self._blocks[h].tenant
                _require(holder in (None, tx.tenant), f"I7: tx {tx.tx_id} holds {holder}'s block")

    # ------------------------------------------------------------------ internals

    def _check_tenant(self, tenant: str, keys: tuple[BlockKey, ...]) -> None:
        lower = self.lower
        for key in keys:
            h = self._by_key.get(key)
            if h is not None:
                owner = self._blocks[h].tenant
            elif lower is not None:
                owner = lower.tenant_of(key)
            else:
                continue
            if owner is not None and owner != tenant:
                raise TenantMismatch(f"key {key:#x} belongs to another tenant")

    def _others_hold_locks(self, tenant: str) -> bool:
        """Whether another tenant holds locks now: only then is the pool shared and a
        tenant's limit applies (alone, a tenant may use the whole pool)."""
        n = len(self._locked_by_tenant)
        return n > 1 or (n == 1 and tenant not in self._locked_by_tenant)

    def _check_quota(self, tenant: str, held: list[_Block], *, fresh: int) -> None:
        """Refuse a tx that would take the tenant's locked blocks past its limit: the
        ``fresh`` blocks it would create and those of ``held`` not locked yet count."""
        assert self.max_tenant_locked_blocks is not None
        locked = self._locked_by_tenant.get(tenant, 0)
        newly = fresh + sum(b.lock_count == 0 and b.tenant is not None for b in held)
        if locked + newly > self.max_tenant_locked_blocks:
            raise TenantQuotaExceeded(tenant, locked, newly, self.max_tenant_locked_blocks)

    def locked_by_tenant(self, tenant: str) -> int:
        """Blocks of the tenant's that some open tx locks (a shared prefix counts once;
        blocks mirrored from the engine, which have no tenant, are not counted)."""
        return self._locked_by_tenant.get(tenant, 0)

    def tx_tenant(self, tx_id: str) -> str:
        """The tenant of an OPEN tx."""
        self.get_tx(tx_id)
        return self._txs[tx_id].tenant

    def tx_key_layout(self, tx_id: str) -> int:
        """The block-key layout an OPEN tx's keys are in (``AllocateParams.key_layout``)."""
        self.get_tx(tx_id)
        return self._txs[tx_id].key_layout

    def _lend(
        self, tenant: str, keys: tuple[BlockKey, ...], deadline: float, tx_id: str
    ) -> AllocateResult:
        """LOCK_ONLY: lock the longest prefix this node holds, promoting its demoted
        blocks into the pool as far as there is room (a pull source lends from host
        memory and disk too). Never refused for capacity: it lends what it can."""
        handles = self._cached_prefix(keys)
        lower = self.lower
        promote: list[tuple[BlockKey, KvContent, KvMedium, str | None]] = []
        if lower is not None:
            unlocked = sum(self._in_lru(self._blocks[h]) for h in handles)
            room = len(self._free) + len(self._lru) - unlocked
            for key in keys[len(handles) :]:
                medium = lower.medium_of(key)
                if len(promote) >= room or medium is None:
                    break
                owner = lower.tenant_of(key)
                content = lower.load(key)
                if content is None:  # a damaged file: gone, and the prefix ends here
                    self._events.append(BlockRemoved((key,)))
                    break
                promote.append((key, content, medium, owner))
        if self.max_tenant_locked_blocks is not None and self._others_hold_locks(tenant):
            self._check_quota(tenant, [self._blocks[h] for h in handles], fresh=len(promote))
        # From here on nothing can fail.
        now = self._clock()
        for h in handles:
            block = self._blocks[h]
            if block.retain_until_s:  # a peer's pull is a hit too
                self._extend_retention(block, now + block.retain_ttl_s)
            self._lock(block)
        if promote:
            assert lower is not None
            for key, _content, medium, _owner in promote:
                lower.discard(key)
                self.promoted_blocks[medium] += 1
            shortfall = len(promote) - len(self._free)
            if shortfall > 0:
                self._evict(shortfall)
            for key, content, _medium, owner in promote:
                h = self._free.pop()
                block = self._blocks[h]
                block.key = key
                block.tenant = owner
                self._by_key[key] = h
                self._lock(block)  # while not CACHED: the block is in no LRU yet
                block.state = BlockState.CACHED
                block.payload = content
                block.last_used_s = now
                self._n_cached += 1
                handles.append(h)
            self._events.append(BlockMoved(tuple(k for k, *_ in promote), KvMedium.DEVICE))
        return AllocateResult(
            tx_id=tx_id,
            handles=tuple(handles),
            reused_blocks=len(handles),
            new_blocks=0,
            lease_deadline=deadline,
            promoted_blocks=len(promote),
        )

    def _allocate(
        self, tx_id: str, tenant: str, keys: tuple[BlockKey, ...], deadline: float
    ) -> AllocateResult:
        blocks = self._blocks
        lower = self.lower
        plan: list[int | None] = []  # existing handle per key, None = needs a fresh block
        promoted: dict[int, KvContent] = {}  # key index -> content read from L2/L3
        promoted_from: list[KvMedium] = []  # the tier each came from
        superseded: list[BlockKey] = []  # in L2/L3 but past the reused prefix: recomputed
        lost: list[BlockKey] = []  # in L2/L3 but unreadable (a damaged file): gone
        reused_prefix = 0
        in_prefix = True
        needed = 0
        unlocked_reuse = 0  # cached blocks now in the LRU that this tx will lock
        shared = 0
        for i, key in enumerate(keys):
            h = self._by_key.get(key)
            plan.append(h)
            if h is None:
                needed += 1
                medium = None if lower is None else lower.medium_of(key)
                if lower is not None and medium is not None:
                    content = lower.load(key) if in_prefix else None
                    if content is not None:
                        promoted[i] = content
                        promoted_from.append(medium)
                        reused_prefix += 1
                        continue
                    (lost if in_prefix else superseded).append(key)
                in_prefix = False
                continue
            block = blocks[h]
            if block.state is BlockState.CACHED:
                reused_prefix += in_prefix
                unlocked_reuse += self._in_lru(block)
            else:
                shared += 1
                in_prefix = False
        if lost:  # already gone from the lower tier, whatever happens next
            self._events.append(BlockRemoved(tuple(lost)))
        obtainable = len(self._free) + len(self._lru) - unlocked_reuse
        if needed > obtainable:
            raise CapacityExhausted(needed, obtainable)

        # From here on nothing can fail: take promoted/superseded keys out of the lower
        # tiers (a key lives in one place), lock what exists, evict, then allocate.
        for medium in promoted_from:
            self.promoted_blocks[medium] += 1
        if lower is not None:
            for i in promoted:
                lower.discard(keys[i])
            for key in superseded:
                lower.discard(key)
            if superseded:
                self._events.append(BlockRemoved(tuple(superseded)))
        now = self._clock()
        for i, h in enumerate(plan):
            if h is not None:
                block = blocks[h]
                if i < reused_prefix:
                    block.hits += 1
                    self.donation_hits += block.hops > 0
                if block.state is BlockState.ALLOCATED:
                    block.owners.add(tx_id)
                elif block.retain_until_s:  # a hit restarts a retention's TTL
                    self._extend_retention(block, now + block.retain_ttl_s)
                self._lock(block)
        shortfall = needed - len(self._free)
        if shortfall > 0:
            self._evict(shortfall)
        handles: list[int] = []
        for i, (key, maybe_h) in enumerate(zip(keys, plan, strict=True)):
            if maybe_h is not None:
                handles.append(maybe_h)
                continue
            h = self._free.pop()
            block = blocks[h]
            block.key = key
            block.parent = keys[i - 1] if i else None
            block.tenant = tenant
            self._by_key[key] = h
            self._lock(block)  # while not CACHED: the block is in no LRU yet
            content = promoted.get(i)
            if content is None:
                block.state = BlockState.ALLOCATED
                block.owners.add(tx_id)
                self._n_allocated += 1
            else:
                block.state = BlockState.CACHED
                block.payload = content
                block.last_used_s = now
                self._n_cached += 1
            handles.append(h)
        if promoted:
            self._events.append(BlockMoved(tuple(keys[i] for i in promoted), KvMedium.DEVICE))
        return AllocateResult(
            tx_id=tx_id,
            handles=tuple(handles),
            reused_blocks=reused_prefix,
            new_blocks=needed - len(promoted),
            lease_deadline=deadline,
            shared_blocks=shared,
            promoted_blocks=len(promoted),
        )

    def _evict(self, count: int) -> None:
        """Evict ``count`` LRU victims: demoted to the lower tiers when they hold content
        and a tier takes them, else dropped. Queues the events in the order things moved."""
        moves: list[TierMove] = []
        replicas = self._replicas_elsewhere
        evicting, self._evicting = self._evicting, True
        try:
            if replicas is None:
                for _ in range(count):
                    moves.extend(self._evict_block(self._blocks[next(iter(self._lru))]))
            else:
                # Replica-aware: LRU victims as always; those another node also holds are
                # dropped, not demoted, so the lower tiers keep the fleet's last copies.
                for _ in range(count):
                    h = next(iter(self._lru))
                    spare = replicas(self._key_of(h)) > 0
                    moves.extend(self._evict_block(self._blocks[h], demote=not spare))
        finally:
            self._evicting = evicting
        self._queue_moves(moves)

    def _key_of(self, handle: int) -> BlockKey:
        key = self._blocks[handle].key
        assert key is not None
        return key

    def _evict_block(self, block: _Block, *, demote: bool = True) -> list[TierMove]:
        """An unlocked CACHED block out of the pool: into L2/L3 when it can be (and
        ``demote``), else gone."""
        payload, tenant = block.payload, block.tenant
        offer = self._offer(block, payload)
        key = self._drop_cached(block)
        moves = [TierMove(key, None)]
        if demote and self.lower is not None and is_kv_content(payload):
            moves = self.lower.put(key, tenant, payload)
        if offer is not None and moves[0].medium is None and self._donate is not None:
            self.donated_blocks += self._donate(offer)
        return moves

    def _offer(self, block: _Block, payload: object) -> Donation | None:
        """What ``donate`` is offered if ``block`` leaves the node: hot, not donated too
        often, with content. None: nothing to offer."""
        if (
            self._donate is None
            or block.hits < self._donate_min_hits
            or block.hops >= self._donate_max_hops
            or not is_kv_content(payload)
        ):
            return None
        assert block.key is not None
        idle_s = max(0.0, self._clock() - block.last_used_s)
        return Donation(
            block.key, block.parent, block.tenant, payload, idle_s, block.hits, block.hops + 1
        )

    # ------------------------------------------------------------------ donations
    def _holds(self, key: BlockKey) -> bool:
        """``key`` is on this node: in the pool (any state) or a lower tier."""
        return key in self._by_key or (
            self.lower is not None and self.lower.medium_of(key) is not None
        )

    def lru_tail_idle_s(self) -> float:
        """How long the next eviction victim has sat unused: ``inf`` while a free block
        is left (a donation costs nothing here), 0 when nothing can be evicted."""
        if self._free:
            return math.inf
        if not self._lru:
            return 0.0
        oldest = self._blocks[next(iter(self._lru))]
        return max(0.0, self._clock() - oldest.last_used_s)

    def accept_donation(self, donation: Donation) -> bool:
        """Take a peer's block: into a free block, or in place of this pool's LRU victim
        when that one sat unused longer than ``donation`` did. False: refused (held here
        already, its parent not held here — it could never be reused —, in the middle of
        an eviction, or no colder victim)."""
        key, parent = donation.key, donation.parent
        if (
            self._evicting
            or not _is_uint64(key)
            or self._holds(key)
            or (parent is not None and not self._holds(parent))
        ):
            return False
        if not self._free:
            victim = self._blocks[next(iter(self._lru))] if self._lru else None
            if self.lru_tail_idle_s() <= donation.idle_s or (
                victim is not None and victim.key == parent
            ):
                return False  # nothing colder to replace, or it would replace its parent
            self._evict(1)
        block = self._blocks[self._free.pop()]
        block.key = key
        block.parent = donation.parent
        block.tenant = donation.tenant
        block.state = BlockState.CACHED
        block.payload = donation.content
        block.last_used_s = self._clock() - donation.idle_s
        block.hops = donation.hops
        self._by_key[key] = block.handle
        self._n_cached += 1
        self._lru[block.handle] = None
        self._events.append(BlockStored((key,), None))
        self.accepted_donations += 1
        return True

    def _drain_lost(self) -> None:
        """Report removed what a lower tier lost after reporting it held (a failed
        write, a damaged file found by a prefetch)."""
        if self.lower is not None:
            lost = self.lower.take_lost()
            if lost:
                self._events.append(BlockRemoved(tuple(lost)))

    def _queue_moves(self, moves: Sequence[TierMove]) -> None:
        """Events for ``moves``, consecutive moves to one place coalesced (a key can move
        twice in one call: demoted to L2, then pushed on to L3 by a later victim)."""
        run: list[BlockKey] = []
        where: KvMedium | None = None
        for move in [*moves, None]:
            if move is not None and run and move.medium == where:
                run.append(move.key)
                continue
            if run:
                self._events.append(
                    BlockRemoved(tuple(run)) if where is None else BlockMoved(tuple(run), where)
                )
            if move is not None:
                run, where = [move.key], move.medium
        self._drain_lost()

    def _abort(self, tx: _Tx, *, expired: bool) -> AbortResult:
        self._release_locks(tx.handles)
        freed = 0
        for h in reversed(tx.handles):
            block = self._blocks[h]
            if block.state is BlockState.ALLOCATED:
                block.owners.discard(tx.tx_id)
                if not block.owners:
                    self._free_allocated(block)
                    freed += 1
        del self._txs[tx.tx_id]
        result = AbortResult(tx.tx_id, freed, len(tx.handles), expired)
        outcome = _Outcome.EXPIRED if expired else _Outcome.ABORTED
        self._remember(tx.tx_id, _Finished(outcome, abort=result))
        return result

    def _expire_due(self) -> list[str]:
        self._drain_lost()
        now = self._clock()
        expired: list[str] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, tx_id = heapq.heappop(heap)
            tx = self._txs.get(tx_id)
            if tx is None or tx.deadline_s != deadline:
                continue  # finished already, or extended (a newer entry exists)
            self._abort(tx, expired=True)
            expired.append(tx_id)
        self.leases_expired += len(expired)
        if self._retention_heap and self._retention_heap[0][0] <= now:
            self._end_retentions(now)
        return expired

    def _compact_deadlines(self) -> None:
        # Entries of finished or extended txs linger until their time; rebuild the heap
        # when they dominate, so it stays O(open txs) (amortised O(1) per call).
        if len(self._deadlines) > 2 * len(self._txs) + 1024:
            self._deadlines = [(tx.deadline_s, tx.tx_id) for tx in self._txs.values()]
            heapq.heapify(self._deadlines)

    def _cached_prefix(self, keys: tuple[BlockKey, ...]) -> list[int]:
        handles: list[int] = []
        for key in keys:
            h = self._by_key.get(key)
            if h is None or self._blocks[h].state is not BlockState.CACHED:
                break
            handles.append(h)
        return handles

    # ------------------------------------------------------------------ retention

    @staticmethod
    def _in_lru(block: _Block) -> bool:
        """Whether a CACHED block sits in the LRU (unlocked, not retained)."""
        return block.lock_count == 0 and not block.retain_until_s

    def _retain(
        self, tenant: str, result: AllocateResult, retain: tuple[Retention, ...]
    ) -> AllocateResult:
        """Grant or refuse ``retain`` for the blocks ``result`` holds (all locked now)."""
        n = max(r.blocks for r in retain)
        ttls = [0.0] * n
        for r in sorted(retain, key=lambda r: r.ttl_s):  # the longest TTL covering a key
            ttls[: r.blocks] = [float(r.ttl_s)] * r.blocks
        now = self._clock()
        blocks = [self._blocks[h] for h in result.handles[:n]]
        cost = 0.0  # block-seconds this grant adds to the tenant's outstanding retention
        fresh = 0
        for block, ttl in zip(blocks, ttls, strict=True):
            if block.retain_until_s:
                cost += max(0.0, now + ttl - block.retain_until_s)
            else:
                cost += ttl
                fresh += 1
        outcome = RetentionOutcome.GRANTED
        budget = self.retention_budget_block_s
        if max(ttls) > self.max_retention_s:
            outcome = RetentionOutcome.TOO_LONG
        elif self._retained + fresh > self.max_retained_blocks:
            outcome = RetentionOutcome.NODE_FULL
        elif budget is not None:
            mine = self._retention_by_tenant.get(tenant)
            if (mine.outstanding(now) if mine is not None else 0.0) + cost > budget:
                outcome = RetentionOutcome.OVER_BUDGET
        if outcome is not RetentionOutcome.GRANTED:
            self.retentions_refused[outcome] += 1
            return replace(result, retention=outcome)
        for block, ttl in zip(blocks, ttls, strict=True):
            block.retain_ttl_s = max(block.retain_ttl_s, ttl)
            if block.retain_until_s:
                self._extend_retention(block, now + ttl)
            else:
                self._start_retention(block, now + ttl, tenant)
        self.retentions_granted += 1
        self._announce_retained(result.handles[:n])  # the cached ones; the rest at commit
        return replace(result, retention=RetentionOutcome.GRANTED, retained_blocks=n)

    def _start_retention(self, block: _Block, until: float, tenant: str) -> None:
        assert not block.retain_until_s
        assert block.state is not BlockState.FREE
        if block.state is BlockState.CACHED and block.lock_count == 0:
            del self._lru[block.handle]
        block.retain_until_s = until
        block.retained_by = tenant
        mine = self._retention_by_tenant.get(tenant)
        if mine is None:
            mine = self._retention_by_tenant[tenant] = _TenantRetention()
        mine.blocks += 1
        mine.deadline_sum_s += until
        self._retained += 1
        if not block.retain_heaped_s or block.retain_heaped_s > until:
            block.retain_heaped_s = until
            heapq.heappush(self._retention_heap, (until, block.handle))
            if len(self._retention_heap) > 2 * self.capacity_blocks + 1024:
                self._retention_heap = [
                    (b.retain_heaped_s, b.handle) for b in self._blocks if b.retain_heaped_s
                ]
                heapq.heapify(self._retention_heap)

    def _extend_retention(self, block: _Block, until: float) -> None:
        """Move a retention's deadline later (never earlier). Its heap entry stays: when
        it comes due the block is put back at its new deadline."""
        if until > block.retain_until_s:
            assert block.retained_by is not None
            self._retention_by_tenant[block.retained_by].deadline_sum_s += (
                until - block.retain_until_s
            )
            block.retain_until_s = until

    def _unretain(self, block: _Block) -> None:
        assert block.retained_by is not None
        mine = self._retention_by_tenant[block.retained_by]
        mine.blocks -= 1
        mine.deadline_sum_s -= block.retain_until_s
        if not mine.blocks:
            del self._retention_by_tenant[block.retained_by]
        self._retained -= 1
        block.retain_until_s = 0.0
        block.retain_ttl_s = 0.0
        block.retained_by = None

    def _end_retentions(self, now: float) -> None:
        """End the retentions due; their blocks join the LRU as its oldest entries."""
        heap = self._retention_heap
        ended: list[BlockKey] = []
        while heap and heap[0][0] <= now:
            at, h = heapq.heappop(heap)
            block = self._blocks[h]
            if block.retain_heaped_s != at:
                continue  # superseded by an earlier entry for this block
            if not block.retain_until_s:  # ended with its block (freed, cleared)
                block.retain_heaped_s = 0.0
                continue
            if block.retain_until_s > now:  # extended by hits: due later
                block.retain_heaped_s = block.retain_until_s
                heapq.heappush(heap, (block.retain_until_s, h))
                continue
            block.retain_heaped_s = 0.0
            self._unretain(block)
            if block.state is BlockState.CACHED:
                ended.append(self._key_of(h))
                if block.lock_count == 0:
                    self._lru[h] = None
                    self._lru.move_to_end(h, last=False)
        if ended:
            self._events.append(BlockRetained(tuple(ended), 0.0))

    def _announce_retained(self, handles: tuple[int, ...]) -> None:
        """``BlockRetained`` for the retained blocks among ``handles`` (at commit), one
        event per distinct time left."""
        now = self._clock()
        runs: dict[float, list[BlockKey]] = {}
        for h in handles:
            block = self._blocks[h]
            if block.retain_until_s and block.state is BlockState.CACHED:
                left = round(block.retain_until_s - now, 3)
                runs.setdefault(left, []).append(self._key_of(h))
        for left, keys in runs.items():
            self._events.append(BlockRetained(tuple(keys), max(left, 0.001)))

    def retained_keys(self) -> list[tuple[BlockKey, float]]:
        """Every CACHED retained key with the seconds its retention has left (a snapshot)."""
        now = self._clock()
        return [
            (b.key, max(0.0, b.retain_until_s - now))
            for b in self._blocks
            if b.retain_until_s and b.state is BlockState.CACHED and b.key is not None
        ]

    def retention_of(self, tenant: str) -> tuple[int, float]:
        """(blocks retained for ``tenant``, block-seconds of retention they have left)."""
        mine = self._retention_by_tenant.get(tenant)
        if mine is None:
            return 0, 0.0
        return mine.blocks, mine.outstanding(self._clock())

    def retention_tenants(self) -> list[str]:
        return list(self._retention_by_tenant)

    def _lock(self, block: _Block) -> None:
        if block.lock_count == 0:
            self._n_locked += 1
            if block.tenant is not None:
                self._locked_by_tenant[block.tenant] = (
                    self._locked_by_tenant.get(block.tenant, 0) + 1
                )
            if block.state is BlockState.CACHED and not block.retain_until_s:
                del self._lru[block.handle]
        block.lock_count += 1

    def _release_locks(self, handles: tuple[int, ...]) -> None:
        # Tail first: the tail of a prompt enters the LRU first and is evicted first.
        now = self._clock()
        for h in reversed(handles):
            block = self._blocks[h]
            block.lock_count -= 1
            if block.lock_count == 0:
                self._n_locked -= 1
                if block.tenant is not None:
                    left = self._locked_by_tenant[block.tenant] - 1
                    if left:
                        self._locked_by_tenant[block.tenant] = left
                    else:
                        del self._locked_by_tenant[block.tenant]
                block.last_used_s = now
                if block.state is BlockState.CACHED:
                    if block.key in self._engine_dropped:  # the engine evicted it (I6)
                        self._left_device((self._drop_cached(block, in_lru=False),))
                    elif not block.retain_until_s:
                        self._lru[h] = None

    def _drop_cached(self, block: _Block, *, in_lru: bool = True) -> BlockKey:
        """CACHED and unlocked -> FREE (its retention ends); returns the dropped key."""
        key = block.key
        assert key is not None
        assert block.lock_count == 0
        if in_lru and not block.retain_until_s:
            del self._lru[block.handle]
        del self._by_key[key]
        self._n_cached -= 1
        self._to_free(block)
        return key

    def _free_allocated(self, block: _Block) -> None:
        assert block.key is not None
        assert block.lock_count == 0
        del self._by_key[block.key]
        self._n_allocated -= 1
        self._to_free(block)

    def _to_free(self, block: _Block) -> None:
        if block.retain_until_s:
            self._unretain(block)
        if block.key is not None:
            self._engine_dropped.discard(block.key)
        block.state = BlockState.FREE
        block.key = None
        block.tenant = None
        block.payload = None
        block.hits = block.hops = 0
        block.parent = None
        block.owners.clear()
        self._free.append(block.handle)

    def _remember(self, tx_id: str, done: _Finished) -> None:
        self._finished[tx_id] = done
        self._finished_keys += done.retained_keys
        while len(self._finished) > self._max_finished_txs or (
            self._finished_keys > self._max_finished_keys and len(self._finished) > 1
        ):
            _, old = self._finished.popitem(last=False)
            self._finished_keys -= old.retained_keys

    def _lookup_finished(self, tx_id: str) -> _Finished:
        done = self._finished.get(tx_id)
        if done is None:
            raise TxNotFound(tx_id)
        return done

    @staticmethod
    def _closed(tx_id: str, done: _Finished) -> TxClosed:
        if done.outcome is _Outcome.EXPIRED:
            return TxExpired(tx_id)
        return TxClosed(tx_id, done.outcome.value)

    def _raise_if_finished(self, tx_id: str) -> None:
        done = self._finished.get(tx_id)
        if done is not None:
            raise self._closed(tx_id, done)

    def _block(self, handle: int) -> _Block:
        if isinstance(handle, bool) or not isinstance(handle, int):
            raise InvalidArgument(f"handle must be an int, got {handle!r}")
        if not 0 <= handle < self.capacity_blocks:
            raise InvalidArgument(f"handle {handle} outside [0, {self.capacity_blocks})")
        return self._blocks[handle]

    def _validate_lease(self, lease_s: float) -> None:
        if isinstance(lease_s, bool) or not isinstance(lease_s, int | float):
            raise InvalidArgument(f"lease_s must be a number, got {lease_s!r}")
        if not (0 < lease_s <= self.max_lease_s):
            raise InvalidArgument(f"lease_s must lie in (0, {self.max_lease_s}], got {lease_s}")

    def _validate_allocate(self, params: AllocateParams) -> tuple[BlockKey, ...]:
        tx_id = params.tx_id
        if not isinstance(tx_id, str) or not tx_id:
            raise InvalidArgument("tx_id must be a non-empty string")
        if len(tx_id) > self._max_tx_id_len:
            raise InvalidArgument(f"tx_id longer than {self._max_tx_id_len} characters")
        if not isinstance(params.tenant, str):
            raise InvalidArgument("tenant must be a string")
        if not isinstance(params.mode, TxMode):
            raise InvalidArgument(f"unknown mode {params.mode!r}")
        if not is_key_layout(params.key_layout):
            raise InvalidArgument(
                f"unknown block-key layout {params.key_layout!r}; this agent knows {KEY_LAYOUTS}"
            )
        self._validate_lease(params.lease_s)
        if len(params.keys) > self.capacity_blocks:  # never holdable: before per-key work
            raise CapacityExhausted(len(params.keys), len(self._free) + len(self._lru))
        keys = tuple(params.keys)
        if not keys:
            raise InvalidArgument("keys must not be empty")
        _check_keys(keys)
        if len(set(keys)) != len(keys):
            raise InvalidArgument("keys must not repeat within one tx")
        if params.retain:
            self._validate_retain(params, len(keys))
        return keys

    def _validate_retain(self, params: AllocateParams, n_keys: int) -> None:
        if params.mode is not TxMode.ALLOCATE:
            raise InvalidArgument("only an ALLOCATE tx retains blocks")
        for r in params.retain:
            if not isinstance(r, Retention):
                raise InvalidArgument(f"retain entries must be Retention, got {r!r}")
            if isinstance(r.blocks, bool) or not isinstance(r.blocks, int):
                raise InvalidArgument(f"retain.blocks must be an int, got {r.blocks!r}")
            if not 1 <= r.blocks <= n_keys:
                raise InvalidArgument(f"retain.blocks must lie in [1, {n_keys}], got {r.blocks}")
            ttl = r.ttl_s
            if isinstance(ttl, bool) or not isinstance(ttl, int | float):
                raise InvalidArgument(f"retain.ttl_s must be a number, got {ttl!r}")
            if not 0 < ttl < math.inf:  # longer than this node retains: refused, not invalid
                raise InvalidArgument(f"retain.ttl_s must be finite and > 0, got {ttl}")


def coalesce_events(events: Sequence[BlockEvent]) -> list[BlockEvent]:
    """``events`` with each run of neighbours that say one thing as one event.

    Adjacent ``BlockRemoved`` join; adjacent ``BlockMoved`` to the same medium join; a
    ``BlockStored`` whose parent is the last key of the ``BlockStored`` just before it
    continues that chain and joins it. Nothing is reordered, so applying the result has
    the same effect as applying ``events`` one by one. Why: an engine evicts block by
    block (vLLM sends one ``BlockRemoved`` per evicted block), and every event costs each
    conductor a message and an index update; a 32k-token prompt that evicts 64 blocks
    was 64 events, now one."""
    out: list[BlockEvent] = []
    for ev in events:
        last = out[-1] if out else None
        if isinstance(ev, BlockRemoved) and isinstance(last, BlockRemoved):
            out[-1] = BlockRemoved(last.keys + ev.keys)
        elif (
            isinstance(ev, BlockMoved) and isinstance(last, BlockMoved) and ev.medium is last.medium
        ):
            out[-1] = BlockMoved(last.keys + ev.keys, ev.medium)
        elif (
            isinstance(ev, BlockStored)
            and isinstance(last, BlockStored)
            and last.keys
            and ev.parent_key == last.keys[-1]
        ):
            out[-1] = BlockStored(last.keys + ev.keys, last.parent_key)
        else:
            out.append(ev)
    return out
