"""Donate before evict between agents (``donate_before_evict``; evaluated in the
simulator, docs/benchmarks.md "Donate before evict": it does not pay there, so it is off
unless asked for).

Giving
    The pool hands over each hot victim that leaves the node for good (``BlockPool``'s
    ``donate``; hot: reused ``donate_min_hits`` times, donated fewer than
    ``donate_max_hops`` times). ``offer`` keeps it only when the conductors' replica
    hints do not see it on another node (the fleet's last copy) and some donee — the
    other donating agents the hints list, each with when its next eviction victim was
    last used — has a victim colder than it (``kvc.donation.choose_donee``,
    as the simulator chooses). Its bytes are copied off the device at once (the block's
    memory is reused as soon as the pool returns) and queued (at most ``max_pending``;
    beyond that, dropped); ``run`` sends each to its donees, coldest first, until one
    accepts (``DonateBlock``). A block larger than one gRPC message is not offered.

Taking
    ``take`` answers a peer's ``DonateBlock``: the layout must be this node's and the
    checksum must match; the pool's ``accept_donation`` then decides (the parent must
    be held here, and the victim it would replace must be colder).

Reported
    ``eviction_tail_used_unix_s`` (the ``LoadUpdate`` field conductors pass on as
    donees' tails): whole seconds, so an update is new only when the victim changes;
    0 while the pool has a free block.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import zlib
from collections.abc import Callable
from typing import Final

import grpc

from kvc.block_keys import BlockKey
from kvc.donation import choose_donee
from kvc.tls import PlaintextPolicy, TlsFiles
from kvc.v1 import node_agent_pb2 as pb
from kvc.wire import MAX_MESSAGE_BYTES
from node_agent.blocks.pool import BlockPool, Donation
from node_agent.errors import TransferError
from node_agent.kv import KvCodec, KvLayout
from node_agent.metrics import AgentMetrics
from node_agent.replica_hints import ReplicaHintSet
from node_agent.transfer.transport import GrpcKvTransport, layout_to_pb

__all__ = ["Donations"]

log = logging.getLogger("node_agent.donation")

_HEADROOM_BYTES: Final = 64 * 1024  # a request's fields beside its data
_RPC_TIMEOUT_S: Final = 10.0


class Donations:
    def __init__(
        self,
        pool: BlockPool,
        hints: ReplicaHintSet,
        codec: KvCodec,
        layout: KvLayout,
        metrics: AgentMetrics,
        *,
        tls: TlsFiles | None = None,
        plaintext: PlaintextPolicy = "loopback",
        max_pending: int = 64,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._pool = pool
        self._hints = hints
        self._codec = codec
        self._layout = layout
        self._metrics = metrics
        self._transport = GrpcKvTransport(tls, plaintext)  # its own channels to the donees
        self._wall = wall
        self._queue: asyncio.Queue[tuple[pb.DonateBlockRequest, list[str]]] = asyncio.Queue(
            max_pending
        )

    # ------------------------------------------------------------------ giving
    def offer(self, donation: Donation) -> bool:
        """The pool's hook: queue ``donation`` for a peer when it is the fleet's last copy
        and some donee's victim is colder; True when queued."""
        if self._hints.count(donation.key) > 0:
            return False  # another node holds it: nothing is lost
        donees = self._donees(donation.idle_s)
        if not donees:
            return False
        data = donation.content.to_bytes()
        if len(data) + _HEADROOM_BYTES > MAX_MESSAGE_BYTES:
            self._given("dropped")
            return False
        request = pb.DonateBlockRequest(
            key=donation.key,
            has_parent=donation.parent is not None,
            parent_key=donation.parent or 0,
            tenant=donation.tenant or "",
            idle_s=donation.idle_s,
            hops=donation.hops,
            layout=layout_to_pb(donation.content.layout),
            num_tokens=donation.content.num_tokens,
            data=data,
            crc32=zlib.crc32(data),
        )
        try:
            self._queue.put_nowait((request, donees))
        except asyncio.QueueFull:
            self._given("dropped")
            return False
        return True

    def _donees(self, idle_s: float) -> list[str]:
        """The donees whose victim is colder than a block idle ``idle_s``, coldest first."""
        now = self._wall()
        tails = {
            address: (math.inf if used <= 0 else max(0.0, now - used))
            for address, used in self._hints.donees.items()
        }
        out: list[str] = []
        while (address := choose_donee(idle_s, tails)) is not None:
            out.append(address)
            del tails[address]
        return out

    async def run(self) -> None:
        """Send queued donations until cancelled."""
        while True:
            request, donees = await self._queue.get()
            try:
                await self._send(request, donees)
            except Exception:  # one bad donation must not stop the ones after it
                log.exception("donating block %#x failed", request.key)
                self._given("failed")

    async def _send(self, request: pb.DonateBlockRequest, donees: list[str]) -> None:
        failed = False
        for address in donees:
            try:
                stub = self._transport.stub(address)
                answer = await stub.DonateBlock(request, timeout=_RPC_TIMEOUT_S)
            except (grpc.aio.AioRpcError, TransferError) as exc:
                log.warning("donating block %#x to %s failed: %s", request.key, address, exc)
                failed = True
                continue
            if answer.accepted:
                self._given("accepted")
                return
            log.debug("%s refused block %#x: %s", address, request.key, answer.reason)
        self._given("failed" if failed else "refused")

    def _given(self, outcome: str) -> None:
        self._metrics.donations.labels("given", outcome).inc()

    async def aclose(self) -> None:
        await self._transport.aclose()

    # ------------------------------------------------------------------ taking
    def take(self, request: pb.DonateBlockRequest) -> pb.DonateBlockResponse:
        """A peer's ``DonateBlock``: verified, then the pool decides."""
        own, lay = self._layout, request.layout
        if (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype) != (
            own.num_layers, own.num_kv_heads, own.head_dim, own.dtype,
        ):  # fmt: skip
            return self._refused("the block's KV layout differs from this node's model")
        if len(request.data) != request.num_tokens * own.bytes_per_token or not request.num_tokens:
            return self._refused("the block's size does not match its tokens")
        if zlib.crc32(request.data) != request.crc32:
            return self._refused("the block failed its checksum")
        if not (math.isfinite(request.idle_s) and request.idle_s >= 0):
            return self._refused("idle_s must be a finite number of seconds >= 0")
        content = self._codec.from_bytes(own, request.data, request.num_tokens)
        donation = Donation(
            key=BlockKey(request.key),
            parent=BlockKey(request.parent_key) if request.has_parent else None,
            tenant=request.tenant or None,
            content=content,
            idle_s=request.idle_s,
            hits=0,
            hops=request.hops,
        )
        if not self._pool.accept_donation(donation):
            return self._refused("held here, its parent is not, or no colder block to replace")
        self._metrics.donations.labels("taken", "accepted").inc()
        return pb.DonateBlockResponse(accepted=True)

    def _refused(self, reason: str) -> pb.DonateBlockResponse:
        self._metrics.donations.labels("taken", "refused").inc()
        return pb.DonateBlockResponse(accepted=False, reason=reason)

    # ------------------------------------------------------------------ reported
    def eviction_tail_used_unix_s(self) -> float:
        idle = self._pool.lru_tail_idle_s()
        return 0.0 if math.isinf(idle) else float(round(self._wall() - idle))
