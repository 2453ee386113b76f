"""Node agent gRPC server: the block table's owner and the engine's front door.

State changes happen here and only here (Mooncake §5.3). ``NodeAgentService`` is the
thin gRPC face: each RPC delegates to the part that does the work, and one decorator
(``node_agent.rpc_errors.maps_errors``) turns the agent's exceptions into status codes.

==================================  ==============================================
part                                RPCs
==================================  ==============================================
``BlockPool`` (node_agent.blocks)   TxAllocate, TxCommit, TxAbort
``EventPublisher`` (event_stream)   Snapshot, WatchEvents; load updates
``Generation`` (generation)         Prefill, Generate
``KvSender`` (transfer.sender)      FetchKv, ReadBlocks
``KvReceiver`` (transfer.receiver)  PullBlocks; the hand-off pulled by Generate
this module                         GetInfo, Drain
==================================  ==============================================

KV moves between agents through a ``KvTransport`` (``node_agent.transfer.transport``;
gRPC by default, tests pass one that fails). Hot-spot replication (Mooncake §4.2)
reuses the hand-off path: the destination's ``PullBlocks`` calls the source's
``ReadBlocks`` for blocks both hold under open Txs (the source's is LOCK_ONLY).

``AgentServer`` is the lifecycle: it binds the port, runs start-up calibration
(``node_agent/calibration.py``, bounded by ``calibration_budget_s``) after binding and
before serving, so it never competes with real requests and ``GetInfo`` reports the
fit from the first call on; then it serves, registers in Redis, runs the housekeeping
loop (lease expiry, staged-KV expiry, load updates) and the ``/metrics`` server, and
drains and stops them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from redis.asyncio import Redis

from kvc.block_keys import KEY_LAYOUT, BlockKey
from kvc.registry import AgentRecord, connect, keep_registered
from kvc.tls import certificate_node, check_plaintext
from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from kvc.version import package_version
from kvc.wire import MAX_MESSAGE_BYTES, ROLE_TO_PB, SERVICE_NAME
from node_agent.agent_state import AgentState
from node_agent.auth import Caller, authorized
from node_agent.blocks.pool import BlockPool, Donation
from node_agent.blocks.tiers import LowerTiers
from node_agent.blocks.types import (
    AllocateParams,
    AllocateResult,
    BlockPoolError,
    InvalidArgument,
    Retention,
    RetentionOutcome,
    TxMode,
)
from node_agent.calibration import Calibration, CalibrationPlan, calibrate_before_serving
from node_agent.donation import Donations
from node_agent.engines.base import CacheMirroringEngine, EngineAdapter, PrefixLendingEngine
from node_agent.errors import Draining, PromptRejected
from node_agent.event_stream import EngineHostTier, EventPublisher
from node_agent.generation import Generation
from node_agent.metrics import AgentMetrics, MetricsServer
from node_agent.replica_hints import ReplicaHintSet
from node_agent.rpc_errors import AGENT_ERRORS, Context, maps_errors
from node_agent.settings import AgentSettings
from node_agent.tier_runner import ThreadRunner, prefetch
from node_agent.token_stream import StreamMethod, TokenStreamServer
from node_agent.transfer.receiver import KvReceiver
from node_agent.transfer.sender import KvSender
from node_agent.transfer.shm import remove_orphans
from node_agent.transfer.staging import ReadGrants, StagingArea
from node_agent.transfer.transport import GrpcKvTransport, KvTransport, layout_to_pb

__all__ = ["AgentServer", "NodeAgentService"]

log = logging.getLogger("node_agent")

T = TypeVar("T")


def calibration_to_pb(cal: Calibration) -> pb.EngineCalibration:
    return pb.EngineCalibration(
        prefill_fixed_s=cal.prefill.fixed_s,
        prefill_per_token_s=cal.prefill.per_token_s,
        prefill_per_token_context_s=cal.prefill.per_token_context_s,
        decode_fixed_s=cal.decode.fixed_s,
        decode_per_request_s=cal.decode.per_request_s,
        decode_per_context_token_s=cal.decode.per_context_token_s,
        prefill_samples=cal.prefill_samples,
        decode_samples=cal.decode_samples,
        duration_s=cal.duration_s,
    )


def _moves_prefixes(engine: EngineAdapter) -> bool:
    """Pool payloads through ReadBlocks (a KV codec), or the engine's own connector."""
    if isinstance(engine, PrefixLendingEngine):
        return engine.lends_prefixes
    return engine.kv_codec is not None


