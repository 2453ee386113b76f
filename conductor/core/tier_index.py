"""Which of a node's cached blocks sit in a lower tier (host memory, disk) and what
reusing them costs.

The shadow ``PrefixIndex`` answers "does node n hold key k" whatever the medium: a
block an agent demoted to host memory or disk is still a hit, it just has to be loaded
back first. ``LowerTierIndex`` keeps, beside it, the keys each *tiered* node holds in
L2 (host) and L3 (disk) — two more ``PrefixIndex`` tables fed from the same event
stream (``BlockMoved``, ``BlockRemoved``, snapshots' ``host_keys``/``disk_keys``), so
they share its sequence checks: a node is registered here only when it reports lower
tiers, and every event of such a node is applied to both tables (those that do not
concern them still advance their sequence numbers).

``hits`` gives, per node and prompt, the lower-tier blocks inside the prefix the node
holds (``TierHits``); the placement loop charges them ``bytes / the node's measured
read bandwidth`` (``tier_load_s``) instead of zero — to the node itself when it reuses
them, and to a pull from it (the holder loads them before it sends).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from conductor.core.prefix_index import ApplyOutcome, NodeId, PrefixIndex
from kvc.block_keys import BlockKey

__all__ = [
    "DEFAULT_READ_BYTES_PER_S",
    "LowerTierIndex",
    "Medium",
    "TierHits",
    "apply_node_event",
    "medium_of",
    "reset_node_view",
    "tier_load_s",
]

# Charged when a node reports a tier without a measured bandwidth (it measures at start,
# so only an agent whose measurement failed): PCIe-class host copies, a SATA-class disk.
DEFAULT_READ_BYTES_PER_S: Final = (8e9, 5e8)


class Medium(enum.IntEnum):
    """As the protocol's ``KvMedium``."""

    DEVICE = 0
    HOST = 1
    DISK = 2


@dataclass(frozen=True, slots=True)
class TierHits:
    """A node's lower-tier blocks among the prefix of a prompt it holds."""

    host_blocks: int
    disk_blocks: int


def tier_load_s(
    hits: TierHits | None, block_bytes: int, read_bytes_per_s: tuple[float, float]
) -> float:
    """Seconds to load ``hits`` back onto the device at the node's read bandwidths
    (host, disk); 0 bandwidth: ``DEFAULT_READ_BYTES_PER_S``."""
    if hits is None:
        return 0.0
    host_bw = read_bytes_per_s[0] or DEFAULT_READ_BYTES_PER_S[0]
    disk_bw = read_bytes_per_s[1] or DEFAULT_READ_BYTES_PER_S[1]
    return block_bytes * (hits.host_blocks / host_bw + hits.disk_blocks / disk_bw)


