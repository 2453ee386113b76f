"""What every part of a running agent shares: settings, engine, pool, metrics, events.

One ``AgentState`` per agent, built by ``NodeAgentService`` and handed to each of its
parts (generation, KV transfer); the checks they all make (draining, role, an open
transaction, a block's content) live here once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from node_agent.blocks.pool import BlockPool
from node_agent.blocks.types import BlockPoolError, BlockState
from node_agent.engines.base import EngineAdapter
from node_agent.errors import Draining, PromptRejected
from node_agent.event_stream import EventPublisher
from node_agent.kv import KvCodec, KvContent, is_kv_content
from node_agent.metrics import AgentMetrics
from node_agent.settings import AgentSettings

__all__ = ["AgentState"]


@dataclass(slots=True)
class AgentState:
    settings: AgentSettings
    engine: EngineAdapter
    pool: BlockPool
    metrics: AgentMetrics
    events: EventPublisher
    clock: Callable[[], float]
    draining: bool = False

    def refuse_if_draining(self) -> None:
        if self.draining:
            raise Draining("this node is draining and takes no new work")

    def require_role(self, *allowed: str) -> None:
        if self.settings.role not in allowed:
            raise PromptRejected(
                f"this node's role is {self.settings.role!r}; needs one of {', '.join(allowed)}"
            )

    async def require_open(self, tx_id: str) -> None:
        """Raise the pool's error (expired, aborted, unknown) unless ``tx_id`` is open."""
        try:
            self.pool.get_tx(tx_id)
        except BlockPoolError:
            await self.events.after_mutation()  # the lookup may have expired leases
            raise

    def content(self, handle: int) -> KvContent | None:
        """The KV a pool block holds (None: not computed here, or a mirrored block)."""
        payload = self.pool.get_payload(handle)
        return payload if is_kv_content(payload) else None

    def needs_content(self, handle: int) -> bool:
        """ALLOCATED without KV yet (a CACHED block's content is never replaced)."""
        return (
            self.pool.block_state(handle) is BlockState.ALLOCATED
            and self.pool.get_payload(handle) is None
        )

    def codec(self) -> KvCodec:
        """The engine's KV codec; an engine without one cannot take KV from a peer."""
        codec = self.engine.kv_codec
        if codec is None:
            raise PromptRejected(
                f"this node's engine ({self.engine.info.engine}) keeps KV in its own "
                "process: it cannot take KV from a peer"
            )
        return codec