def _lend_wait(settings: AgentSettings, engine: EngineAdapter) -> pb.LendWait.ValueType:
    """What a prefix this node lends waits for (``NodeInfo.lend_wait``): nothing for
    pool payloads; a request to the engine otherwise, ahead of the waiting ones when
    the legs carry a priority below 0 (vLLM's priority scheduling)."""
    if not isinstance(engine, PrefixLendingEngine) or not engine.lends_prefixes:
        return pb.LEND_WAIT_NONE
    if settings.vllm_prefix_pull_priority < 0:
        return pb.LEND_WAIT_RUNNING
    return pb.LEND_WAIT_QUEUE


def _lower_tiers(settings: AgentSettings, engine: EngineAdapter) -> LowerTiers | None:
    """The L2/L3 tiers the settings ask for (None: none)."""
    if not (settings.host_tier_bytes or settings.disk_tier_bytes):
        return None
    codec = engine.kv_codec
    if codec is None:  # settings refuse this combination; an engine may still lack one
        raise ValueError(f"the {engine.info.engine} engine cannot move KV to host memory or disk")
    return LowerTiers(
        codec,
        host_bytes=settings.host_tier_bytes,
        disk_dir=settings.disk_tier_dir,
        disk_bytes=settings.disk_tier_bytes,
    )