class LowerTierIndex:
    """The host and disk keys of every tiered node (see the module docstring)."""

    __slots__ = ("_disk", "_host")

    def __init__(self, max_keys_per_node: int = 2_000_000) -> None:
        self._host = PrefixIndex(max_keys_per_node)
        self._disk = PrefixIndex(max_keys_per_node)

    @property
    def empty(self) -> bool:
        """No node reports lower tiers: ``hits`` is always empty."""
        return self._host.node_count == 0

    def tracks(self, node: NodeId) -> bool:
        return self._host.position(node) is not None

    def reset_node(
        self,
        node: NodeId,
        epoch: str,
        seq: int,
        host_keys: Iterable[BlockKey],
        disk_keys: Iterable[BlockKey],
    ) -> None:
        self._host.reset_node(node, epoch, seq, host_keys)
        self._disk.reset_node(node, epoch, seq, disk_keys)

    def remove_node(self, node: NodeId) -> None:
        self._host.remove_node(node)
        self._disk.remove_node(node)

    def apply(
        self,
        node: NodeId,
        epoch: str,
        seq: int,
        *,
        stored: Sequence[BlockKey] = (),
        removed: Sequence[BlockKey] = (),
        moved: tuple[Medium, Sequence[BlockKey]] | None = None,
        cleared: bool = False,
    ) -> ApplyOutcome:
        """One event of a tracked node. ``stored`` (newly cached in engine memory) and
        ``removed`` (gone from the node) leave no lower-tier copy; ``moved`` puts keys in
        one medium and takes them out of the other."""
        gone_host: list[BlockKey] = [*stored, *removed]
        gone_disk: list[BlockKey] = list(gone_host)
        into_host: Sequence[BlockKey] = ()
        into_disk: Sequence[BlockKey] = ()
        if moved is not None:
            medium, keys = moved
            if medium is Medium.HOST:
                into_host = keys
                gone_disk.extend(keys)
            elif medium is Medium.DISK:
                into_disk = keys
                gone_host.extend(keys)
            else:
                gone_host.extend(keys)
                gone_disk.extend(keys)
        host = self._host.apply(
            node, epoch, seq, stored=into_host, removed=gone_host, cleared=cleared
        )
        disk = self._disk.apply(
            node, epoch, seq, stored=into_disk, removed=gone_disk, cleared=cleared
        )
        if ApplyOutcome.RESYNC in (host, disk):
            return ApplyOutcome.RESYNC
        return host

    def hits(
        self, keys: Sequence[BlockKey], prefix_blocks: Mapping[NodeId, int]
    ) -> dict[NodeId, TierHits]:
        """Per node with lower-tier blocks in the prefix it holds (``prefix_blocks``)."""
        if self.empty:
            return {}
        host = self._host.held_within(keys, prefix_blocks)
        disk = self._disk.held_within(keys, prefix_blocks)
        return {
            node: TierHits(host.get(node, 0), disk.get(node, 0))
            for node in host.keys() | disk.keys()
        }


def apply_node_event(
    index: PrefixIndex,
    lower: LowerTierIndex | None,
    node: NodeId,
    epoch: str,
    seq: int,
    *,
    stored: Sequence[BlockKey] = (),
    removed: Sequence[BlockKey] = (),
    moved: tuple[Medium, Sequence[BlockKey]] | None = None,
    cleared: bool = False,
) -> ApplyOutcome:
    """One event of a node's stream into the shadow (``index``: what the node holds in
    any tier) and, for a tracked node (``lower`` given), its lower-tier tables. The one
    copy of these rules: the live shadow sync and the simulator both call it."""
    held = moved[1] if moved is not None else stored  # a move keeps the key on the node
    outcome = index.apply(node, epoch, seq, stored=held, removed=removed, cleared=cleared)
    if lower is not None and outcome is ApplyOutcome.APPLIED:
        outcome = lower.apply(
            node, epoch, seq, stored=stored, removed=removed, moved=moved, cleared=cleared
        )
    return outcome


def reset_node_view(
    index: PrefixIndex,
    lower: LowerTierIndex | None,
    node: NodeId,
    epoch: str,
    seq: int,
    *,
    cached: Sequence[BlockKey],
    host: Sequence[BlockKey],
    disk: Sequence[BlockKey],
    tiered: bool,
) -> None:
    """A node's snapshot into the shadow: every key it holds, in any tier, into
    ``index``; its host and disk keys into ``lower`` when it reports tiers (``tiered``),
    else it is no longer tracked there. The one copy of this rule: the live shadow sync
    and the simulator's resync call it."""
    held = [*cached, *host, *disk] if host or disk else cached
    index.reset_node(node, epoch, seq, held)
    if lower is None:
        return
    if tiered:
        lower.reset_node(node, epoch, seq, host, disk)
    else:
        lower.remove_node(node)


def medium_of(value: int) -> Medium | None:
    """The protocol's ``KvMedium`` value as a ``Medium``; None for one this conductor does
    not know (a newer agent): the caller keeps such keys as held, with no tier charge."""
    try:
        return Medium(value)
    except ValueError:
        return None
