"""The agent's event stream: what conductors follow to keep their shadow of this node.

Every pool mutation's events (``BlockPool.take_events()``) are drained into the
``EventLog`` (a per-epoch, monotonically numbered, bounded replay buffer) and woken
``WatchEvents`` subscribers read from there: a subscriber that fell behind the buffer
gets ``resync_required`` and rebuilds from ``Snapshot``. Load updates (queue, running
requests, free and allocatable blocks, the last prefill) are events too, published by
the housekeeping loop when they changed. An engine that owns its KV cache (vLLM)
reports its changes through ``apply_engine_cache_events``: mirrored into the pool,
then published like any other mutation.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Final

from kvc.v1 import node_agent_pb2 as pb
from node_agent.blocks.events import EventLog
from node_agent.blocks.pool import BlockPool
from node_agent.blocks.tiers import LowerTiers, TierStats
from node_agent.blocks.types import (
    AllBlocksCleared,
    BlockMoved,
    BlockRemoved,
    BlockRetained,
    BlockStored,
    KvMedium,
)
from node_agent.engines.base import CacheCleared, CacheStored, EngineAdapter, EngineCacheEvent
from node_agent.metrics import AgentMetrics

__all__ = ["EventPublisher", "LastPrefill"]

_WATCH_POLL_S = 5.0  # a subscriber re-checks for shutdown at least this often


@dataclass(frozen=True, slots=True)
class LastPrefill:
    """The most recent prefill this agent ran (reported in every load update)."""

    seconds: float = 0.0
    computed_tokens: int = 0
    cached_tokens: int = 0


class EventPublisher:
    """Owns the event log of one agent epoch and wakes its ``WatchEvents`` streams."""

    def __init__(
        self,
        pool: BlockPool,
        engine: EngineAdapter,
        metrics: AgentMetrics,
        *,
        max_buffered: int,
    ) -> None:
        self._pool = pool
        self._engine = engine
        self._metrics = metrics
        self.epoch = uuid.uuid4().hex
        self._log: EventLog[pb.Event] = EventLog(epoch=self.epoch, max_buffered=max_buffered)
        # One future per waiting ``WatchEvents`` stream, woken by ``notify`` (no task
        # per wait, as ``wait_for`` on a condition would make: two per request).
        self._waiters: set[asyncio.Future[None]] = set()
        self._last_load: pb.LoadUpdate | None = None
        self._closed = False
        self.last_prefill = LastPrefill()
        # The engine's own host tier (vLLM's CPU offloading), when mirrored.
        self.engine_host_tier: EngineHostTier | None = None
        # Donate before evict: when the next eviction victim was last used (Unix s).
        self.eviction_tail: Callable[[], float] | None = None

    @property
    def last_seq(self) -> int:
        return self._log.last_seq

    # ------------------------------------------------------------------ publishing
    def _append(self, event: pb.Event, time_s: float | None = None) -> None:
        event.time_s = time.time() if time_s is None else time_s
        event.seq = self._log.append(event)
        self._metrics.record_event(event.WhichOneof("kind"))

    def publish_pool_events(self, origin_time_s: float | None = None) -> None:
        """Append what the pool changed since the last call (not yet waking anyone),
        stamped ``origin_time_s`` (when the engine reported the change) or now."""
        for ev in self._pool.take_events():
            if isinstance(ev, BlockStored):
                stored = pb.BlockStored(block_keys=list(ev.keys))
                if ev.parent_key is not None:
                    stored.parent_key = ev.parent_key
                    stored.has_parent = True
                self._append(pb.Event(stored=stored), origin_time_s)
            elif isinstance(ev, BlockRemoved):
                self._append(
                    pb.Event(removed=pb.BlockRemoved(block_keys=list(ev.keys))), origin_time_s
                )
            elif isinstance(ev, BlockMoved):
                moved = pb.BlockMoved(block_keys=list(ev.keys), medium=MEDIUM_TO_PB[ev.medium])
                self._append(pb.Event(moved=moved), origin_time_s)
            elif isinstance(ev, BlockRetained):
                retained = pb.BlockRetained(block_keys=list(ev.keys), ttl_s=ev.ttl_s)
                self._append(pb.Event(retained=retained), origin_time_s)
            elif isinstance(ev, AllBlocksCleared):
                self._append(pb.Event(cleared=pb.AllBlocksCleared()), origin_time_s)

    def publish_load(self) -> None:
        """Append a load update when it differs from the last one published."""
        load = self.load_update()
        if load != self._last_load:
            self._append(pb.Event(load=load))
            self._last_load = load

    async def notify(self) -> None:
        """Wake every ``WatchEvents`` stream."""
        waiters, self._waiters = self._waiters, set()
        for waiter in waiters:
            _wake(waiter)

    async def after_mutation(self) -> None:
        """Publish the pool's events and wake the subscribers: after every pool change."""
        self.publish_pool_events()
        await self.notify()

    async def apply_engine_cache_events(self, events: Sequence[EngineCacheEvent]) -> None:
        """Mirror an engine-owned KV cache (vLLM's KV events) into the pool; publish it,
        stamped with the engine's time (the earliest in the batch) when it gave one, so a
        conductor's ``conductor_shadow_event_lag_seconds`` runs from the engine's event."""
        for ev in events:
            if isinstance(ev, CacheStored):
                if ev.host:
                    self._pool.mirror_host_stored(ev.keys)
                else:
                    self._pool.mirror_stored(ev.keys, ev.parent_key)
            elif isinstance(ev, CacheCleared):
                self._pool.mirror_clear()
            elif ev.host:
                self._pool.mirror_host_removed(ev.keys)
            else:
                self._pool.mirror_removed(ev.keys)
        origins = [ev.engine_time_s for ev in events if ev.engine_time_s is not None]
        self.publish_pool_events(min(origins, default=None))
        await self.notify()

    async def close(self) -> None:
        """End every ``WatchEvents`` stream (at their next wake-up: now)."""
        self._closed = True
        await self.notify()

    # ------------------------------------------------------------------ load
    def allocatable_blocks(self) -> int:
        """Blocks an allocation could obtain now: free plus evictable (cached, unlocked).

        An engine that owns its cache (vLLM) and reports its KV usage bounds it too:
        its usage counts the blocks its running requests hold, which the mirror only
        learns of once they are cached. (vLLM counts its evictable cached blocks as
        free, so a warm but idle vLLM reports ~0 usage and does not lower this.)
        """
        stats = self._pool.stats()
        obtainable = stats.free_blocks + stats.evictable_blocks
        usage = self._engine.load().kv_usage_ratio
        if usage > 0.0:
            engine_free = math.floor((1.0 - min(usage, 1.0)) * stats.capacity_blocks)
            obtainable = min(obtainable, max(engine_free, stats.free_blocks))
        return obtainable

    def load_update(self) -> pb.LoadUpdate:
        load = self._engine.load()
        stats = self._pool.stats()
        last = self.last_prefill
        return pb.LoadUpdate(
            queued_prefill_tokens=load.queued_prefill_tokens,
            running_requests=load.running_requests,
            waiting_requests=load.waiting_requests,
            free_blocks=stats.free_blocks,
            allocatable_blocks=self.allocatable_blocks(),
            kv_usage_ratio=max(
                1.0 - stats.free_blocks / stats.capacity_blocks, load.kv_usage_ratio
            ),
            last_prefill_s=last.seconds,
            last_prefill_tokens=last.computed_tokens,
            last_prefill_cached_tokens=last.cached_tokens,
            tiers=self.tiers(digits=2),
            eviction_tail_used_unix_s=(0.0 if self.eviction_tail is None else self.eviction_tail()),
        )

    def engine_tier_stats(self) -> list[TierStats]:
        """The engine's own host tier (vLLM's CPU offloading), as the agent sees it."""
        engine = self.engine_host_tier
        if engine is None:
            return []
        blocks = self._pool.engine_host_blocks
        return [
            TierStats(
                medium=KvMedium.HOST,
                capacity_bytes=engine.capacity_bytes,
                used_bytes=blocks * engine.block_bytes,
                blocks=blocks,
                read_bytes_per_s=engine.read_bytes_per_s,
                write_bytes_per_s=0.0,
            )
        ]

    def tiers(self, digits: int | None = None) -> list[pb.KvTier]:
        """The node's lower tiers: the agent's own, or the engine's host tier."""
        out = tiers_to_pb(self._pool.lower, digits)
        engine = self.engine_host_tier
        if engine is not None:
            out.append(
                pb.KvTier(
                    medium=pb.KV_MEDIUM_HOST,
                    capacity_bytes=engine.capacity_bytes,
                    used_bytes=self._pool.engine_host_blocks * engine.block_bytes,
                    read_bytes_per_s=engine.read_bytes_per_s,
                )
            )
        return out

    # ------------------------------------------------------------------ reading
    def snapshot(self, node: pb.NodeInfo) -> pb.SnapshotResponse:
        """The full state a conductor (re)builds its shadow from, at ``last_seq``."""
        self._pool.expire_leases()
        self.publish_pool_events()
        retained = self._pool.retained_keys()
        return pb.SnapshotResponse(
            node=node,
            epoch=self.epoch,
            seq=self._log.last_seq,
            cached_keys=list(self._pool.cached_keys()),
            load=self.load_update(),
            host_keys=self._pool.tier_keys(KvMedium.HOST),
            disk_keys=self._pool.tier_keys(KvMedium.DISK),
            retained_keys=[k for k, _ in retained],
            retained_ttl_s=[round(left, 3) for _, left in retained],
        )

    async def watch(self, epoch: str, from_seq: int) -> AsyncIterator[pb.EventBatch]:
        """Batches from ``from_seq`` on, as they are published, until the agent stops.

        Another epoch, or a ``from_seq`` the buffer no longer holds, gets one batch with
        ``resync_required`` and the stream ends.
        """
        if epoch and epoch != self.epoch:
            yield pb.EventBatch(epoch=self.epoch, resync_required=True)
            return
        next_seq = max(1, from_seq)
        self._metrics.watch_subscribers.inc()
        try:
            while not self._closed:
                batch = self._log.since(next_seq)
                if batch is None:
                    yield pb.EventBatch(epoch=self.epoch, resync_required=True)
                    return
                if batch:
                    next_seq = batch[-1][0] + 1
                    yield pb.EventBatch(epoch=self.epoch, events=[ev for _, ev in batch])
                    continue
                # Nothing new: wait for ``notify`` (registered before any await, so
                # no publication can slip between the check above and the wait).
                loop = asyncio.get_running_loop()
                waiter = loop.create_future()
                self._waiters.add(waiter)
                timer = loop.call_later(_WATCH_POLL_S, _wake, waiter)
                try:
                    await waiter
                finally:
                    timer.cancel()
                    self._waiters.discard(waiter)
        finally:
            self._metrics.watch_subscribers.dec()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


