"""Builders shared by the scheduler and simulator-policy tests."""

from __future__ import annotations

from dataclasses import replace

from conductor.core.prefix_index import NodeId
from conductor.core.scheduler import NodeState


def make_node(
    name: str, role: str = "prefill", *, block_size: int, kv_bytes_per_token: int, **kw: object
) -> NodeState:
    """A healthy node with 10,000 free blocks; ``kw`` overrides any field."""
    base = NodeState(
        node_id=NodeId(name),
        role=role,  # type: ignore[arg-type]
        healthy=True,
        block_size=block_size,
        capacity_blocks=10_000,
        free_blocks=10_000,
        kv_bytes_per_token=kv_bytes_per_token,
    )
    return replace(base, **kw)  # type: ignore[arg-type]
