"""Replica hints: which of this node's cached blocks another node also holds, as the
conductors' shadow indexes see them (``ReplicaHints``, pushed by conductors to agents
that set ``replica_aware_eviction``).

The pool asks ``count(key)`` of each eviction victim (``BlockPool``'s
``replicas_elsewhere``): a block held elsewhere is dropped rather than demoted, so the
lower tiers keep the fleet's last copies — the rule the simulator evaluates with its
own (instant) shadow (``ClusterConfig.replica_aware_eviction``). Hints lag the fleet by
a push interval plus the event lag; a stale "held elsewhere" costs one recompute or pull
of a block whose other copy went meanwhile, never wrong KV.

A conductor sends the whole set once (``reset``) and then changes; hints meant for
another epoch of this agent (it restarted since) are not applied, and the conductor
sends them whole again. Several conductors push their own (near-identical) views; the
last one wins. Bounded by ``max_keys`` (a conductor can only know of this node's cached
blocks); more is refused.

Donate before evict: a push also carries the *donees* — the other agents that donate,
each with the Unix time its next eviction victim was last used (0: it has a free block)
— replaced whole by every applied push (``donees``).

Complexity: O(keys in the request) per push; O(1) per eviction victim.
"""

from __future__ import annotations

from kvc.block_keys import BlockKey
from kvc.v1 import node_agent_pb2 as pb
from node_agent.blocks.types import InvalidArgument

__all__ = ["ReplicaHintSet"]


class ReplicaHintSet:
    def __init__(self, max_keys: int) -> None:
        self.epoch = ""  # this agent's epoch, set once its event log exists
        self._max_keys = max_keys
        self._keys: set[int] = set()
        # Donate before evict: peer address -> when its next victim was last used (Unix s).
        self.donees: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def count(self, key: BlockKey) -> int:
        """Other nodes known to hold ``key``: 1 when hinted (the pool asks ``> 0``), else 0."""
        return 1 if key in self._keys else 0

    def apply(self, request: pb.ReplicaHintsRequest) -> pb.ReplicaHintsResponse:
        if request.epoch != self.epoch:
            return pb.ReplicaHintsResponse(
                applied=False, epoch=self.epoch, hinted_keys=len(self._keys)
            )
        keys = set() if request.reset else set(self._keys)
        keys.difference_update(request.unreplicated)
        keys.update(request.replicated)
        if len(keys) > self._max_keys:
            raise InvalidArgument(
                f"{len(keys)} replica hints; this node caches at most {self._max_keys} blocks"
            )
        self._keys = keys
        self.donees = {d.address: d.eviction_tail_used_unix_s for d in request.donees}
        return pb.ReplicaHintsResponse(applied=True, epoch=self.epoch, hinted_keys=len(keys))