@dataclass(frozen=True, slots=True)
class EngineHostTier:
    """An engine's own host-memory KV tier (vLLM's CPU offloading), as configured."""

    capacity_bytes: int
    block_bytes: int
    read_bytes_per_s: float  # 0: not known (conductors charge their default)


MEDIUM_TO_PB: Final[dict[KvMedium, pb.KvMedium.ValueType]] = {
    KvMedium.DEVICE: pb.KV_MEDIUM_DEVICE,
    KvMedium.HOST: pb.KV_MEDIUM_HOST,
    KvMedium.DISK: pb.KV_MEDIUM_DISK,
}


def tiers_to_pb(lower: LowerTiers | None, digits: int | None = None) -> list[pb.KvTier]:
    """The enabled lower tiers as ``KvTier`` messages; ``digits``: round the bandwidths
    to that many significant digits (load updates, so a moving mean is not news)."""
    if lower is None:
        return []

    def rate(value: float) -> float:
        return value if digits is None or value <= 0 else float(f"{value:.{digits}g}")

    return [
        pb.KvTier(
            medium=MEDIUM_TO_PB[t.medium],
            capacity_bytes=t.capacity_bytes,
            used_bytes=t.used_bytes,
            read_bytes_per_s=rate(t.read_bytes_per_s),
            write_bytes_per_s=rate(t.write_bytes_per_s),
        )
        for t in lower.stats()
        if t.capacity_bytes > 0
    ]
