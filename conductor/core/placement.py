"""Placement of one request on a (prefill, decode) pair — the walking-skeleton policy.

Given the nodes this conductor can reach, pick the least-busy prefill-capable node
and the least-busy decode-capable node (ties broken round-robin by a counter the
caller owns, so the function stays pure). A dedicated prefill node is preferred
over a "both" node for prefill, and likewise for decode, so a P/D fleet runs
disaggregated. Candidates come back ordered, so the caller can fall through to the
next one when a node refuses (capacity) or fails.

Complexity O(n log n) in nodes. The KV-centric scheduler (Mooncake Algorithm 1)
replaces this ordering with predicted TTFT/TBT; the interface stays the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Role = Literal["prefill", "decode", "both"]


@dataclass(frozen=True, slots=True)
class NodeView:
    node_id: str
    role: Role
    healthy: bool
    inflight: int  # this conductor's requests currently on the node


@dataclass(frozen=True, slots=True)
class PlacementCandidates:
    prefill: tuple[str, ...]  # ordered best first
    decode: tuple[str, ...]


def _order(nodes: Sequence[NodeView], dedicated: Role, tick: int) -> tuple[str, ...]:
    eligible = [n for n in nodes if n.healthy and n.role in (dedicated, "both")]
    n = max(len(eligible), 1)
    ranked = sorted(
        enumerate(eligible),
        key=lambda item: (
            item[1].role != dedicated,
            item[1].inflight,
            (item[0] - tick) % n,
        ),
    )
    return tuple(node.node_id for _, node in ranked)


def rank_candidates(nodes: Sequence[NodeView], tick: int) -> PlacementCandidates:
    """Order prefill and decode candidates: dedicated role first, then least in flight."""
    return PlacementCandidates(
        prefill=_order(nodes, "prefill", tick),
        decode=_order(nodes, "decode", tick),
    )
