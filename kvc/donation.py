"""Donate before evict: which peer takes a node's last copy of a hot block.

A node about to drop a block for good (``BlockPool``'s ``donate``) offers it when the
shadow sees no other copy; the peer that takes it is the one whose own next victim has
sat unused longest (``BlockPool.lru_tail_idle_s``: ``inf`` with a free block), provided
that victim sat unused longer than the offered block did — so a donation only ever
replaces a colder block, and across the fleet the more recently used of the two stays
(a fleet-wide LRU for last copies; N-chance forwarding of cooperative caching, N =
``donate_max_hops``). Ties go to the smallest node id, so a choice is deterministic.

Shared by the simulator (node ids) and the agents (peer addresses, from the
conductors' hints): one rule. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

__all__ = ["choose_donee"]

N = TypeVar("N", bound=str)  # a node: its id (the simulator) or address (the agents)


def choose_donee(idle_s: float, tail_idle_s: Mapping[N, float]) -> N | None:
    """The peer (of ``tail_idle_s``: each one's next victim's idle seconds) that takes a
    block idle for ``idle_s``; None when every peer's victim is more recent."""
    best: N | None = None
    best_idle = idle_s
    for node in sorted(tail_idle_s):
        tail = tail_idle_s[node]
        if tail > best_idle:
            best, best_idle = node, tail
    return best