class NodeAgentService(pb_grpc.NodeAgentServicer):
    """Implements kvc.v1.NodeAgent over a ``BlockPool`` and an ``EngineAdapter``."""

    def __init__(
        self,
        settings: AgentSettings,
        engine: EngineAdapter,
        *,
        transport: KvTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: AgentMetrics | None = None,
    ) -> None:
        self.metrics = metrics if metrics is not None else AgentMetrics()
        # Two conductors' pushes may interleave: room for twice the pool.
        self.replica_hints = ReplicaHintSet(max_keys=2 * settings.capacity_blocks)
        self.pool = BlockPool(
            capacity_blocks=settings.capacity_blocks,
            clock=clock,
            max_lease_s=settings.max_lease_s,
            max_tenant_locked_blocks=settings.tenant_max_locked_blocks(),
            lower=_lower_tiers(settings, engine),
            retention_budget_block_s=settings.resolved_retention_budget_block_s(),
            max_retained_blocks=settings.max_retained_blocks(),
            max_retention_s=settings.max_retention_s,
            replicas_elsewhere=(
                self.replica_hints.count if settings.replica_aware_eviction else None
            ),
            donate=self._offer_donation if settings.donate_before_evict else None,
            donate_min_hits=settings.donate_min_hits,
            donate_max_hops=settings.donate_max_hops,
        )
        self.events = EventPublisher(
            self.pool, engine, self.metrics, max_buffered=settings.event_buffer
        )
        self.replica_hints.epoch = self.events.epoch
        self.donations: Donations | None = None
        if settings.donate_before_evict:
            codec = engine.kv_codec
            if codec is None:  # settings refuse this combination; an engine may still lack one
                raise ValueError(f"the {engine.info.engine} engine cannot give its KV to a peer")
            self.donations = Donations(
                self.pool, self.replica_hints, codec, engine.info.kv_layout, self.metrics,
                tls=settings.tls_files(), plaintext=settings.grpc_plaintext,
            )  # fmt: skip
            self.events.eviction_tail = self.donations.eviction_tail_used_unix_s
        self.state = AgentState(settings, engine, self.pool, self.metrics, self.events, clock)
        self.tls = settings.tls_files() is not None  # callers carry role certificates
        self.transport: KvTransport = (
            transport
            if transport is not None
            else GrpcKvTransport(settings.tls_files(), settings.grpc_plaintext)
        )
        self.staging = StagingArea(
            settings.resolved_max_staged_bytes(
                engine.info.kv_layout.bytes_per_token, engine.info.max_model_len
            )
        )
        self.read_grants = ReadGrants()
        self.sender = KvSender(self.state, self.staging, self.read_grants, self.transport)
        self.receiver = KvReceiver(self.state, self.transport)
        self.generation = Generation(self.state, self.staging, self.receiver)
        self.health: health.aio.HealthServicer | None = None
        self.node_info = pb.NodeInfo()
        # vLLM: the pool mirrors a cache the engine evicts from on its own, so a
        # retention promised here could not be kept.
        self.engine_evicts = isinstance(engine, CacheMirroringEngine)
        if isinstance(engine, CacheMirroringEngine):
            engine.set_cache_sink(self.events.apply_engine_cache_events)

    @property
    def epoch(self) -> str:
        return self.events.epoch

    def _offer_donation(self, donation: Donation) -> bool:
        """The pool's donate-before-evict hook (set only when donations exist)."""
        return self.donations is not None and self.donations.offer(donation)

    @property
    def draining(self) -> bool:
        return self.state.draining

    # ----------------------------------------------------------------- lifecycle
    def bind(self, port: int) -> None:
        s = self.state.settings
        info = self.state.engine.info
        self.node_info = pb.NodeInfo(
            node_id=s.resolved_node_id(port),
            epoch=self.epoch,
            role=ROLE_TO_PB[s.role],
            model=info.model,
            engine=info.engine,
            block_size=s.block_size,
            capacity_blocks=s.capacity_blocks,
            max_model_len=info.max_model_len,
            kv_layout=layout_to_pb(info.kv_layout),
            advertise_address=s.resolved_advertise_address(port),
            version=package_version(),
            max_running_requests=s.resolved_max_running(),
            fused_tx=True,
            kv_migration=_moves_prefixes(self.state.engine),
            replica_hints=s.replica_aware_eviction,
            lend_wait=_lend_wait(s, self.state.engine),
            donate_before_evict=s.donate_before_evict,
            block_key_layout=KEY_LAYOUT,
        )
        lower = self.pool.lower
        if lower is not None:  # bandwidth of each tier, before any traffic
            layout = info.kv_layout
            codec = self.state.codec()
            zeros = bytes(layout.bytes_per_token * s.block_size)
            lower.measure(codec.from_bytes(layout, zeros, s.block_size))
        if s.engine == "vllm" and s.vllm_cpu_offload_bytes > 0:
            self.events.engine_host_tier = EngineHostTier(
                capacity_bytes=s.vllm_cpu_offload_bytes,
                block_bytes=s.block_size * info.kv_layout.bytes_per_token,
                read_bytes_per_s=s.vllm_cpu_offload_read_bytes_per_s,
            )
        self.node_info.tiers.extend(self.events.tiers())
        self.metrics.set_info(role=s.role, engine=info.engine, model=info.model)

    async def calibrate(self, budget_s: float) -> Calibration | None:
        """Measure the engine (before serving) and put the fit into ``NodeInfo``."""
        s = self.state.settings
        # A decode node's prefill estimates never place a prefill: no long prompts.
        plan = CalibrationPlan(long_prefill_sizes=()) if s.role == "decode" else None
        result = await calibrate_before_serving(
            self.state.engine,
            cache_capacity_tokens=s.capacity_blocks * s.block_size,
            budget_s=budget_s,
            turns=s.calibration_turns,
            plan=plan,
        )
        if result is None:
            self.node_info.ClearField("calibration")
        else:
            self.node_info.calibration.CopyFrom(calibration_to_pb(result))
        return result

    async def close(self) -> None:
        await self.events.close()
        await self.transport.aclose()
        if self.donations is not None:
            await self.donations.aclose()

    async def housekeeping_once(self) -> None:
        """Expire leases and staged KV; publish a load update when it changed."""
        expired = self.pool.expire_leases()
        if expired:
            log.info("leases expired, transactions aborted: %s", ", ".join(expired))
        self.staging.expire(self.state.clock())
        self.read_grants.prune(self._tx_open)
        self.events.publish_pool_events()
        self.events.publish_load()
        self.refresh_metrics()
        await self.events.notify()

    def refresh_metrics(self) -> None:
        """Sample the pool and engine gauges (housekeeping and every scrape call this)."""
        self.metrics.refresh(
            self.pool,
            self.state.engine.load(),
            self.staging.nbytes,
            engine_tiers=self.events.engine_tier_stats(),
        )

    async def run_housekeeping(self) -> None:
        while True:
            await self.housekeeping_once()
            await asyncio.sleep(self.state.settings.load_interval_s)

    def load_update(self) -> pb.LoadUpdate:
        return self.events.load_update()

    async def set_draining(self, draining: bool) -> None:
        """Stop (or resume) taking new work; health turns NOT_SERVING while draining."""
        if draining != self.state.draining:
            log.info("node agent %s", "draining" if draining else "resuming")
        self.state.draining = draining
        self.node_info.draining = draining
        if self.health is not None:
            status = (
                health_pb2.HealthCheckResponse.NOT_SERVING
                if draining
                else health_pb2.HealthCheckResponse.SERVING
            )
            await self.health.set(SERVICE_NAME, status)

    def busy(self) -> tuple[int, int]:
        """(open transactions, running generations): what a drain waits for."""
        return self.pool.stats().open_txs, self.state.engine.load().running_requests

    # ----------------------------------------------------------------- RPCs
    @maps_errors
    @authorized("conductor", "agent")
    async def GetInfo(self, request: pb.GetInfoRequest, context: Context) -> pb.NodeInfo:
        return self.node_info

    @maps_errors
    @authorized("conductor")
    async def Drain(self, request: pb.DrainRequest, context: Context) -> pb.DrainResponse:
        await self.set_draining(not request.resume)
        open_txs, running = self.busy()
        return pb.DrainResponse(draining=self.draining, open_txs=open_txs, running_requests=running)

    @maps_errors
    @authorized("conductor")
    async def TxAllocate(
        self, request: pb.TxAllocateRequest, context: Context
    ) -> pb.TxAllocateResponse:
        result = await self._allocate(request)
        lock_only = request.mode == pb.TX_MODE_LOCK_ONLY
        return pb.TxAllocateResponse(
            read_token=self.read_grants.issue(result.tx_id, request.grantee) if lock_only else "",
            tx_id=result.tx_id,
            handles=list(result.handles),
            reused_blocks=result.reused_blocks,
            new_blocks=result.new_blocks,
            lease_remaining_s=max(0.0, result.lease_deadline - self.state.clock()),
            free_blocks=self.pool.stats().free_blocks,
            allocatable_blocks=self.events.allocatable_blocks(),
            retention=retention_pb(result),
        )

    async def _allocate(self, request: pb.TxAllocateRequest) -> AllocateResult:
        mode = TxMode.LOCK_ONLY if request.mode == pb.TX_MODE_LOCK_ONLY else TxMode.ALLOCATE
        op = "lock_only" if mode is TxMode.LOCK_ONLY else "allocate"
        if self.draining and mode is TxMode.ALLOCATE:  # a source may still lend its blocks
            self.metrics.tx.labels(op, "draining").inc()
            raise Draining("this node is draining and takes no new work")
        keys = tuple(BlockKey(k) for k in request.block_keys)
        retain = tuple(Retention(r.blocks, r.ttl_s) for r in request.retain)
        # An engine that evicts on its own (vLLM) cannot keep a promise made here.
        unsupported = bool(retain) and self.engine_evicts
        retry = bool(retain) and self._tx_open(request.tx_id)  # answered (and counted) before
        params = AllocateParams(
            tx_id=request.tx_id,
            tenant=request.tenant,
            keys=keys,
            lease_s=request.lease_s,
            mode=mode,
            retain=() if unsupported else retain,
            key_layout=request.key_layout or 1,  # 0: a conductor from before layouts
        )
        lower = self.pool.lower
        if lower is None:
            result = await self._tx(op, lambda: self.pool.tx_allocate(params))
        else:
            await prefetch(lower, keys)  # copies and reads on the I/O thread, not here
            try:
                result = await self._tx(op, lambda: self.pool.tx_allocate(params))
            finally:
                lower.unstage(keys)
        if unsupported:
            result = replace(result, retention=RetentionOutcome.UNSUPPORTED)
        if result.retention is not RetentionOutcome.NONE and not retry:
            self.metrics.retentions.labels(result.retention.value).inc()
        return result

    @maps_errors
    @authorized("conductor")
    async def TxCommit(self, request: pb.TxCommitRequest, context: Context) -> pb.TxCommitResponse:
        result = await self._tx("commit", lambda: self.pool.tx_commit(request.tx_id))
        return pb.TxCommitResponse(tx_id=request.tx_id, stored_blocks=len(result.stored_keys))

    @maps_errors
    @authorized("conductor")
    async def TxAbort(self, request: pb.TxAbortRequest, context: Context) -> pb.TxAbortResponse:
        result = await self._tx("abort", lambda: self.pool.tx_abort(request.tx_id))
        return pb.TxAbortResponse(tx_id=request.tx_id, freed_blocks=result.freed_blocks)

    @maps_errors
    @authorized("conductor")
    async def TxExtend(self, request: pb.TxExtendRequest, context: Context) -> pb.TxExtendResponse:
        deadline = await self._tx(
            "extend", lambda: self.pool.tx_extend(request.tx_id, request.lease_s)
        )
        return pb.TxExtendResponse(
            tx_id=request.tx_id, lease_remaining_s=max(0.0, deadline - self.state.clock())
        )

    async def _tx(self, op: str, call: Callable[[], T]) -> T:
        """One block-table transaction call: counted, its events published either way."""
        try:
            result = call()
        except BlockPoolError as exc:
            self.metrics.record_tx(op, exc)
            await self.events.after_mutation()
            raise
        self.metrics.record_tx(op)
        await self.events.after_mutation()
        return result

    @maps_errors
    @authorized("conductor")
    async def Snapshot(self, request: pb.SnapshotRequest, context: Context) -> pb.SnapshotResponse:
        return self.events.snapshot(self.node_info)

    @maps_errors
    @authorized("conductor")
    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: Context
    ) -> AsyncIterator[pb.EventBatch]:
        async for batch in self.events.watch(request.epoch, request.from_seq):
            yield batch

    @maps_errors
    @authorized("conductor")
    async def Prefill(self, request: pb.PrefillRequest, context: Context) -> pb.PrefillResponse:
        if not request.HasField("tx"):
            return await self.generation.prefill(request)
        tx = self._fused_tx(request.tx, request.tx_id, request.tenant)
        self.state.require_role("prefill", "both")
        async with self._fused_allocation(tx) as fused:
            response = await self.generation.prefill(request)
            # The KV is computed and staged (or in the engine's hands for its own
            # transfer): the blocks are valid cache now, whatever happens to the decode.
            await fused.commit()
        if fused.result is not None:
            response.retention.CopyFrom(retention_pb(fused.result))
        return response

    @staticmethod
    def _fused_tx(tx: pb.TxAllocateRequest, tx_id: str, tenant: str) -> pb.TxAllocateRequest:
        """A call's own TxAllocate, checked against the call."""
        if tx.mode == pb.TX_MODE_LOCK_ONLY:
            raise InvalidArgument("a fused Tx allocates (mode ALLOCATE)")
        if tx.tx_id != tx_id or not tx.tx_id or tx.tenant != tenant:
            raise InvalidArgument("tx.tx_id and tx.tenant must equal the request's")
        return tx

    @contextlib.asynccontextmanager
    async def _fused_allocation(self, tx: pb.TxAllocateRequest) -> AsyncIterator[_FusedTx]:
        """Allocate ``tx`` for one call; abort it when the call ends (error, cancellation,
        even mid-allocation) before its body committed it. A Tx that was already open
        under this id (a repeated call) is left to its first owner and its lease."""
        fused = _FusedTx(self, tx.tx_id, owned=not self._tx_open(tx.tx_id))
        try:
            fused.result = await self._allocate(tx)
            fused.reused_blocks = fused.result.reused_blocks
            yield fused
        finally:
            if not fused.committed and fused.owned:
                with contextlib.suppress(BlockPoolError):  # never allocated, or gone
                    await self._tx("abort", lambda: self.pool.tx_abort(tx.tx_id))

    def _tx_open(self, tx_id: str) -> bool:
        try:
            self.pool.get_tx(tx_id)
        except BlockPoolError:
            return False
        return True

    async def commit_fused(self, tx_id: str) -> None:
        await self._tx("commit", lambda: self.pool.tx_commit(tx_id))

    @maps_errors
    @authorized("conductor")
    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        if not request.HasField("tx"):
            async for msg in self.generation.generate(request):
                yield msg
            return
        async for msg in self._generate_in_tx(request):
            yield msg

    async def _generate_in_tx(
        self, request: pb.GenerateRequest
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The fused call: TxAllocate, Generate, and TxCommit before the first token
        leaves; a call that ends before that aborts the Tx (the lease is the backstop
        only if this process dies)."""
        if request.HasField("kv_source"):
            raise InvalidArgument("a fused Tx allocates for a local prefill (no kv_source)")
        tx = self._fused_tx(request.tx, request.tx_id, request.tenant)
        self.state.require_role("both")
        async with self._fused_allocation(tx) as fused:
            async for msg in self.generation.generate(request):
                if not fused.committed:
                    await fused.commit()
                    msg.timings.cached_tokens = fused.reused_blocks * self.state.settings.block_size
                    if fused.result is not None:
                        msg.timings.retention.CopyFrom(retention_pb(fused.result))
                yield msg

    @maps_errors
    @authorized("conductor", "agent")
    async def FetchKv(
        self, request: pb.FetchKvRequest, context: Context
    ) -> AsyncIterator[pb.KvChunk]:
        async for chunk in self.sender.fetch_kv(request, Caller.of(context, self.tls)):
            yield chunk

    @maps_errors
    @authorized("conductor", "agent")
    async def ReadBlocks(
        self, request: pb.ReadBlocksRequest, context: Context
    ) -> AsyncIterator[pb.KvChunk]:
        async for chunk in self.sender.read_blocks(request, Caller.of(context, self.tls)):
            yield chunk

    @maps_errors
    @authorized("conductor")
    async def PullBlocks(
        self, request: pb.PullBlocksRequest, context: Context
    ) -> pb.PullBlocksResponse:
        try:
            self.state.refuse_if_draining()
            self.state.require_role("prefill", "both")
            copied, nbytes, transfer_s = await self.receiver.pull_blocks(request)
        except AGENT_ERRORS:
            await self.events.after_mutation()  # the lookups may have expired leases
            raise
        return pb.PullBlocksResponse(blocks_copied=copied, bytes=nbytes, transfer_s=transfer_s)

    @maps_errors
    @authorized("conductor")
    async def ReplicaHints(
        self, request: pb.ReplicaHintsRequest, context: Context
    ) -> pb.ReplicaHintsResponse:
        s = self.state.settings
        if not (s.replica_aware_eviction or s.donate_before_evict):
            raise PromptRejected(
                "this node takes no replica hints (replica_aware_eviction and "
                "donate_before_evict are off)"
            )
        return self.replica_hints.apply(request)

    @maps_errors
    @authorized("agent")
    async def DonateBlock(
        self, request: pb.DonateBlockRequest, context: Context
    ) -> pb.DonateBlockResponse:
        if self.donations is None:
            raise PromptRejected("this node takes no donated blocks (donate_before_evict is off)")
        self.state.refuse_if_draining()
        answer = self.donations.take(request)
        await self.events.after_mutation()
        return answer

    @maps_errors
    @authorized("conductor", "agent")
    async def LendBlocks(
        self, request: pb.LendBlocksRequest, context: Context
    ) -> pb.LendBlocksResponse:
        return await self.sender.lend_blocks(request, Caller.of(context, self.tls))


class AgentServer:
    """Owns the grpc.aio server, the service, the health servicer and background tasks."""

    def __init__(
        self,
        settings: AgentSettings,
        engine: EngineAdapter,
        *,
        transport: KvTransport | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.service = NodeAgentService(settings, engine, transport=transport)
        self.health = health.aio.HealthServicer()
        self.service.health = self.health
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ]
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._stop_registration = asyncio.Event()
        self._redis: Redis | None = None
        self._registration: asyncio.Task[None] | None = None
        self.port = 0
        self.metrics_server: MetricsServer | None = None
        self._tier_runner: ThreadRunner | None = None
        self.token_stream: TokenStreamServer | None = None

    @property
    def address(self) -> str:
        return self.service.node_info.advertise_address

    async def start(self) -> int:
        if self.settings.kv_shm_dir:  # same-host transfer files of receivers killed mid-way
            orphans = remove_orphans(Path(self.settings.kv_shm_dir))
            if orphans:
                log.info("removed %d same-host KV transfer files of agents gone", orphans)
        lower = self.service.pool.lower
        if lower is not None:  # tier copies and disk I/O off the event loop from now on
            self._tier_runner = ThreadRunner(asyncio.get_running_loop())
            lower.set_runner(self._tier_runner)
        pb_grpc.add_NodeAgentServicer_to_server(self.service, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self.port = self._bind()
        self.service.bind(self.port)
        if self.settings.stream_port is not None:
            await self._start_token_stream(self.settings.stream_port)
        if self.settings.calibrate:  # before serving: never next to a real request
            await self.service.calibrate(self.settings.calibration_budget_s)
        await self._server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._tasks.append(asyncio.create_task(self.service.run_housekeeping()))
        if self.service.donations is not None:
            self._tasks.append(asyncio.create_task(self.service.donations.run()))
        if self.settings.redis_url:
            self._redis = connect(self.settings.redis_url)
            self._registration = asyncio.create_task(
                keep_registered(
                    self._redis,
                    self._registry_record,
                    self.settings.registry_ttl_s,
                    self._stop_registration,
                )
            )
        if self.settings.metrics_port:
            self.metrics_server = MetricsServer(
                self.service.metrics,
                host=self.settings.metrics_host or self.settings.host,
                port=self.settings.metrics_port,
                before_scrape=self.service.refresh_metrics,
                ready=lambda: not self.service.draining,
            )
            await self.metrics_server.start()
        log.info(
            "node agent %s (%s, model %s) serving on %s",
            self.service.node_info.node_id,
            self.settings.role,
            self.engine.info.model,
            self.address,
        )
        return self.port

    def _bind(self) -> int:
        address = f"{self.settings.host}:{self.settings.port}"
        files = self.settings.tls_files()
        strict = self.settings.require_node_certificates
        if files is not None:
            self._check_own_certificate(certificate_node(files.cert.read_bytes()))
            return self._server.add_secure_port(address, files.server_credentials())
        if strict:
            raise ValueError("require_node_certificates needs mTLS (tls_cert_file, ...)")
        check_plaintext(address, self.settings.grpc_plaintext, "served")
        log.warning("gRPC is plaintext on %s: no TLS files (docs/security.md)", address)
        return self._server.add_insecure_port(address)

    async def _start_token_stream(self, port: int) -> None:
        """``Generate`` on its own TCP port (``node_agent/token_stream.py``), advertised
        in ``NodeInfo.stream_address``; TLS with the gRPC port's files, or plaintext
        under the same policy."""
        host = self.settings.host
        files = self.settings.tls_files()
        if files is None:
            check_plaintext(f"{host}:{port}", self.settings.grpc_plaintext, "served")
        context = files.server_ssl_context() if files is not None else None
        service = self.service
        methods = (
            StreamMethod("GetInfo", pb.GetInfoRequest.FromString, unary=service.GetInfo),
            StreamMethod("Snapshot", pb.SnapshotRequest.FromString, unary=service.Snapshot),
            StreamMethod(
                "WatchEvents", pb.WatchEventsRequest.FromString, streaming=service.WatchEvents
            ),
            StreamMethod("Prefill", pb.PrefillRequest.FromString, unary=service.Prefill),
        )
        self.token_stream = TokenStreamServer(service.Generate, methods)
        bound = await self.token_stream.start(host, port, context)
        advertised_host = service.node_info.advertise_address.rsplit(":", 1)[0]
        service.node_info.stream_address = f"{advertised_host}:{bound}"
        service.node_info.stream_methods[:] = self.token_stream.method_names

    def _check_own_certificate(self, named: str | None) -> None:
        """An agent whose certificate names a node is that node: pulls bound to it are
        let through by that name, so a mismatch is a deployment error."""
        node_id = self.settings.node_id
        if named is not None and named != node_id:
            raise ValueError(
                f"the TLS certificate names node {named!r}, this agent's node id is "
                f"{node_id or '(not set)'!r}: set --node-id {named}, or use this node's own "
                "certificate (kvc certs --node)"
            )
        if named is None and self.settings.require_node_certificates:
            raise ValueError(
                "require_node_certificates: this agent's own certificate must name its node "
                "(kvc certs --node ID, or a URI SAN urn:kvc:node:<node id>)"
            )

    def _registry_record(self) -> AgentRecord:
        info = self.service.node_info
        return AgentRecord(
            node_id=info.node_id,
            address=info.advertise_address,
            role=self.settings.role,
            model=info.model,
            epoch=info.epoch,
            block_size=info.block_size,
            updated_at=time.time(),
        )

    async def drain_and_stop(self, grace_s: float) -> None:
        """SIGTERM path: refuse new work, let in-flight generations and transactions
        finish for up to ``grace_s``, abort whatever Tx is still open, then stop."""
        await self.service.set_draining(True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        # Poll with a deadline: engines (embedded, vLLM) expose no "idle" event.
        while self.service.busy() != (0, 0) and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        open_txs, running = self.service.busy()
        if open_txs or running:
            log.warning(
                "drain grace over: aborting %d open transaction(s), %d running", open_txs, running
            )
        aborted = self.service.pool.clear() if open_txs else []
        if aborted:
            log.info("aborted transactions at shutdown: %s", ", ".join(aborted))
        await self.stop(grace_s=1.0)

    async def stop(self, grace_s: float = 5.0) -> None:
        self._stop_registration.set()  # withdraw from the registry first
        if self._registration is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._registration, timeout=2.0)
            self._registration = None
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None
        await self.health.enter_graceful_shutdown()
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        await self.service.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self.token_stream is not None:
            stopping = self.token_stream.stop(grace_s)
            await asyncio.gather(stopping, self._server.stop(grace_s))
            self.token_stream = None
        else:
            await self._server.stop(grace_s)
        if self._tier_runner is not None:  # let pending tier writes finish
            await asyncio.to_thread(self._tier_runner.close)
            self._tier_runner = None
        await self.engine.aclose()


_RETENTION_TO_PB = {
    RetentionOutcome.NONE: pb.RETENTION_STATUS_NONE,
    RetentionOutcome.GRANTED: pb.RETENTION_STATUS_GRANTED,
    RetentionOutcome.OVER_BUDGET: pb.RETENTION_STATUS_OVER_BUDGET,
    RetentionOutcome.NODE_FULL: pb.RETENTION_STATUS_NODE_FULL,
    RetentionOutcome.UNSUPPORTED: pb.RETENTION_STATUS_UNSUPPORTED,
    RetentionOutcome.TOO_LONG: pb.RETENTION_STATUS_TOO_LONG,
}


def retention_pb(result: AllocateResult) -> pb.RetentionResult:
    return pb.RetentionResult(
        status=_RETENTION_TO_PB[result.retention], retained_blocks=result.retained_blocks
    )


class _FusedTx:
    """A fused call's Tx: committed by the call's body, aborted otherwise."""

    __slots__ = ("committed", "owned", "result", "reused_blocks", "service", "tx_id")

    def __init__(self, service: NodeAgentService, tx_id: str, *, owned: bool) -> None:
        self.service = service
        self.tx_id = tx_id
        self.owned = owned
        self.result: AllocateResult | None = None
        self.reused_blocks = 0
        self.committed = False

    async def commit(self) -> None:
        await self.service.commit_fused(self.tx_id)
        self.committed = True
