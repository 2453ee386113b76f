"""Keeps the conductor's shadow ``PrefixIndex`` in step with every agent's block table.

Per agent, one supervised task: ``Snapshot`` → ``reset_node`` → ``WatchEvents`` from the
snapshot's sequence number + 1, applying each event. A ``resync_required`` batch, a
sequence gap, a new epoch (the agent restarted) or a broken stream leads back to a
snapshot; when the agent is unreachable, after a backoff (tenacity) of 0.1, 0.2, 0.4 … s
up to 5 s, equal jitter (half of each wait fixed, half random). The shadow may
be stale, never authoritative: agents re-check keys on every Tx, so staleness costs a
recompute, not a wrong answer. Load updates in the stream refresh the agent's load.
``Snapshot`` and ``WatchEvents`` go over the agent's token stream when it serves them
there (``NodeInfo.stream_methods``: a frame per batch instead of a gRPC message, ~6×
less CPU), else over gRPC; both fail the same way, so the session's retries hold. A
session whose snapshot finds the listener gone (``UNAVAILABLE``) runs over gRPC. A
session on gRPC while the stream can serve it — begun before the agent's info named its
stream, or fallen back while the listener was away and answered over it again since (a
``GetInfo`` poll) — ends after its next batch, and the next session resyncs over the
stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import cast

import grpc
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    wait_exponential,
    wait_random_exponential,
)

from conductor.adapters.agents import AgentFleet, AgentHandle, StreamingCall
from conductor.core.prefix_index import ApplyOutcome, NodeId, PrefixIndex
from conductor.core.tier_index import (
    LowerTierIndex,
    Medium,
    apply_node_event,
    medium_of,
    reset_node_view,
)
from kvc.block_keys import BlockKey
from kvc.v1 import node_agent_pb2 as pb


def _as_block_keys(field: Sequence[int]) -> Sequence[BlockKey]:
    """A repeated ``fixed64`` field as block keys, without copying (``BlockKey`` is an int)."""
    return cast("Sequence[BlockKey]", field)


log = logging.getLogger("conductor.shadow")

LagObserver = Callable[[float], None]

_BACKOFF_FIRST_S = 0.1
_BACKOFF_MAX_S = 5.0
_RECONCILE_S = 0.5  # how soon a follower starts for an agent that joined the fleet


async def _sleep_unless_stopped(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)


class ShadowSync:
    def __init__(
        self,
        fleet: AgentFleet,
        index: PrefixIndex,
        *,
        on_lag: LagObserver | None = None,
        lower: LowerTierIndex | None = None,
    ) -> None:
        self._fleet = fleet
        self._index = index
        self._lower = lower if lower is not None else LowerTierIndex(index.max_keys_per_node)
        self._on_lag = on_lag

    async def run(self, stop: asyncio.Event) -> None:
        """Follow every agent in the fleet; start and stop followers as it changes."""
        followers: dict[str, asyncio.Task[None]] = {}
        try:
            while not stop.is_set():
                current = {a.address: a for a in self._fleet.handles()}
                for address in set(followers) - set(current):
                    followers.pop(address).cancel()
                    self._index.remove_node(NodeId(address))
                    self._lower.remove_node(NodeId(address))
                for address, agent in current.items():
                    if address not in followers or followers[address].done():
                        followers[address] = asyncio.create_task(self._follow(agent, stop))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=_RECONCILE_S)
        finally:
            for task in followers.values():
                task.cancel()
            for task in followers.values():
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _follow(self, agent: AgentHandle, stop: asyncio.Event) -> None:
        """Sync sessions until ``stop``. A failed one drops the node from the index and is
        retried after the backoff (interrupted by ``stop``); one that ended cleanly (a
        resync) starts the next at once and resets the backoff."""
        node = NodeId(agent.address)
        half_max_s = _BACKOFF_MAX_S / 2
        while not stop.is_set():
            retrying = AsyncRetrying(
                retry=retry_if_exception_type(grpc.aio.AioRpcError),
                # Equal jitter: min(max, 0.1 s × 2^n) × uniform(0.5, 1).
                wait=wait_exponential(multiplier=_BACKOFF_FIRST_S / 2, max=half_max_s)
                + wait_random_exponential(multiplier=_BACKOFF_FIRST_S / 2, max=half_max_s),
                stop=lambda _: stop.is_set(),
                sleep=functools.partial(_sleep_unless_stopped, stop),
                after=functools.partial(self._lost, agent, node),
                retry_error_callback=lambda _: None,  # stopped while failing: end quietly
            )
            async for attempt in retrying:
                with attempt:
                    await self._sync_once(agent, node, stop)

    def _lost(self, agent: AgentHandle, node: NodeId, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, grpc.aio.AioRpcError) and exc.code() != grpc.StatusCode.CANCELLED:
            log.debug("shadow of %s: %s", agent.address, exc.details())
        self._index.remove_node(node)
        self._lower.remove_node(node)

    async def _snapshot(self, agent: AgentHandle) -> tuple[pb.SnapshotResponse, bool]:
        """The agent's snapshot, and whether it came over the token stream."""
        timeout = self._fleet.rpc_timeout_s
        snap = await self._fleet.stream_unary(
            agent, "Snapshot", pb.SnapshotRequest(), pb.SnapshotResponse.FromString,
            deadline_s=timeout, fall_back=True,
        )  # fmt: skip
        if snap is not None:
            return snap, True
        return await agent.stub.Snapshot(pb.SnapshotRequest(), timeout=timeout), False

    async def _sync_once(self, agent: AgentHandle, node: NodeId, stop: asyncio.Event) -> None:
        began_s = time.monotonic()
        offered = agent.stream_for("WatchEvents") is not None
        snap, framed = await self._snapshot(agent)
        fell_back = offered and not framed  # the listener was gone
        # The repeated fixed64 fields go straight in (the index copies them into arrays).
        reset_node_view(
            self._index, self._lower, node, snap.epoch, snap.seq,
            cached=_as_block_keys(snap.cached_keys), host=_as_block_keys(snap.host_keys),
            disk=_as_block_keys(snap.disk_keys), tiered=bool(snap.node.tiers),
        )  # fmt: skip
        agent.set_load(snap.load)
        agent.retained = set(snap.retained_keys)
        request = pb.WatchEventsRequest(epoch=snap.epoch, from_seq=snap.seq + 1)
        stream = agent.stream_for("WatchEvents") if framed else None
        call: StreamingCall = (
            agent.stub.WatchEvents(request)
            if stream is None
            else stream.stream("WatchEvents", request, pb.EventBatch.FromString)
        )
        # ``stop`` cancels the call, which ends the read below: no task per batch
        # (racing each read against ``stop`` made one for every batch).
        stopper = asyncio.create_task(stop.wait())
        stopper.add_done_callback(lambda _: call.cancel())
        this = asyncio.current_task()
        try:
            while True:
                try:
                    batch = await call.read()
                except (asyncio.CancelledError, grpc.aio.AioRpcError):
                    if stop.is_set() and not (this is not None and this.cancelling()):
                        return  # stopped: the call was cancelled for it
                    raise
                if batch is grpc.aio.EOF:
                    return
                assert isinstance(batch, pb.EventBatch)
                if batch.resync_required or not self._apply(agent, node, batch):
                    log.info("shadow of %s: resync", agent.address)
                    return
                if (
                    not offered or (fell_back and agent.stream_answered_s > began_s)
                ) and agent.stream_for("WatchEvents") is not None:
                    # Over gRPC while the stream can serve it: begun before the agent's
                    # info named its stream (the agent was not up yet), or fallen back
                    # while its listener was gone and answering again since (the GetInfo
                    # poll goes over the stream first). The next session follows over it.
                    log.debug("shadow of %s: moving to the token stream", agent.address)
                    return
        finally:
            stopper.cancel()
            call.cancel()

    def _apply(self, agent: AgentHandle, node: NodeId, batch: pb.EventBatch) -> bool:
        now = time.time()
        lower = self._lower if self._lower.tracks(node) else None
        for ev in batch.events:
            kind = ev.WhichOneof("kind")
            epoch, seq = batch.epoch, ev.seq
            stored: Sequence[BlockKey] = ()
            removed: Sequence[BlockKey] = ()
            moved: tuple[Medium, Sequence[BlockKey]] | None = None
            cleared = False
            if kind == "stored":
                stored = _as_block_keys(ev.stored.block_keys)
            elif kind == "removed":
                removed = _as_block_keys(ev.removed.block_keys)
                if agent.retained:
                    agent.retained.difference_update(removed)
            elif kind == "moved":  # still held, in another tier
                keys = _as_block_keys(ev.moved.block_keys)
                medium = medium_of(ev.moved.medium)
                if medium is None:  # a medium this conductor does not know: held, no charge
                    stored = keys
                else:
                    moved = (medium, keys)
            elif kind == "cleared":
                cleared = True
                agent.retained.clear()
            elif kind == "retained":  # held as before; retention is shown, not scheduled
                if ev.retained.ttl_s > 0:
                    agent.retained.update(ev.retained.block_keys)
                else:
                    agent.retained.difference_update(ev.retained.block_keys)
            elif kind == "load":
                agent.set_load(ev.load)
            outcome = apply_node_event(
                self._index, lower, node, epoch, seq,
                stored=stored, removed=removed, moved=moved, cleared=cleared,
            )  # fmt: skip
            if outcome is ApplyOutcome.RESYNC:
                return False
            if self._on_lag is not None and ev.time_s:
                self._on_lag(max(0.0, now - ev.time_s))
        return True
