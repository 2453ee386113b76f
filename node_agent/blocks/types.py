"""The block table's vocabulary: its errors, the parameters and results of its
transactions, its statistics and the events it emits (``node_agent.blocks.pool`` is the
table itself). Pure data: no I/O, no clock.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvc.block_keys import KEY_LAYOUT, BlockKey

__all__ = [
    "AbortResult",
    "AllBlocksCleared",
    "AllocateParams",
    "AllocateResult",
    "BlockEvent",
    "BlockMoved",
    "BlockPoolError",
    "BlockRemoved",
    "BlockRetained",
    "BlockState",
    "BlockStored",
    "CapacityExhausted",
    "CommitResult",
    "InvalidArgument",
    "KvMedium",
    "PoolStats",
    "Retention",
    "RetentionOutcome",
    "TenantMismatch",
    "TenantQuotaExceeded",
    "TxClosed",
    "TxExpired",
    "TxMode",
    "TxNotFound",
]


# --------------------------------------------------------------------------- errors


class BlockPoolError(Exception):
    """Base of every error the block pool raises (see the module docstring's tree)."""


class InvalidArgument(BlockPoolError):
    """A malformed request: tx_id, tenant, keys, lease, mode or handle."""


class TxNotFound(BlockPoolError):
    """No open tx and no remembered finished tx has this id."""

    def __init__(self, tx_id: str) -> None:
        super().__init__(f"unknown tx {tx_id!r}")
        self.tx_id = tx_id


class TxClosed(BlockPoolError):
    """The tx already finished in a way that forbids this call (e.g. commit after abort)."""

    def __init__(self, tx_id: str, outcome: str) -> None:
        super().__init__(f"tx {tx_id!r} is already {outcome}")
        self.tx_id = tx_id
        self.outcome = outcome


class TxExpired(TxClosed):
    """The tx's lease ran out; the pool aborted it and released its blocks."""

    def __init__(self, tx_id: str) -> None:
        super().__init__(tx_id, "expired")


class CapacityExhausted(BlockPoolError):
    """Not enough obtainable blocks; ``free_blocks`` counts free plus evictable ones."""

    def __init__(self, needed_blocks: int, free_blocks: int) -> None:
        super().__init__(f"need {needed_blocks} new blocks, only {free_blocks} free or evictable")
        self.needed_blocks = needed_blocks
        self.free_blocks = free_blocks


class TenantMismatch(BlockPoolError):
    """A tx named blocks another tenant's request stored or holds: refused, nothing
    locked (keys are salted with the tenant, so a legitimate request never meets
    another tenant's block; one that does is probing or a bug)."""


class TenantQuotaExceeded(BlockPoolError):
    """The tenant's open txs already lock as many blocks as one tenant may."""

    def __init__(self, tenant: str, locked: int, asked: int, limit: int) -> None:
        super().__init__(
            f"tenant {tenant!r} locks {locked} blocks; {asked} more exceed its limit of {limit}"
        )
        self.locked = locked
        self.limit = limit


# ------------------------------------------------------------ parameters and results


class BlockState(enum.Enum):
    FREE = "free"
    ALLOCATED = "allocated"
    CACHED = "cached"


class KvMedium(enum.IntEnum):
    """Where a block's KV lives on its node (values as in the protocol's ``KvMedium``)."""

    DEVICE = 0  # the engine's memory (L1, the pool itself): no load needed
    HOST = 1  # host DRAM (L2)
    DISK = 2  # a local file (L3)


class TxMode(enum.Enum):
    ALLOCATE = "allocate"  # reuse the cached prefix, allocate the rest, lock all
    LOCK_ONLY = "lock_only"  # source side of a copy: lock the cached prefix only


@dataclass(frozen=True, slots=True)
class Retention:
    """Keep the first ``blocks`` keys of a tx out of eviction for ``ttl_s`` seconds after
    their last use (a prompt-cache breakpoint with its TTL)."""

    blocks: int
    ttl_s: float


class RetentionOutcome(enum.Enum):
    """What became of a tx's retention (values as the protocol's ``RetentionStatus``)."""

    NONE = "none"  # none asked
    GRANTED = "granted"
    OVER_BUDGET = "over_budget"  # the tenant's retention budget would be exceeded
    NODE_FULL = "node_full"  # the node retains as many blocks as it may
    TOO_LONG = "too_long"  # a TTL longer than the node retains
    UNSUPPORTED = "unsupported"  # the engine evicts on its own (vLLM): not promised


@dataclass(frozen=True, slots=True)
class AllocateParams:
    tx_id: str
    tenant: str
    keys: Sequence[BlockKey]
    lease_s: float
    mode: TxMode = TxMode.ALLOCATE
    retain: tuple[Retention, ...] = ()  # ALLOCATE only
    key_layout: int = KEY_LAYOUT  # the block-key layout of ``keys`` (kvc/block_keys.py)


@dataclass(frozen=True, slots=True)
class AllocateResult:
    """``handles[i]`` holds ``keys[i]``; LOCK_ONLY returns handles for the locked prefix."""

    tx_id: str
    handles: tuple[int, ...]
    reused_blocks: int  # contiguous CACHED prefix reused (LOCK_ONLY: locked)
    new_blocks: int  # freshly allocated by this tx
    lease_deadline: float  # clock time at which the tx expires
    shared_blocks: int = 0  # in-flight blocks of other open txs joined (content not valid yet)
    promoted_blocks: int = 0  # of reused_blocks, those brought back from host memory or disk
    retention: RetentionOutcome = RetentionOutcome.NONE
    retained_blocks: int = 0  # the leading blocks retained (GRANTED), else 0


@dataclass(frozen=True, slots=True)
class CommitResult:
    tx_id: str
    stored_keys: tuple[BlockKey, ...]  # keys that became CACHED by this commit, in order
    released_blocks: int  # locks released


@dataclass(frozen=True, slots=True)
class AbortResult:
    tx_id: str
    freed_blocks: int  # ALLOCATED blocks returned to the free list
    released_blocks: int  # locks released
    expired: bool  # aborted by lease expiry rather than by a caller


@dataclass(frozen=True, slots=True)
class PoolStats:
    capacity_blocks: int
    free_blocks: int
    cached_blocks: int
    allocated_blocks: int
    locked_blocks: int
    open_txs: int
    evictable_blocks: int  # CACHED, unlocked and not retained
    retained_blocks: int = 0  # kept out of eviction by a retention until its TTL


@dataclass(frozen=True, slots=True)
class BlockStored:
    keys: tuple[BlockKey, ...]  # newly cached, in prefix order
    parent_key: BlockKey | None  # key of the block before keys[0] in its tx, None at root


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    keys: tuple[BlockKey, ...]


@dataclass(frozen=True, slots=True)
class BlockMoved:
    """Keys the node still holds now live in ``medium`` (demoted out of, or promoted
    back into, the engine's memory); keys in no particular order."""

    keys: tuple[BlockKey, ...]
    medium: KvMedium


@dataclass(frozen=True, slots=True)
class BlockRetained:
    """Keys the node keeps out of eviction for ``ttl_s`` more seconds (each hit extends
    it again, unannounced); ``ttl_s == 0``: their retention ended (they are ordinary
    cache again, evictable)."""

    keys: tuple[BlockKey, ...]
    ttl_s: float


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


BlockEvent = BlockStored | BlockRemoved | BlockMoved | BlockRetained | AllBlocksCleared
