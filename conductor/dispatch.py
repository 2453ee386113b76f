"""Runs one generation across node agents as a Mooncake-style transaction.

1. Block keys of ``prompt[:-1]``; prefix length per node from the shadow index.
2. ``Scheduler.schedule`` (Algorithm 1 + admission) → a placement, or a rejection that
   becomes 429 with ``Retry-After`` before any agent is called.
3. ``TxAllocate`` the keys on the prefill node (reuse + lock). With a migration:
   ``TxAllocate(LOCK_ONLY)`` on the holder, ``PullBlocks`` on the prefill node, commit the
   holder (paired Tx, §5.3); a failed migration falls back to recomputing.
4. Disaggregated: ``Prefill`` there, then ``Generate`` on the decode node with a
   ``kv_source`` pointing back at the staged KV. Colocated ("both" node): ``Generate``
   with the ``tx_id``; the node prefills locally.
5. First token → ``TxCommit`` on the prefill node: new blocks become reusable prefix.
6. Any failure or cancellation before the commit ``TxAbort``s every Tx held (shielded
   from cancellation); node-side leases are the backstop if this process dies.

A node that refuses for capacity (RESOURCE_EXHAUSTED) or is unreachable is excluded and
the request is scheduled again among the rest. Measured prefill, transfer and decode
times feed the scheduler's cost models. Every error leaves as a ``ConductorError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from conductor.adapters.agents import AgentCallError, AgentFleet, AgentHandle, translate_rpc_error
from conductor.core.block_keys import BlockKey, compute_block_keys
from conductor.core.prefix_index import NodeId, PrefixIndex
from conductor.core.scheduler import (
    NodeState,
    Placement,
    Rejection,
    Scheduler,
    ScheduleRequest,
    Slo,
)
from conductor.errors import (
    ConductorError,
    GatewayTimeout,
    InvalidRequest,
    RateLimited,
    ServiceUnavailable,
    UpstreamError,
)
from kvc.v1 import node_agent_pb2 as pb

log = logging.getLogger("conductor.dispatch")

_FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    tenant: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingSpec
    slo: Slo


@dataclass(frozen=True, slots=True)
class UsageCounts:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class TokenDelta:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None  # "stop" | "length" on the last delta
    usage: UsageCounts | None  # on the last delta


@dataclass(frozen=True, slots=True)
class Outcome:
    """Where a request ran and what it reused, for metrics and tests."""

    prefill_node: str
    decode_node: str
    disaggregated: bool
    cached_tokens: int  # reused on the prefill node (incl. migrated blocks)
    migrated_tokens: int  # of those, pulled from another node for this request
    predicted_ttft_s: float


class RejectedBySchedule(RateLimited):
    """A scheduling rejection: the SLO cannot be met, or no node fits."""

    def __init__(self, rejection: Rejection) -> None:
        messages = {
            "ttft_slo": "The predicted time to first token exceeds the SLO; retry later.",
            "tbt_slo": "The predicted time between tokens exceeds the SLO; retry later.",
            "no_prefill_node": "No prefill node can take this request now.",
            "no_decode_node": "No decode node has room for this request now.",
        }
        codes = {
            "ttft_slo": "ttft_slo_unattainable",
            "tbt_slo": "tbt_slo_unattainable",
            "no_prefill_node": "insufficient_capacity",
            "no_decode_node": "insufficient_capacity",
        }
        super().__init__(
            messages[rejection.reason],
            retry_after_s=rejection.retry_after_s,
            reason=rejection.reason,
            code=codes[rejection.reason],
        )
        self.rejection = rejection


def _to_delta(msg: pb.GenerateResponse, cached_tokens: int) -> TokenDelta:
    usage = None
    if msg.HasField("usage"):
        usage = UsageCounts(
            prompt_tokens=msg.usage.prompt_tokens,
            completion_tokens=msg.usage.completion_tokens,
            cached_tokens=max(cached_tokens, msg.usage.cached_tokens),
        )
    return TokenDelta(
        token_ids=tuple(msg.token_ids),
        text=msg.text,
        finish_reason=_FINISH_NAMES.get(msg.finish_reason),
        usage=usage,
    )


def _map_error(exc: AgentCallError) -> ConductorError:
    if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(exc.message)
    if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return RateLimited(
            "No node has capacity for this request right now.",
            retry_after_s=1.0,
            reason="insufficient_capacity",
        )
    if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return GatewayTimeout("A node did not answer in time.")
    if exc.reason == "transfer":
        return UpstreamError(f"Moving the prompt's KV between nodes failed: {exc.message}")
    if exc.node_unreachable:
        return ServiceUnavailable("A node became unavailable.", retry_after_s=1.0)
    return UpstreamError(f"A node failed the request: {exc.message}")


class GenerationStream:
    """The running generation: iterate ``TokenDelta``s; ``aclose()`` cancels it."""

    def __init__(
        self,
        call: grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse],
        first: pb.GenerateResponse,
        outcome: Outcome,
        on_close: Callable[[list[float]], None],
    ) -> None:
        self._call = call
        self._pending: pb.GenerateResponse | None = first
        self.outcome = outcome
        self._on_close = on_close
        self._closed = False
        self._finished = False
        self._last_token_at = time.perf_counter()
        self._gaps_s: list[float] = []

    def __aiter__(self) -> GenerationStream:
        return self

    @property
    def mean_gap_s(self) -> float | None:
        """Mean time between streamed tokens so far (None before the second token)."""
        return sum(self._gaps_s) / len(self._gaps_s) if self._gaps_s else None

    async def __anext__(self) -> TokenDelta:
        if self._finished:
            raise StopAsyncIteration
        if self._pending is not None:
            msg, self._pending = self._pending, None
        else:
            try:
                read = await self._call.read()
            except grpc.aio.AioRpcError as exc:
                await self.aclose()
                raise _map_error(translate_rpc_error(self.outcome.decode_node, exc)) from exc
            if read is grpc.aio.EOF:
                await self.aclose()
                raise UpstreamError("the decode node ended the stream without a finish reason")
            assert isinstance(read, pb.GenerateResponse)
            msg = read
            now = time.perf_counter()
            self._gaps_s.append(now - self._last_token_at)
            self._last_token_at = now
        delta = _to_delta(msg, self.outcome.cached_tokens)
        if delta.finish_reason is not None:
            self._finished = True
            await self.aclose()
        return delta

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._finished:
            self._call.cancel()
        self._on_close(self._gaps_s)


class Dispatcher:
    """Schedules and runs generations; owns the cleanup tasks it starts."""

    def __init__(
        self,
        fleet: AgentFleet,
        index: PrefixIndex,
        scheduler: Scheduler,
        *,
        model: str,
        lease_s: float,
        rpc_timeout_s: float,
        request_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        observe_decision_s: Callable[[float], None] | None = None,
    ) -> None:
        self._fleet = fleet
        self._index = index
        self.scheduler = scheduler
        self._model = model
        self._lease_s = lease_s
        self._rpc_timeout_s = rpc_timeout_s
        self._request_timeout_s = request_timeout_s
        self._clock = clock
        self._observe_decision_s = observe_decision_s
        # Keys of this conductor's open prefill Txs per node: prefixes being computed
        # right now, which kv_adaptive counts as that node's prefix (a FIFO prefill queued
        # behind them reuses them). Entries live only while their Tx is open.
        self._inflight_keys: dict[str, Counter[BlockKey]] = {}
        self._cleanup: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ helpers
    async def _shielded(self, coro: Awaitable[None]) -> None:
        """Run cleanup to completion even if the caller is being cancelled."""

        async def run() -> None:
            await coro

        task = asyncio.create_task(run())
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(task)

    async def _abort_tx(self, agent: AgentHandle, tx_id: str) -> None:
        try:
            await agent.stub.TxAbort(pb.TxAbortRequest(tx_id=tx_id), timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            # The node-side lease frees the blocks if this abort is lost.
            log.warning("TxAbort %s on %s failed: %s", tx_id, agent.address, exc.details())

    async def _commit_quietly(self, agent: AgentHandle, tx_id: str) -> None:
        try:
            await agent.stub.TxCommit(pb.TxCommitRequest(tx_id=tx_id), timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.warning("TxCommit %s on %s failed: %s", tx_id, agent.address, exc.details())

    async def drain(self) -> None:
        if self._cleanup:
            await asyncio.gather(*self._cleanup, return_exceptions=True)

    def block_size(self) -> int | None:
        sizes = [a.info.block_size for a in self._fleet.handles() if a.usable and a.info]
        return min(sizes) if sizes else None

    def node_states(self, block_size: int, excluded: set[str]) -> list[NodeState]:
        states = []
        for agent in self._fleet.handles():
            info = agent.info
            if info is None or agent.address in excluded:
                continue
            load = agent.load
            states.append(
                NodeState(
                    node_id=NodeId(agent.address),
                    role=agent.role,
                    healthy=agent.usable and info.block_size == block_size,
                    block_size=info.block_size,
                    capacity_blocks=info.capacity_blocks,
                    free_blocks=load.free_blocks if load else info.capacity_blocks,
                    kv_bytes_per_token=info.kv_layout.bytes_per_token,
                    # Engines that own their KV (vLLM) cannot lend or receive pool blocks.
                    kv_migration=info.engine == "embedded",
                    queued_prefill_tokens=load.queued_prefill_tokens if load else 0,
                    running_requests=load.running_requests if load else 0,
                )
            )
        return states

    def _track(self, node: str, keys: list[BlockKey], delta: int) -> None:
        counts = self._inflight_keys.setdefault(node, Counter())
        counts.update(dict.fromkeys(keys, delta))
        for key in [k for k in keys if counts[k] <= 0]:
            del counts[key]
        if not counts:
            del self._inflight_keys[node]

    def pending_blocks(self, keys: list[BlockKey]) -> dict[NodeId, int]:
        """Per node, the leading blocks of ``keys`` that an open prefill Tx is computing."""
        out: dict[NodeId, int] = {}
        for node, counts in self._inflight_keys.items():
            n = 0
            for key in keys:
                if key not in counts:
                    break
                n += 1
            if n:
                out[NodeId(node)] = n
        return out

    # ------------------------------------------------------------------ entry point
    async def start(self, req: GenerationRequest) -> GenerationStream:
        """Schedule the request and return once its first token has been produced."""
        decision_started = time.perf_counter()
        block_size = self.block_size()
        if block_size is None:
            raise ServiceUnavailable(
                "No prefill and decode capable node is available.", retry_after_s=2.0
            )
        keys = compute_block_keys(
            req.prompt_ids[:-1], tenant=req.tenant, model=self._model, block_size=block_size
        )
        prefix = self._index.match(keys)
        sreq = ScheduleRequest(
            request_id=req.request_id,
            prompt_tokens=len(req.prompt_ids),
            prefix_blocks=prefix,
            max_new_tokens=req.sampling.max_tokens,
            slo=req.slo,
            pending_blocks=self.pending_blocks(keys),
        )
        excluded: set[str] = set()
        last: AgentCallError | None = None
        while True:
            nodes = self.node_states(block_size, excluded)
            decision = self.scheduler.schedule(sreq, nodes, self._clock())
            if self._observe_decision_s is not None and not excluded:
                self._observe_decision_s(time.perf_counter() - decision_started)
            if isinstance(decision, Rejection):
                if decision.reason in ("no_prefill_node", "no_decode_node") and last is not None:
                    raise _map_error(last) from last
                if decision.reason in ("no_prefill_node", "no_decode_node") and not any(
                    n.healthy for n in nodes
                ):
                    raise ServiceUnavailable(
                        "No prefill and decode capable node is available.", retry_after_s=2.0
                    )
                raise RejectedBySchedule(decision)
            self.scheduler.on_assigned(sreq, decision, self._clock())
            try:
                return await self._attempt(req, keys, decision)
            except AgentCallError as exc:
                self.scheduler.on_finished(req.request_id, decision.prefill, decision.decode)
                last = exc
                if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED or exc.reason == "draining":
                    excluded.add(exc.address)  # busy or leaving: schedule among the others
                    continue
                if exc.node_unreachable:
                    self._fleet.mark_unreachable(exc.address, exc.message)
                    excluded.add(exc.address)
                    continue
                raise _map_error(exc) from exc
            except BaseException:
                self.scheduler.on_finished(req.request_id, decision.prefill, decision.decode)
                raise

    # ------------------------------------------------------------------ one attempt
    async def _migrate(
        self,
        req: GenerationRequest,
        keys: list[BlockKey],
        placement: Placement,
        prefill: AgentHandle,
        tx_id: str,
        local_blocks: int,
    ) -> int:
        """Pull the prefix from its holder onto the prefill node; return blocks copied.

        Best effort: any failure leaves the destination recomputing those blocks.
        """
        migration = placement.migration
        assert migration is not None
        source = self._fleet.get(migration.source)
        src_tx = f"{tx_id}:src"
        locked = 0
        try:
            lock = await source.stub.TxAllocate(
                pb.TxAllocateRequest(
                    tx_id=src_tx,
                    tenant=req.tenant,
                    block_keys=keys[: migration.blocks],
                    lease_s=self._lease_s,
                    mode=pb.TX_MODE_LOCK_ONLY,
                ),
                timeout=self._rpc_timeout_s,
            )
            locked = lock.reused_blocks
            if locked <= local_blocks:
                return 0
            pulled = await prefill.stub.PullBlocks(
                pb.PullBlocksRequest(
                    tx_id=tx_id,
                    source_address=source.info.advertise_address if source.info else source.address,
                    source_tx_id=src_tx,
                    num_blocks=locked,
                ),
                timeout=self._request_timeout_s,
            )
            self.scheduler.transfer.observe(
                migration.source, placement.prefill, pulled.bytes, pulled.transfer_s
            )
            return int(pulled.blocks_copied)
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "migration %s → %s failed (%s); recomputing", source.address, prefill.address,
                exc.details(),
            )  # fmt: skip
            return 0
        finally:
            if locked:  # paired Tx: the holder commits too, which only releases its locks
                await self._shielded(self._commit_quietly(source, src_tx))

    async def _attempt(
        self, req: GenerationRequest, keys: list[BlockKey], placement: Placement
    ) -> GenerationStream:
        prefill = self._fleet.get(placement.prefill)
        decode = self._fleet.get(placement.decode)
        assert prefill.info is not None
        block_size = prefill.info.block_size
        tx_id = f"{req.request_id}:{uuid.uuid4().hex[:12]}"
        disaggregated = decode is not prefill
        release = [prefill, decode] if disaggregated else [prefill]
        for agent in release:
            agent.inflight += 1
        call: grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse] | None = None
        tx_open = False
        tracked = False  # keys counted in _inflight_keys
        address = prefill.address
        prompt_len = len(req.prompt_ids)
        released = False

        def release_books() -> None:
            nonlocal released
            if not released:
                released = True
                for agent in release:
                    agent.inflight -= 1

        try:
            reused_blocks = migrated = 0
            if keys:
                alloc = await prefill.stub.TxAllocate(
                    pb.TxAllocateRequest(
                        tx_id=tx_id,
                        tenant=req.tenant,
                        block_keys=keys,
                        lease_s=self._lease_s,
                        mode=pb.TX_MODE_ALLOCATE,
                    ),
                    timeout=self._rpc_timeout_s,
                )
                tx_open = True
                self._track(prefill.address, keys, +1)
                tracked = True
                reused_blocks = alloc.reused_blocks
                if placement.migration is not None:
                    migrated = await self._migrate(
                        req, keys, placement, prefill, tx_id, reused_blocks
                    )
            else:
                tx_id = ""  # shorter than one block: nothing to own, no Tx needed
            cached_tokens = max(reused_blocks, migrated) * block_size
            sampling = pb.SamplingParams(
                temperature=req.sampling.temperature,
                top_p=req.sampling.top_p,
                max_tokens=req.sampling.max_tokens,
                stop=list(req.sampling.stop),
                ignore_eos=req.sampling.ignore_eos,
            )
            if req.sampling.seed is not None:
                sampling.seed = req.sampling.seed
            gen = pb.GenerateRequest(
                request_id=req.request_id,
                tenant=req.tenant,
                prompt_token_ids=req.prompt_ids,
                sampling=sampling,
            )
            if disaggregated:
                pre = await prefill.stub.Prefill(
                    pb.PrefillRequest(
                        request_id=req.request_id,
                        tenant=req.tenant,
                        tx_id=tx_id,
                        prompt_token_ids=req.prompt_ids,
                        stage_ttl_s=self._lease_s,
                    ),
                    timeout=self._request_timeout_s,
                )
                cached_tokens = pre.cached_tokens
                self.scheduler.on_prefill_done(
                    req.request_id, placement.prefill, prompt_len, pre.cached_tokens, pre.prefill_s
                )
                gen.kv_source.CopyFrom(
                    pb.KvSource(
                        address=prefill.info.advertise_address,
                        request_id=req.request_id,
                        num_tokens=prompt_len - 1,
                        # vLLM P/D: the decode engine pulls the KV itself with these.
                        engine_transfer_params=pre.engine_transfer_params,
                    )
                )
            else:
                gen.tx_id = tx_id
            address = decode.address
            call = decode.stub.Generate(gen, timeout=self._request_timeout_s)
            first = await call.read()
            if first is grpc.aio.EOF:
                raise AgentCallError(
                    decode.address, grpc.StatusCode.INTERNAL, "empty generation stream", None
                )
            assert isinstance(first, pb.GenerateResponse)
            timings = first.timings
            if not disaggregated:
                self.scheduler.on_prefill_done(
                    req.request_id, placement.prefill, prompt_len, cached_tokens, timings.prefill_s
                )
            elif timings.transfer_bytes:
                self.scheduler.transfer.observe(
                    placement.prefill, placement.decode, timings.transfer_bytes, timings.transfer_s
                )
            self.scheduler.on_decode_started(req.request_id, placement.decode, self._clock())
            # Mooncake §5.3: commit when the first decode token arrives.
            address = prefill.address
            if tx_open:
                self._track(prefill.address, keys, -1)
                tracked = False
                await prefill.stub.TxCommit(
                    pb.TxCommitRequest(tx_id=tx_id), timeout=self._rpc_timeout_s
                )
                tx_open = False
        except BaseException as exc:
            if call is not None:
                call.cancel()
            if tracked:
                self._track(prefill.address, keys, -1)
            if tx_open:
                await self._shielded(self._abort_tx(prefill, tx_id))
            release_books()
            if isinstance(exc, grpc.aio.AioRpcError):
                raise translate_rpc_error(address, exc) from exc
            raise

        def on_close(gaps_s: list[float]) -> None:
            release_books()
            batch, context = self.scheduler.active_decodes(placement.decode)
            if gaps_s:
                mean_gap = sum(gaps_s) / len(gaps_s)
                self.scheduler.observe_tbt(placement.decode, max(1, batch), context, mean_gap)
            self.scheduler.on_finished(req.request_id, placement.prefill, placement.decode)

        outcome = Outcome(
            prefill_node=placement.prefill,
            decode_node=placement.decode,
            disaggregated=disaggregated,
            cached_tokens=cached_tokens,
            migrated_tokens=min(migrated * block_size, cached_tokens),
            predicted_ttft_s=placement.ttft_s,
        )
        return GenerationStream(call, first, outcome, on_close)
