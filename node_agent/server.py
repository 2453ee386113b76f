"""Node agent gRPC server: the block table's owner and the engine's front door.

State changes happen here and only here (Mooncake §5.3): TxAllocate/TxCommit/
TxAbort mutate the ``BlockPool``; every mutation's events are drained into the
``EventLog`` and fanned out to ``WatchEvents`` subscribers. ``Prefill`` computes a
prompt's KV into the Tx's blocks and stages it; a decode node pulls it through
``FetchKv`` (chunked, CRC-checked) and continues with ``Generate``.

Hot-spot replication (Mooncake §4.2) reuses that transfer path between prefill
nodes: the destination's ``PullBlocks`` calls the source's ``ReadBlocks`` for
blocks both hold under open Txs (the source's is LOCK_ONLY) and writes their KV
into its own blocks that have no content yet. Both directions share one sender
(``_stream_kv``) and one verifying receiver (``_receive_kv``) with ``FetchKv``.

Background work (lease expiry, staged-KV expiry, load updates) runs as a task the
``AgentServer`` owns and cancels on stop. Error mapping lives in ``_grpc_error``.

Start-up calibration (``node_agent/calibration.py``, ``calibrate=True``) runs in
``AgentServer.start`` after the port is bound and before the server serves, bounded by
``calibration_budget_s``: it never competes with real requests, and ``GetInfo`` reports
the fit from the first call on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from redis.asyncio import Redis

from kvc.block_keys import BlockKey, compute_block_keys
from kvc.registry import AgentRecord, connect, keep_registered
from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from kvc.wire import (
    ERROR_INFO_KEY,
    MAX_MESSAGE_BYTES,
    ROLE_TO_PB,
    SERVICE_NAME,
    sampling_from_pb,
)
from node_agent.blocks.events import EventLog
from node_agent.blocks.pool import (
    AllBlocksCleared,
    AllocateParams,
    BlockPool,
    BlockPoolError,
    BlockRemoved,
    BlockState,
    BlockStored,
    CapacityExhausted,
    InvalidArgument,
    TxClosed,
    TxExpired,
    TxMode,
    TxNotFound,
)
from node_agent.calibration import Calibration, calibrate, host_lock
from node_agent.engines.base import (
    CacheCleared,
    CacheMirroringEngine,
    CacheStored,
    EngineAdapter,
    EngineCacheEvent,
    GenerateJob,
    PrefillJob,
)
from node_agent.errors import (
    ContentMissing,
    Draining,
    EngineBusy,
    EngineError,
    NotStaged,
    PromptRejected,
    TransferError,
)
from node_agent.kv import KvCodec, KvContent, KvLayout
from node_agent.metrics import AgentMetrics, MetricsHttpServer
from node_agent.settings import AgentSettings

log = logging.getLogger("node_agent")

_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}
_CALIBRATION_CACHE_SHARE = 0.125  # of an engine-owned cache's tokens

Context = grpc.aio.ServicerContext[object, object]
KvStream = grpc.aio.UnaryStreamCall[Any, pb.KvChunk]  # any request type


@dataclass(slots=True)
class _Staged:
    kv: KvContent | None
    num_tokens: int
    nbytes: int
    expires_at: float


def layout_to_pb(layout: KvLayout) -> pb.KvLayout:
    return pb.KvLayout(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        bytes_per_token=layout.bytes_per_token,
    )


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


def _grpc_error(exc: Exception) -> tuple[grpc.StatusCode, str, pb.ErrorInfo | None]:
    """The one place agent exceptions become gRPC status codes."""
    if isinstance(exc, Draining):
        return grpc.StatusCode.UNAVAILABLE, str(exc), pb.ErrorInfo(reason="draining")
    if isinstance(exc, CapacityExhausted):
        info = pb.ErrorInfo(
            reason="capacity", needed_blocks=exc.needed_blocks, free_blocks=exc.free_blocks
        )
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), info
    if isinstance(exc, EngineBusy):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), pb.ErrorInfo(reason="busy")
    if isinstance(exc, InvalidArgument | PromptRejected):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc), None
    if isinstance(exc, TxNotFound | NotStaged):
        return grpc.StatusCode.NOT_FOUND, str(exc), None
    if isinstance(exc, TxClosed | ContentMissing):  # expired/finished tx; blocks lack KV
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc), None
    if isinstance(exc, TransferError):  # the peer failed us; this node itself is fine
        return grpc.StatusCode.UNAVAILABLE, str(exc), pb.ErrorInfo(reason="transfer")
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}", None


async def _abort(context: Context, exc: Exception) -> NoReturn:
    code, message, info = _grpc_error(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("internal error: %s", message, exc_info=exc)
    if info is not None:
        context.set_trailing_metadata(((ERROR_INFO_KEY, info.SerializeToString()),))
    await context.abort(code, message)
    raise AssertionError("context.abort returned")  # pragma: no cover


class NodeAgentService(pb_grpc.NodeAgentServicer):
    """Implements kvc.v1.NodeAgent over a ``BlockPool`` and an ``EngineAdapter``."""

    def __init__(
        self,
        settings: AgentSettings,
        engine: EngineAdapter,
        *,
        clock: Callable[[], float] = time.monotonic,
        metrics: AgentMetrics | None = None,
    ) -> None:
        self._settings = settings
        self._engine = engine
        self._clock = clock
        self.metrics = metrics if metrics is not None else AgentMetrics()
        self.pool = BlockPool(
            capacity_blocks=settings.capacity_blocks,
            clock=clock,
            max_lease_s=settings.max_lease_s,
        )
        self.epoch = uuid.uuid4().hex
        self._events: EventLog[pb.Event] = EventLog(
            epoch=self.epoch, max_buffered=settings.event_buffer
        )
        self._new_events = asyncio.Condition()
        self._staged: dict[str, _Staged] = {}
        self._staged_bytes = 0
        self._peers: dict[str, grpc.aio.Channel] = {}
        self._last_prefill = (0.0, 0, 0)
        self._last_load: pb.LoadUpdate | None = None
        self._stopping = False
        self.draining = False
        self.health: health.aio.HealthServicer | None = None
        self.node_info = pb.NodeInfo()
        if isinstance(engine, CacheMirroringEngine):  # vLLM: the pool mirrors its cache
            engine.set_cache_sink(self.apply_engine_cache_events)
        # Engine-to-engine KV hand-offs (vLLM P/D) of finished prefills, by request id.
        self._engine_transfers: dict[str, dict[str, Any]] = {}
        # Pulled blocks must live where the engine keeps KV: a pool mixing devices
        # could not concatenate a reused prefix.

    # ----------------------------------------------------------------- lifecycle
    def bind(self, port: int) -> None:
        s = self._settings
        info = self._engine.info
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
            version=_version(),
            max_running_requests=s.max_running,
        )
        self.metrics.set_info(role=s.role, engine=info.engine, model=info.model)

    async def calibrate(self, budget_s: float) -> Calibration | None:
        """Measure the engine (before serving) and put the fit into ``NodeInfo``.

        An engine with its own prefix cache (vLLM) keeps calibration's blocks (under a
        salt no tenant has) until it evicts them: calibration may send at most
        ``_CALIBRATION_CACHE_SHARE`` of the cache's tokens, so little of a warm cache
        is displaced. Calibration is an optional extra: whatever goes wrong, the agent
        serves without.
        """
        s = self._settings
        info = self._engine.info
        started = time.monotonic()
        turn: contextlib.AbstractAsyncContextManager[bool]
        cache_tokens: int | None = None
        if info.owns_kv_cache:  # vLLM computes in its own server; its cache is bounded
            cache_tokens = int(s.capacity_blocks * s.block_size * _CALIBRATION_CACHE_SHARE)
            turn = contextlib.nullcontext(True)
        else:  # computes in this process: take turns with this host's other agents
            turn = host_lock(f"calibration-{info.device}", budget_s)
        try:
            async with turn as held:
                if not held:
                    log.warning(
                        "calibration skipped: other agents of this host took %.1f s", budget_s
                    )
                    return None
                left_s = budget_s - (time.monotonic() - started)
                result = await calibrate(self._engine, left_s, cache_tokens=cache_tokens)
        except Exception:
            log.warning("engine calibration failed; serving without", exc_info=True)
            return None
        if result is None:
            self.node_info.ClearField("calibration")
        else:
            self.node_info.calibration.CopyFrom(calibration_to_pb(result))
        return result

    async def close(self) -> None:
        self._stopping = True
        await self._notify()
        for channel in self._peers.values():
            await channel.close()
        self._peers.clear()

    async def housekeeping_once(self) -> None:
        """Expire leases and staged KV; publish a load update when it changed."""
        expired = self.pool.expire_leases()
        if expired:
            log.info("leases expired, transactions aborted: %s", ", ".join(expired))
        now = self._clock()
        for request_id in [r for r, st in self._staged.items() if st.expires_at <= now]:
            self._unstage(request_id)
        self._publish_pool_events()
        load = self.load_update()
        if load != self._last_load:
            self._append(pb.Event(load=load))
            self._last_load = load
        self.refresh_metrics()
        await self._notify()

    def refresh_metrics(self) -> None:
        """Sample the pool and engine gauges (housekeeping and every scrape call this)."""
        self.metrics.refresh(self.pool, self._engine.load(), self._staged_bytes)

    async def run_housekeeping(self) -> None:
        while not self._stopping:
            await self.housekeeping_once()
            await asyncio.sleep(self._settings.load_interval_s)

    # ----------------------------------------------------------------- events
    def allocatable_blocks(self) -> int:
        """Blocks an allocation could obtain now: free plus evictable (cached, unlocked).

        An engine that owns its cache (vLLM) and reports its KV usage bounds it too:
        its usage counts the blocks its running requests hold, which the mirror only
        learns of once they are cached. (vLLM counts its evictable cached blocks as
        free, so a warm but idle vLLM reports ~0 usage and does not lower this.)
        """
        stats = self.pool.stats()
        obtainable = stats.free_blocks + stats.evictable_blocks
        usage = self._engine.load().kv_usage_ratio
        if usage > 0.0:
            engine_free = math.floor((1.0 - min(usage, 1.0)) * stats.capacity_blocks)
            obtainable = min(obtainable, max(engine_free, stats.free_blocks))
        return obtainable

    def load_update(self) -> pb.LoadUpdate:
        load = self._engine.load()
        stats = self.pool.stats()
        last_s, last_tokens, last_cached = self._last_prefill
        return pb.LoadUpdate(
            queued_prefill_tokens=load.queued_prefill_tokens,
            running_requests=load.running_requests,
            waiting_requests=load.waiting_requests,
            free_blocks=stats.free_blocks,
            allocatable_blocks=self.allocatable_blocks(),
            kv_usage_ratio=max(
                1.0 - stats.free_blocks / stats.capacity_blocks, load.kv_usage_ratio
            ),
            last_prefill_s=last_s,
            last_prefill_tokens=last_tokens,
            last_prefill_cached_tokens=last_cached,
        )

    def _append(self, event: pb.Event) -> None:
        event.time_s = time.time()
        event.seq = self._events.append(event)
        self.metrics.record_event(event.WhichOneof("kind"))

    def _publish_pool_events(self) -> None:
        for ev in self.pool.take_events():
            if isinstance(ev, BlockStored):
                stored = pb.BlockStored(block_keys=list(ev.keys))
                if ev.parent_key is not None:
                    stored.parent_key = ev.parent_key
                    stored.has_parent = True
                self._append(pb.Event(stored=stored))
            elif isinstance(ev, BlockRemoved):
                self._append(pb.Event(removed=pb.BlockRemoved(block_keys=list(ev.keys))))
            elif isinstance(ev, AllBlocksCleared):
                self._append(pb.Event(cleared=pb.AllBlocksCleared()))

    async def _notify(self) -> None:
        async with self._new_events:
            self._new_events.notify_all()

    async def _after_mutation(self) -> None:
        self._publish_pool_events()
        await self._notify()

    async def apply_engine_cache_events(self, events: Sequence[EngineCacheEvent]) -> None:
        """Mirror an engine-owned KV cache (vLLM's KV events) into the pool; publish it."""
        for ev in events:
            if isinstance(ev, CacheStored):
                self.pool.mirror_stored(ev.keys, ev.parent_key)
            elif isinstance(ev, CacheCleared):
                self.pool.mirror_clear()
            else:
                self.pool.mirror_removed(ev.keys)
        await self._after_mutation()

    # ----------------------------------------------------------------- Tx
    async def GetInfo(self, request: pb.GetInfoRequest, context: Context) -> pb.NodeInfo:
        return self.node_info

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise Draining("this node is draining and takes no new work")

    async def set_draining(self, draining: bool) -> None:
        """Stop (or resume) taking new work; health turns NOT_SERVING while draining."""
        if draining != self.draining:
            log.info("node agent %s", "draining" if draining else "resuming")
        self.draining = draining
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
        return self.pool.stats().open_txs, self._engine.load().running_requests

    async def Drain(self, request: pb.DrainRequest, context: Context) -> pb.DrainResponse:
        await self.set_draining(not request.resume)
        open_txs, running = self.busy()
        return pb.DrainResponse(draining=self.draining, open_txs=open_txs, running_requests=running)

    async def TxAllocate(
        self, request: pb.TxAllocateRequest, context: Context
    ) -> pb.TxAllocateResponse:
        mode = TxMode.LOCK_ONLY if request.mode == pb.TX_MODE_LOCK_ONLY else TxMode.ALLOCATE
        op = "lock_only" if mode is TxMode.LOCK_ONLY else "allocate"
        if self.draining and mode is TxMode.ALLOCATE:  # a source may still lend its blocks
            self.metrics.tx.labels(op, "draining").inc()
            await _abort(context, Draining("this node is draining and takes no new work"))
        try:
            result = self.pool.tx_allocate(
                AllocateParams(
                    tx_id=request.tx_id,
                    tenant=request.tenant,
                    keys=tuple(BlockKey(k) for k in request.block_keys),
                    lease_s=request.lease_s,
                    mode=mode,
                )
            )
        except BlockPoolError as exc:
            self.metrics.record_tx(op, exc)
            await self._after_mutation()
            await _abort(context, exc)
        self.metrics.record_tx(op)
        await self._after_mutation()
        return pb.TxAllocateResponse(
            tx_id=result.tx_id,
            handles=list(result.handles),
            reused_blocks=result.reused_blocks,
            new_blocks=result.new_blocks,
            lease_remaining_s=max(0.0, result.lease_deadline - self._clock()),
            free_blocks=self.pool.stats().free_blocks,
            allocatable_blocks=self.allocatable_blocks(),
        )

    async def TxCommit(self, request: pb.TxCommitRequest, context: Context) -> pb.TxCommitResponse:
        try:
            result = self.pool.tx_commit(request.tx_id)
        except BlockPoolError as exc:
            self.metrics.record_tx("commit", exc)
            await self._after_mutation()
            await _abort(context, exc)
        self.metrics.record_tx("commit")
        await self._after_mutation()
        return pb.TxCommitResponse(tx_id=request.tx_id, stored_blocks=len(result.stored_keys))

    async def TxAbort(self, request: pb.TxAbortRequest, context: Context) -> pb.TxAbortResponse:
        try:
            result = self.pool.tx_abort(request.tx_id)
        except BlockPoolError as exc:
            self.metrics.record_tx("abort", exc)
            await self._after_mutation()
            await _abort(context, exc)
        self.metrics.record_tx("abort")
        await self._after_mutation()
        return pb.TxAbortResponse(tx_id=request.tx_id, freed_blocks=result.freed_blocks)

    # ----------------------------------------------------------------- state stream
    async def Snapshot(self, request: pb.SnapshotRequest, context: Context) -> pb.SnapshotResponse:
        self.pool.expire_leases()
        self._publish_pool_events()
        return pb.SnapshotResponse(
            node=self.node_info,
            epoch=self.epoch,
            seq=self._events.last_seq,
            cached_keys=list(self.pool.cached_keys()),
            load=self.load_update(),
        )

    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: Context
    ) -> AsyncIterator[pb.EventBatch]:
        if request.epoch and request.epoch != self.epoch:
            yield pb.EventBatch(epoch=self.epoch, resync_required=True)
            return
        next_seq = max(1, request.from_seq)
        self.metrics.watch_subscribers.inc()
        try:
            while not self._stopping:
                batch = self._events.since(next_seq)
                if batch is None:
                    yield pb.EventBatch(epoch=self.epoch, resync_required=True)
                    return
                if batch:
                    next_seq = batch[-1][0] + 1
                    yield pb.EventBatch(epoch=self.epoch, events=[ev for _, ev in batch])
                    continue
                async with self._new_events:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._new_events.wait(), timeout=5.0)
        finally:
            self.metrics.watch_subscribers.dec()

    # ----------------------------------------------------------------- prefill
    def _require_role(self, *allowed: str) -> None:
        if self._settings.role not in allowed:
            raise PromptRejected(
                f"this node's role is {self._settings.role!r}; needs one of {', '.join(allowed)}"
            )

    async def _prefill_into_tx(
        self,
        request_id: str,
        tenant: str,
        tx_id: str,
        prompt: tuple[int, ...],
        *,
        for_generate: bool = False,
    ) -> tuple[KvContent | None, int, int, float]:
        """Compute KV of prompt[:-1] into the Tx's blocks. Returns (kv, cached, computed, s).

        An engine that owns its KV cache (vLLM) prefills inside ``generate``: for a local
        Generate the Tx is then only checked (it reserved the capacity), not computed.
        """
        if not prompt:
            raise PromptRejected("prompt must contain at least one token")
        keys = compute_block_keys(
            prompt[:-1],
            tenant=tenant,
            model=self._engine.info.model,
            block_size=self._settings.block_size,
        )
        if not keys and not tx_id:
            handles: tuple[int, ...] = ()  # shorter than one block: nothing to own
        else:
            handles = self.pool.get_tx(tx_id).handles
        # The agent never trusts a conductor's keys for content: they must be the
        # keys of exactly this prompt, or a stale conductor could serve wrong KV.
        if len(handles) != len(keys) or any(
            self.pool.block_key(h) != k for h, k in zip(handles, keys, strict=True)
        ):
            raise InvalidArgument(
                f"transaction {tx_id!r} holds blocks for a different prompt, tenant or model"
            )
        if for_generate and self._engine.info.owns_kv_cache:
            cached = self.pool.match_prefix(keys) * self._settings.block_size
            return None, cached, len(prompt) - 1 - cached, 0.0
        payloads = tuple(_as_kv(self.pool.get_payload(h)) for h in handles)
        outcome = await self._engine.prefill(
            PrefillJob(
                request_id=request_id,
                prompt_ids=prompt,
                block_size=self._settings.block_size,
                block_payloads=payloads,
                tenant=tenant,
            )
        )
        # The lease may have run out while computing: then the handles may belong
        # to someone else now and must not be written.
        if handles:
            try:
                self.pool.get_tx(tx_id)
            except BlockPoolError:
                await self._after_mutation()
                raise TxExpired(tx_id) from None
        for index, kv in outcome.new_block_payloads.items():
            self.pool.set_payload(handles[index], kv)
        self._last_prefill = (outcome.prefill_s, outcome.computed_tokens, outcome.cached_tokens)
        if outcome.engine_transfer_params is not None:
            self._engine_transfers[request_id] = dict(outcome.engine_transfer_params)
        self.metrics.prefill_seconds.observe(outcome.prefill_s)
        self.metrics.prefill_tokens.labels("computed").inc(outcome.computed_tokens)
        self.metrics.prefill_tokens.labels("cached").inc(outcome.cached_tokens)
        return outcome.kv, outcome.cached_tokens, outcome.computed_tokens, outcome.prefill_s

    async def Prefill(self, request: pb.PrefillRequest, context: Context) -> pb.PrefillResponse:
        prompt = tuple(request.prompt_token_ids)
        try:
            self._refuse_if_draining()
            self._require_role("prefill", "both")
            if not request.request_id:
                raise PromptRejected("request_id is required")
            if request.request_id in self._staged:
                raise PromptRejected(f"request {request.request_id!r} is already staged")
            kv_bytes = max(0, len(prompt) - 1) * self._engine.info.kv_layout.bytes_per_token
            if self._staged_bytes + kv_bytes > self._settings.max_staged_bytes:
                raise EngineBusy("staged KV buffer is full")
            kv, cached, computed, prefill_s = await self._prefill_into_tx(
                request.request_id, request.tenant, request.tx_id, prompt
            )
        except (BlockPoolError, EngineError) as exc:
            await _abort(context, exc)
        transfer = self._engine_transfers.pop(request.request_id, None)
        if transfer is not None:  # the decode engine pulls the KV itself: nothing to stage
            return pb.PrefillResponse(
                request_id=request.request_id,
                prompt_tokens=len(prompt),
                cached_tokens=cached,
                computed_tokens=computed,
                prefill_s=prefill_s,
                engine_transfer_params=json.dumps(transfer),
            )
        ttl = request.stage_ttl_s if request.stage_ttl_s > 0 else self._settings.stage_ttl_s
        self._staged[request.request_id] = _Staged(
            kv=kv,
            num_tokens=len(prompt) - 1,
            nbytes=kv_bytes,
            expires_at=self._clock() + min(ttl, self._settings.stage_ttl_s),
        )
        self._staged_bytes += kv_bytes
        return pb.PrefillResponse(
            request_id=request.request_id,
            prompt_tokens=len(prompt),
            cached_tokens=cached,
            computed_tokens=computed,
            prefill_s=prefill_s,
            kv_bytes=kv_bytes,
        )

    def _unstage(self, request_id: str) -> _Staged | None:
        staged = self._staged.pop(request_id, None)
        if staged is not None:
            self._staged_bytes -= staged.nbytes
        return staged

    async def FetchKv(
        self, request: pb.FetchKvRequest, context: Context
    ) -> AsyncIterator[pb.KvChunk]:
        # One fetch per staged prefill: claim it now so a retry cannot double-serve.
        staged = self._unstage(request.request_id)
        if staged is None:
            await _abort(context, NotStaged(f"no staged KV for request {request.request_id!r}"))
        stream = self._stream_kv(staged.kv, staged.num_tokens, request.max_chunk_bytes)
        async for msg in self._count_sent(stream, "handoff"):
            yield msg

    async def _stream_kv(
        self, kv: KvContent | None, num_tokens: int, max_chunk_bytes: int
    ) -> AsyncIterator[pb.KvChunk]:
        """The sending half of every KV transfer: layout and sizes up front, CRC32 per chunk.

        At least one chunk is sent (an empty one for zero tokens), so the receiver
        always learns the layout and the announced size.
        """
        limit = self._settings.transfer_chunk_bytes
        chunk = max(4096, min(max_chunk_bytes or limit, limit))
        data = await asyncio.to_thread(kv.to_bytes) if kv is not None else b""
        view = memoryview(data)
        offset = 0
        while True:
            piece = bytes(view[offset : offset + chunk])
            msg = pb.KvChunk(
                num_tokens=num_tokens,
                total_bytes=len(data),
                offset=offset,
                data=piece,
                crc32=zlib.crc32(piece),
            )
            if offset == 0:
                msg.layout.CopyFrom(layout_to_pb(self._engine.info.kv_layout))
            yield msg
            offset += len(piece)
            if offset >= len(data):
                return

    async def ReadBlocks(
        self, request: pb.ReadBlocksRequest, context: Context
    ) -> AsyncIterator[pb.KvChunk]:
        # Any role may serve: a decode-only node's pool can hold hot blocks too.
        try:
            kv = await self._read_tx_blocks(request.tx_id, tuple(request.block_keys))
        except (BlockPoolError, ContentMissing) as exc:
            await self._after_mutation()  # the lookup may have expired leases
            await _abort(context, exc)
        num_tokens = len(request.block_keys) * self._settings.block_size
        stream = self._stream_kv(kv, num_tokens, request.max_chunk_bytes)
        async for msg in self._count_sent(stream, "migration"):
            yield msg

    async def _count_sent(
        self, stream: AsyncIterator[pb.KvChunk], kind: str
    ) -> AsyncIterator[pb.KvChunk]:
        """Pass chunks through, counting bytes sent (even of a transfer cut short)."""
        started = time.perf_counter()
        sent = 0
        complete = False
        try:
            async for msg in stream:
                sent += len(msg.data)
                yield msg
            complete = True
        finally:
            self.metrics.transfer_bytes.labels("sent", kind).inc(sent)
            if complete:
                self.metrics.transfer_seconds.labels("sent", kind).observe(
                    time.perf_counter() - started
                )

    async def _read_tx_blocks(self, tx_id: str, keys: tuple[int, ...]) -> KvContent:
        """KV of the open Tx's first ``len(keys)`` blocks, which must hold exactly ``keys``."""
        if not keys:
            raise InvalidArgument("block_keys must not be empty")
        handles = self.pool.get_tx(tx_id).handles
        if len(keys) > len(handles):
            raise InvalidArgument(
                f"transaction {tx_id!r} holds {len(handles)} blocks, {len(keys)} were asked for"
            )
        if any(self.pool.block_key(h) != k for h, k in zip(handles, keys, strict=False)):
            raise InvalidArgument(f"transaction {tx_id!r} holds other blocks than those asked for")
        # Taken now, before any await: payloads are immutable, so what is streamed
        # stays the content of these keys even if the lease ran out meanwhile.
        payloads = [_as_kv(self.pool.get_payload(h)) for h in handles[: len(keys)]]
        bs = self._settings.block_size
        missing = sum(p is None or p.num_tokens != bs for p in payloads)
        if missing:
            raise ContentMissing(
                f"{missing} of the {len(keys)} blocks of transaction {tx_id!r} hold no KV"
            )
        codec = _codec(self._engine)
        return await asyncio.to_thread(codec.concat, [p for p in payloads if p is not None])

    async def PullBlocks(
        self, request: pb.PullBlocksRequest, context: Context
    ) -> pb.PullBlocksResponse:
        try:
            self._refuse_if_draining()
            self._require_role("prefill", "both")
            copied, nbytes, transfer_s = await self._pull_blocks(request)
        except (BlockPoolError, EngineError, TransferError) as exc:
            await self._after_mutation()  # the lookups may have expired leases
            await _abort(context, exc)
        return pb.PullBlocksResponse(blocks_copied=copied, bytes=nbytes, transfer_s=transfer_s)

    async def _pull_blocks(self, request: pb.PullBlocksRequest) -> tuple[int, int, float]:
        """Copy the first ``num_blocks`` blocks of our Tx from the source's Tx.

        Everything is received and verified before any payload is written, so a
        failed pull leaves this node's pool exactly as it was.
        """
        if not request.source_address or not request.source_tx_id:
            raise InvalidArgument("source_address and source_tx_id are required")
        if request.num_blocks == 0:
            raise InvalidArgument("num_blocks must be > 0")
        tx = self.pool.get_tx(request.tx_id)
        n = request.num_blocks
        if n > len(tx.handles):
            raise InvalidArgument(
                f"transaction {request.tx_id!r} holds {len(tx.handles)} blocks, num_blocks is {n}"
            )
        handles = tx.handles[:n]
        wanted = [i for i, h in enumerate(handles) if self._needs_content(h)]
        if not wanted:
            return 0, 0, 0.0  # everything is here already: no transfer
        keys = [k for h in handles if (k := self.pool.block_key(h)) is not None]
        lease_left = max(0.001, tx.lease_deadline - self._clock())
        read = pb.ReadBlocksRequest(tx_id=request.source_tx_id, block_keys=keys)
        bs = self._settings.block_size
        try:
            kv, transfer_s, nbytes = await self._receive_kv(
                request.source_address,
                lambda peer: peer.ReadBlocks(read, timeout=lease_left),
                expected_tokens=n * bs,
            )
        except TransferError:
            self.metrics.transfer_failures.labels("migration").inc()
            await self._require_open(request.tx_id)  # our lease ran out: report that instead
            raise
        self.metrics.record_transfer("received", "migration", nbytes, transfer_s)
        assert kv is not None  # n > 0 blocks of > 0 tokens
        blocks = await asyncio.to_thread(
            lambda: {i: kv.slice(i * bs, (i + 1) * bs) for i in wanted}
        )
        # The lease may have run out during the transfer: then the handles may
        # belong to someone else now and must not be written (as in Prefill).
        await self._require_open(request.tx_id)
        copied = 0
        for i, block in blocks.items():
            # Re-checked: a concurrent Prefill may have filled it meanwhile.
            if self._needs_content(handles[i]) and self.pool.set_payload(handles[i], block):
                copied += 1
        return copied, nbytes, transfer_s

    async def _require_open(self, tx_id: str) -> None:
        """Raise the pool's error (expired, aborted, unknown) unless ``tx_id`` is open."""
        try:
            self.pool.get_tx(tx_id)
        except BlockPoolError:
            await self._after_mutation()
            raise

    def _needs_content(self, handle: int) -> bool:
        """ALLOCATED without KV yet (a CACHED block's content is never replaced)."""
        return (
            self.pool.block_state(handle) is BlockState.ALLOCATED
            and self.pool.get_payload(handle) is None
        )

    # ----------------------------------------------------------------- generate
    def _peer(self, address: str) -> pb_grpc.NodeAgentAsyncStub:
        channel = self._peers.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(
                address, options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
            )
            self._peers[address] = channel
        return pb_grpc.NodeAgentStub(channel)

    async def _fetch_kv(self, source: pb.KvSource) -> tuple[KvContent | None, float, int]:
        """Pull a staged prefill from a peer (FetchKv)."""
        request = pb.FetchKvRequest(request_id=source.request_id)
        try:
            kv, seconds, nbytes = await self._receive_kv(
                source.address,
                lambda peer: peer.FetchKv(request),
                expected_tokens=source.num_tokens,
            )
        except TransferError:
            self.metrics.transfer_failures.labels("handoff").inc()
            raise
        self.metrics.record_transfer("received", "handoff", nbytes, seconds)
        return kv, seconds, nbytes

    async def _receive_kv(
        self,
        address: str,
        open_stream: Callable[[pb_grpc.NodeAgentAsyncStub], KvStream],
        *,
        expected_tokens: int,
    ) -> tuple[KvContent | None, float, int]:
        """The receiving half of every KV transfer: verify layout, size, order, checksums.

        Returns (kv of ``expected_tokens`` tokens or None for zero, seconds, bytes).
        Any failure, the peer's refusal included, is a ``TransferError``.
        """
        started = time.perf_counter()
        own = self._engine.info.kv_layout
        buffer = bytearray()
        expected_total = -1
        call = open_stream(self._peer(address))
        try:
            async for chunk in call:
                if expected_total < 0:
                    lay = chunk.layout
                    theirs = (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype)
                    if theirs != (own.num_layers, own.num_kv_heads, own.head_dim, own.dtype):
                        raise TransferError("peer KV layout differs from this node's model")
                    if chunk.num_tokens != expected_tokens:
                        raise TransferError(
                            f"peer sends {chunk.num_tokens} tokens, expected {expected_tokens}"
                        )
                    expected_total = chunk.total_bytes
                    if expected_total != expected_tokens * own.bytes_per_token:
                        raise TransferError("peer announced a KV size that does not match")
                if chunk.offset != len(buffer):
                    raise TransferError("KV chunk out of order")
                if zlib.crc32(chunk.data) != chunk.crc32:
                    raise TransferError(f"KV chunk at offset {chunk.offset} failed its checksum")
                buffer.extend(chunk.data)
                if len(buffer) > expected_total:
                    raise TransferError("peer sent more KV than announced")
        except grpc.aio.AioRpcError as exc:
            raise TransferError(
                f"KV transfer from {address} failed: {exc.code().name}: {exc.details()}"
            ) from exc
        finally:
            call.cancel()  # no-op when complete; stops the peer when we gave up early
        if len(buffer) != expected_total:
            raise TransferError("KV transfer ended early")
        kv = None
        if expected_tokens:
            kv = await asyncio.to_thread(
                _codec(self._engine).from_bytes, own, bytes(buffer), expected_tokens
            )
        return kv, time.perf_counter() - started, len(buffer)

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        prompt = tuple(request.prompt_token_ids)
        sampling = sampling_from_pb(request.sampling)
        timings = pb.GenerateTimings()
        cached = 0
        try:
            self._refuse_if_draining()
            prefix_kv: KvContent | None = None
            transfer: dict[str, Any] | None = None
            if request.HasField("kv_source"):
                self._require_role("decode", "both")
                if request.kv_source.num_tokens != max(0, len(prompt) - 1):
                    raise PromptRejected("kv_source.num_tokens must equal len(prompt) - 1")
                if request.kv_source.engine_transfer_params:
                    transfer = _engine_transfer(request.kv_source, self._engine.info.owns_kv_cache)
                else:
                    prefix_kv, timings.transfer_s, timings.transfer_bytes = await self._fetch_kv(
                        request.kv_source
                    )
            elif request.tx_id:
                self._require_role("both")
                prefix_kv, cached, _, timings.prefill_s = await self._prefill_into_tx(
                    request.request_id, request.tenant, request.tx_id, prompt, for_generate=True
                )
            else:
                self._require_role("decode", "both")
            engine_started = time.perf_counter()
            steps = self._engine.generate(
                GenerateJob(
                    request_id=request.request_id,
                    prompt_ids=prompt,
                    sampling=sampling,
                    prefix_kv=prefix_kv,
                    tenant=request.tenant,
                    engine_transfer_params=transfer,
                )
            )
            produced = 0
            first = True
            async for step in steps:
                produced += len(step.token_ids)
                self.metrics.generated_tokens.inc(len(step.token_ids))
                msg = pb.GenerateResponse(token_ids=list(step.token_ids), text=step.text)
                if first:
                    if self._engine.info.owns_kv_cache and not timings.prefill_s:
                        # The engine prefilled inside generate: its time to first token.
                        timings.prefill_s = time.perf_counter() - engine_started
                    msg.timings.CopyFrom(timings)
                    first = False
                if step.finish_reason is not None:
                    msg.finish_reason = _FINISH[step.finish_reason]
                    msg.usage.CopyFrom(
                        pb.GenerateUsage(
                            prompt_tokens=len(prompt),
                            completion_tokens=produced,
                            cached_tokens=cached
                            if step.cached_tokens is None
                            else step.cached_tokens,
                        )
                    )
                yield msg
        except (BlockPoolError, EngineError, TransferError) as exc:
            await _abort(context, exc)


def _engine_transfer(source: pb.KvSource, owns_kv_cache: bool) -> dict[str, Any]:
    """The engine-to-engine hand-off of a ``KvSource`` (vLLM P/D), checked."""
    if not owns_kv_cache:
        raise PromptRejected("this node's engine cannot pull KV from another engine")
    try:
        params = json.loads(source.engine_transfer_params)
    except ValueError:
        params = None
    if not isinstance(params, dict):
        raise PromptRejected("kv_source.engine_transfer_params must be a JSON object")
    return params


def _as_kv(payload: object) -> KvContent | None:
    return payload if isinstance(payload, KvContent) else None


def _codec(engine: EngineAdapter) -> KvCodec:
    """The engine's KV codec; an engine without one cannot take KV from a peer."""
    codec = engine.kv_codec
    if codec is None:
        raise PromptRejected(
            f"this node's engine ({engine.info.engine}) keeps KV in its own process: "
            "it cannot take KV from a peer"
        )
    return codec


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kv-conductor")
    except PackageNotFoundError:
        return "0+unknown"


class AgentServer:
    """Owns the grpc.aio server, the service, the health servicer and background tasks."""

    def __init__(self, settings: AgentSettings, engine: EngineAdapter) -> None:
        self.settings = settings
        self.engine = engine
        self.service = NodeAgentService(settings, engine)
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
        self.metrics_server: MetricsHttpServer | None = None

    @property
    def address(self) -> str:
        return self.service.node_info.advertise_address

    async def start(self) -> int:
        pb_grpc.add_NodeAgentServicer_to_server(self.service, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self.port = self._server.add_insecure_port(f"{self.settings.host}:{self.settings.port}")
        self.service.bind(self.port)
        if self.settings.calibrate:  # before serving: never next to a real request
            await self.service.calibrate(self.settings.calibration_budget_s)
        await self._server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._tasks.append(asyncio.create_task(self.service.run_housekeeping()))
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
            self.metrics_server = MetricsHttpServer(
                self.service.metrics,
                host=self.settings.metrics_host or self.settings.host,
                port=self.settings.metrics_port,
                before_scrape=self.service.refresh_metrics,
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
        await self._server.stop(grace_s)
        await self.engine.aclose()
