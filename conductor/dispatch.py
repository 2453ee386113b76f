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
   Without a migration, on an agent that advertises ``fused_tx``, the allocation rides
   in the call that does the work and the agent commits: colocated, ``Generate`` commits
   before the first token leaves; disaggregated, ``Prefill`` commits once the KV is
   computed and staged (valid cache whatever happens to the decode). A call that fails
   first aborts its Tx on the agent.
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
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import grpc

from conductor.adapters.agents import (
    AgentCallError,
    AgentFleet,
    AgentHandle,
    StreamingCall,
    translate_rpc_error,
)
from conductor.core.placement import (
    FailureKind,
    PlacementLoop,
    Refusal,
    RequestPlacement,
    Wait,
    fleet_view,
)
from conductor.core.prefix_index import NodeId, PrefixIndex
from conductor.core.scheduler import (
    LendWait,
    NodeState,
    Placement,
    Scheduler,
    ScheduleRequest,
)
from conductor.core.tier_index import LowerTierIndex
from conductor.errors import (
    ConductorError,
    RateLimited,
    ServiceUnavailable,
)
from conductor.generation import (
    Breakpoint,
    GenerationRequest,
    GenerationStream,
    Placed,
    map_agent_error,
)
from conductor.refusals import RefusalLog
from kvc.block_keys import KEY_LAYOUT, BlockKey, compute_block_keys
from kvc.priors import DecodePrior, PrefillPrior
from kvc.v1 import node_agent_pb2 as pb
from kvc.wire import sampling_to_pb

_MAX_TX_LEASE_S = 600.0  # node_agent max_lease_s default; the settings cap lease_s here too
log = logging.getLogger("conductor.dispatch")


def _stop(task: asyncio.Task[None] | None) -> None:
    """Cancel ``task`` if any (a renewal in flight then lands on a closed tx: ignored)."""
    if task is not None:
        task.cancel()


def tx_lease_s(lease_s: float, predicted_ttft_s: float) -> float:
    """The lease of a request's Tx. It stays open until the first token (queue, prefill,
    hand-off): the configured lease plus twice the predicted TTFT, so a long prompt
    queued behind others does not outlive a fixed lease (seen live: a 134k-token prompt
    failed at commit after 30 s), within the agents' default ``max_lease_s``."""
    return min(_MAX_TX_LEASE_S, lease_s + 2.0 * max(0.0, predicted_ttft_s))


class DispatchTelemetry(Protocol):
    """What the dispatcher reports (``conductor.metrics.ConductorMetrics`` implements it)."""

    def observe_decision(self, seconds: float) -> None: ...

    def observe_prediction(
        self, quantity: str, role: str, predicted_s: float, actual_s: float
    ) -> None: ...

    def count_would_have_hit(self, tokens: int) -> None: ...

    def record_agent_call(self, method: str, code: str) -> None: ...


class RejectedBySchedule(RateLimited):
    """A scheduling rejection: the SLO cannot be met, or no node fits."""

    def __init__(self, refusal: Refusal) -> None:
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
            messages[refusal.reason],
            retry_after_s=refusal.retry_after_s,
            reason=refusal.reason,
            code=codes[refusal.reason],
        )


def _failure_kind(exc: AgentCallError) -> FailureKind | None:
    """How a node refusal excludes it for this request; None: not a node refusal."""
    if exc.reason == "draining":
        return FailureKind.DRAINING
    if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return FailureKind.BUSY if exc.reason == "busy" else FailureKind.CAPACITY
    if exc.node_unreachable:
        return FailureKind.UNREACHABLE
    return None


class Dispatcher:
    """Schedules and runs generations; owns the cleanup tasks it starts.

    The placement loop (retries, waiting, in-flight prefixes) is the pure core's
    ``PlacementLoop``; this class performs its decisions with gRPC calls.
    """

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
        max_waiting: int = 0,
        clock: Callable[[], float] = time.monotonic,
        telemetry: DispatchTelemetry | None = None,
        lower_tiers: LowerTierIndex | None = None,
        affinity_slack_s: float = 0.05,
        max_affinity_keys: int = 65_536,
        prompt_cache_min_tokens: int = 1024,
    ) -> None:
        self._fleet = fleet
        self._index = index
        self._lower = lower_tiers if lower_tiers is not None else LowerTierIndex()
        self.scheduler = scheduler
        self.loop = PlacementLoop(scheduler, max_waiting=max_waiting)
        self._model = model
        self._lease_s = lease_s
        self._rpc_timeout_s = rpc_timeout_s
        self._request_timeout_s = request_timeout_s
        self._clock = clock
        self._telemetry = telemetry
        self.refusals = RefusalLog()
        self._capacity_freed = asyncio.Event()
        self._streams: set[GenerationStream] = set()  # running generations
        self._cleanup: set[asyncio.Task[None]] = set()
        # prompt_cache_key → the prefill node its last request used (bounded, LRU).
        self._affinity: OrderedDict[tuple[str, str], NodeId] = OrderedDict()
        self._affinity_slack_s = affinity_slack_s
        self._max_affinity_keys = max_affinity_keys
        self._prompt_cache_min_tokens = prompt_cache_min_tokens
        # Per agent address: what its NodeState was built from, and the state. Rebuilt
        # only when one of those changes (a new NodeInfo or load report, ours in flight
        # or ended): was ~21 µs per node per request, O(fleet) (1.4 ms at 64 nodes).
        self._views: dict[str, tuple[_ViewKey, NodeState]] = {}

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

    def _free_capacity(self) -> None:
        """Wake requests waiting for capacity (a decode ended or an attempt let go)."""
        self._capacity_freed.set()
        self._capacity_freed = asyncio.Event()

    async def _wait_for_capacity(self, until_s: float) -> None:
        freed = self._capacity_freed
        delay = max(0.0, until_s - self._clock())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(freed.wait(), timeout=delay)

    async def drain(self) -> None:
        if self._cleanup:
            await asyncio.gather(*self._cleanup, return_exceptions=True)

    @property
    def lower_tiers(self) -> LowerTierIndex:
        """Which blocks each tiered node holds in host memory or on disk (read-only use)."""
        return self._lower

    def node_states(self) -> list[NodeState]:
        """What every polled agent last reported: the placement loop's fleet view.

        An agent's state is built again only when what it is built from changed: its
        NodeInfo or load report (new messages on every poll and report; never changed
        in place), reachability, the model check, or this conductor's work on it in
        flight or ended since the report.
        """
        states = []
        views = self._views
        handles = self._fleet.handles()
        if len(views) > len(handles):  # agents removed: forget their views
            kept = {agent.address for agent in handles}
            for address in [a for a in views if a not in kept]:
                del views[address]
        for agent in handles:
            info = agent.info
            if info is None:
                continue
            key: _ViewKey = (
                info,
                agent.load,
                agent.reachable,
                agent.compatible,
                agent.inflight,
                agent.ended_prefill_tokens,
                agent.ended_generations,
            )
            seen = views.get(agent.address)
            if seen is not None and seen[0] == key:  # identical, or equal messages
                state = seen[1]
            else:
                state = self._node_state(agent, info, seen is None or seen[0][0] != info)
            views[agent.address] = (key, state)  # the newest messages: compared by identity
            states.append(state)
        return states

    def _node_state(self, agent: AgentHandle, info: pb.NodeInfo, new_info: bool) -> NodeState:
        node = NodeId(agent.address)
        if new_info and info.HasField("calibration"):
            cal = info.calibration
            self.scheduler.set_measured_priors(
                node,
                PrefillPrior(
                    cal.prefill_fixed_s, cal.prefill_per_token_s,
                    cal.prefill_per_token_context_s,
                ),
                DecodePrior(
                    cal.decode_fixed_s, cal.decode_per_request_s,
                    cal.decode_per_context_token_s,
                ),
            )  # fmt: skip
        load = agent.load
        free = load.free_blocks if load else info.capacity_blocks
        return NodeState(
            node_id=node,
            role=agent.role,
            healthy=agent.usable,
            block_size=info.block_size,
            capacity_blocks=info.capacity_blocks,
            free_blocks=free,
            allocatable_blocks=(
                max(free, load.allocatable_blocks) if load else info.capacity_blocks
            ),
            kv_bytes_per_token=info.kv_layout.bytes_per_token,
            # Pool payloads (embedded) or the engine's own connector (vLLM with
            # pd_connector); agents from before the flag: embedded only.
            kv_migration=info.kv_migration or info.engine == "embedded",
            kv_family=info.engine,
            lend_wait=_lend_wait(info),
            queued_prefill_tokens=agent.queued_prefill_tokens,
            running_requests=agent.running_requests,
            max_running_requests=info.max_running_requests,
            tier_read_bytes_per_s=_tier_bandwidth(load.tiers if load else info.tiers),
        )

    # ------------------------------------------------------------------ entry point
    async def start(self, req: GenerationRequest) -> GenerationStream:
        """Schedule the request and return once its first token has been produced."""
        decision_started = time.perf_counter()
        nodes = self.node_states()  # one view for the keys and the first decision
        block_size = fleet_view(nodes)[0]
        if block_size is None:
            raise ServiceUnavailable(
                "No prefill and decode capable node is available.", retry_after_s=2.0
            )
        prompt_ids = req.prompt_ids
        keys = compute_block_keys(
            prompt_ids, tenant=req.tenant, model=self._model, block_size=block_size,
            end=max(0, len(prompt_ids) - 1),
        )  # fmt: skip
        prefix_blocks = self._index.match(keys)
        sreq = ScheduleRequest(
            request_id=req.request_id,
            prompt_tokens=len(req.prompt_ids),
            prefix_blocks=prefix_blocks,
            tier_blocks=self._lower.hits(keys, prefix_blocks),
            max_new_tokens=req.sampling.max_tokens,
            slo=req.slo,
            length_key=(self._model, req.tenant),
            affinity=self._affinity.get((req.tenant, req.cache_key)) if req.cache_key else None,
            affinity_slack_s=self._affinity_slack_s,
        )
        arrived_s = self._clock()
        placement = self.loop.begin(sreq, keys, arrived_s)
        last: AgentCallError | None = None
        first_decision = True
        try:
            while True:
                step = placement.decide(nodes or self.node_states(), self._clock())
                nodes = []  # a later decision (after a wait or a refusal) looks again
                if first_decision and self._telemetry is not None:
                    self._telemetry.observe_decision(time.perf_counter() - decision_started)
                first_decision = False
                if isinstance(step, Wait):
                    await self._wait_for_capacity(step.until_s)
                    continue
                if isinstance(step, Refusal):
                    waited_s = max(0.0, self._clock() - arrived_s)
                    self.refusals.log_schedule(req.request_id, step, req.slo, waited_s)
                    if step.reason == "exhausted" and last is not None:
                        raise map_agent_error(last) from last
                    if step.reason in ("exhausted", "unavailable"):
                        raise ServiceUnavailable(
                            "No prefill and decode capable node is available.",
                            retry_after_s=2.0,
                        )
                    raise RejectedBySchedule(step)
                try:
                    return await self._attempt(req, keys, step, placement)
                except AgentCallError as exc:
                    kind = _failure_kind(exc)
                    if kind is None:
                        raise map_agent_error(exc) from exc
                    if kind is FailureKind.UNREACHABLE:
                        self._fleet.mark_unreachable(exc.address, exc.message)
                    last = exc
                    placement.failed(NodeId(exc.address), kind)
                    self._free_capacity()
        except BaseException:
            placement.finished()
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
                    grantee=prefill.info.node_id if prefill.info else "",  # who may read
                    key_layout=KEY_LAYOUT,
                ),
                timeout=self._rpc_timeout_s,
            )
            locked = lock.reused_blocks
            if locked <= local_blocks:
                return 0
            pull = pb.PullBlocksRequest(
                tx_id=tx_id,
                source_address=source.info.advertise_address if source.info else source.address,
                source_tx_id=src_tx,
                source_read_token=lock.read_token,
                num_blocks=locked,
            )
            if prefill.info is not None and prefill.info.engine != "embedded":
                # An engine that owns its KV (vLLM) loads the prefix by its tokens.
                block_size = prefill.info.block_size
                pull.prompt_token_ids.extend(req.prompt_ids[: locked * block_size])
            pulled = await prefill.stub.PullBlocks(pull, timeout=self._request_timeout_s)
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

    async def _keep_lease(self, agent: AgentHandle, tx_id: str, lease_s: float) -> None:
        """Renew the request's Tx every half lease until its first token: the lease is
        there to free the locks of a conductor that died, not of a request queued behind
        others (seen live: prefills queued behind a hot holder's lends outlived theirs).
        It also covers a slow prefix pull (given up after half the lease at most). A
        renewal that fails stops it (an older agent without ``TxExtend`` keeps its lease;
        a closed or expired tx is reported by the request's own calls)."""
        request = pb.TxExtendRequest(tx_id=tx_id, lease_s=lease_s)
        while True:
            await asyncio.sleep(lease_s / 2)
            try:
                await agent.stub.TxExtend(request, timeout=self._rpc_timeout_s)
            except grpc.aio.AioRpcError as exc:
                log.debug("renewing %s on %s failed: %s", tx_id, agent.address, exc.details())
                return

    async def _attempt(
        self,
        req: GenerationRequest,
        keys: list[BlockKey],
        placement: Placement,
        loop_state: RequestPlacement,
    ) -> GenerationStream:
        prefill = self._fleet.get(placement.prefill)
        decode = self._fleet.get(placement.decode)
        assert prefill.info is not None
        block_size = prefill.info.block_size
        # Unguessable (128 random bits): a tx id is what a peer's ReadBlocks names.
        # (``secrets.token_hex``: a fifth of ``uuid4().hex``'s cost, same width of hex.)
        tx_id = f"{req.request_id}:{secrets.token_hex(16)}"
        if req.cache_key:
            self._remember_affinity((req.tenant, req.cache_key), placement.prefill)
        disaggregated = decode is not prefill
        release = [prefill, decode] if disaggregated else [prefill]
        for agent in release:
            agent.inflight += 1
        call: StreamingCall | None = None
        tx_open = False
        keeper: asyncio.Task[None] | None = None  # renews the open Tx's lease meanwhile
        generating = False  # the Generate stream has sent its first message
        address = prefill.address
        prompt_len = len(req.prompt_ids)
        released = False
        started = time.perf_counter()

        def release_books() -> None:
            nonlocal released
            if not released:
                released = True
                for agent in release:
                    agent.inflight -= 1
                if generating:  # its node's next load report no longer counts it
                    decode.ended_generations += 1
                self._free_capacity()

        # Where the agent can (no migration to pull into the Tx first), the allocation
        # rides in the call that does the work and the agent commits: colocated, in
        # Generate before the first token; disaggregated, in Prefill once the KV is staged.
        fused = bool(keys) and placement.migration is None and prefill.info.fused_tx
        try:
            reused_blocks = migrated = 0
            kept = tuple(bp for bp in req.breakpoints if bp.tokens >= self._prompt_cache_min_tokens)
            retain = retention_of(kept, block_size, len(keys))
            # Breakpoints all too short (or inside the first block): nothing is retained.
            retention = "below_minimum" if req.breakpoints and not retain else "none"
            allocate = pb.TxAllocateRequest(
                tx_id=tx_id,
                tenant=req.tenant,
                block_keys=keys,
                lease_s=tx_lease_s(self._lease_s, placement.ttft_s),
                mode=pb.TX_MODE_ALLOCATE,
                retain=retain,
                key_layout=KEY_LAYOUT,
            )
            if fused:
                loop_state.allocated()
            elif keys:
                alloc = await prefill.stub.TxAllocate(allocate, timeout=self._rpc_timeout_s)
                tx_open = True
                keeper = asyncio.create_task(self._keep_lease(prefill, tx_id, allocate.lease_s))
                loop_state.allocated()
                reused_blocks = alloc.reused_blocks
                if retain:
                    retention = retention_name(alloc.retention)
                if placement.migration is not None:
                    try:
                        migrated = await self._migrate(
                            req, keys, placement, prefill, tx_id, reused_blocks
                        )
                    finally:
                        loop_state.pulled()
            else:
                tx_id = ""  # shorter than one block: nothing to own, no Tx needed
            cached_tokens = max(reused_blocks, migrated) * block_size
            gen = pb.GenerateRequest(
                request_id=req.request_id,
                tenant=req.tenant,
                prompt_token_ids=req.prompt_ids,
                sampling=sampling_to_pb(req.sampling),
            )
            if disaggregated:
                prefill_request = pb.PrefillRequest(
                    request_id=req.request_id,
                    tenant=req.tenant,
                    tx_id=tx_id,
                    stage_ttl_s=self._lease_s,
                    grantee=decode.info.node_id if decode.info else "",  # who may fetch
                )
                # From the Generate request's field, not the tuple again: a copy inside
                # protobuf (4 us at 8k ids) instead of a conversion per id (340 us).
                prefill_request.prompt_token_ids.extend(gen.prompt_token_ids)
                if fused:
                    prefill_request.tx.CopyFrom(allocate)
                pre = await self._fleet.prefill(
                    prefill, prefill_request, deadline_s=self._request_timeout_s
                )
                if fused:  # allocated and committed by the agent
                    loop_state.committed()
                    if retain:
                        retention = retention_name(pre.retention)
                cached_tokens = pre.cached_tokens
                prefill.ended_prefill_tokens += prompt_len
                loop_state.prefill_done(prompt_len, pre.cached_tokens, pre.prefill_s, self._clock())
                gen.kv_source.CopyFrom(
                    pb.KvSource(
                        address=prefill.info.advertise_address,
                        request_id=req.request_id,
                        stage_handle=pre.stage_handle,
                        num_tokens=prompt_len - 1,
                        # vLLM P/D: the decode engine pulls the KV itself with these.
                        engine_transfer_params=pre.engine_transfer_params,
                    )
                )
            else:
                gen.tx_id = tx_id
                if fused:
                    gen.tx.CopyFrom(allocate)
            address = decode.address
            call = decode.generate(gen, timeout=self._request_timeout_s)
            first = await call.read()
            if first is grpc.aio.EOF:
                raise AgentCallError(
                    decode.address, grpc.StatusCode.INTERNAL, "empty generation stream", None
                )
            assert isinstance(first, pb.GenerateResponse)
            generating = True
            if self._telemetry is not None:
                self._telemetry.record_agent_call("Generate", "OK")
            ttft_s = time.perf_counter() - started
            timings = first.timings
            if fused and not disaggregated:  # the agent allocated and has committed by now
                cached_tokens = timings.cached_tokens
                loop_state.committed()
                if retain:
                    retention = retention_name(timings.retention)
            if not disaggregated:  # the prompt left the node's prefill queue with this token
                decode.ended_prefill_tokens += prompt_len
                loop_state.prefill_done(prompt_len, cached_tokens, timings.prefill_s, self._clock())
            elif timings.transfer_bytes:
                self.scheduler.transfer.observe(
                    placement.prefill, placement.decode, timings.transfer_bytes, timings.transfer_s
                )
            loop_state.decode_started(self._clock())
            # Mooncake §5.3: commit when the first decode token arrives.
            address = prefill.address
            if tx_open:
                loop_state.committed()
                _stop(keeper)
                await prefill.stub.TxCommit(
                    pb.TxCommitRequest(tx_id=tx_id), timeout=self._rpc_timeout_s
                )
                tx_open = False
        except BaseException as exc:
            _stop(keeper)
            if call is not None:
                rpc_error = exc if isinstance(exc, grpc.aio.AioRpcError) else None
                if rpc_error is not None and not generating and self._telemetry is not None:
                    self._telemetry.record_agent_call("Generate", rpc_error.code().name)
                call.cancel()
            loop_state.committed()  # its keys are no longer being computed there
            if tx_open:
                await self._shielded(self._abort_tx(prefill, tx_id))
            release_books()
            if isinstance(exc, grpc.aio.AioRpcError):
                raise translate_rpc_error(address, exc) from exc
            raise

        placed = Placed(
            prefill_node=placement.prefill,
            decode_node=placement.decode,
            prefill_role=prefill.role,
            decode_role=decode.role,
            cached_tokens=cached_tokens,
            migrated_tokens=min(migrated * block_size, cached_tokens),
            would_have_hit_tokens=loop_state.would_have_hit_blocks * block_size,
            retention=retention,
            breakpoints=kept if retain else (),
        )
        telemetry = self._telemetry
        if telemetry is not None:
            telemetry.observe_prediction("ttft", placed.prefill_role, placement.ttft_s, ttft_s)
            if placed.would_have_hit_tokens:
                telemetry.count_would_have_hit(placed.would_have_hit_tokens)

        stream: GenerationStream

        def on_close(gaps_s: list[float], tokens: int, finish_reason: str | None) -> None:
            self._streams.discard(stream)
            release_books()
            mean_gap = sum(gaps_s) / len(gaps_s) if gaps_s else None
            if mean_gap is not None and telemetry is not None:
                telemetry.observe_prediction("tbt", placed.decode_role, placement.tbt_s, mean_gap)
            loop_state.finished(
                tokens, stopped=finish_reason == "stop", now_s=self._clock(), mean_gap_s=mean_gap
            )

        stream = GenerationStream(call, first, placed, on_close)
        self._streams.add(stream)
        return stream

    def _remember_affinity(self, key: tuple[str, str], node: NodeId) -> None:
        self._affinity[key] = node
        self._affinity.move_to_end(key)
        if len(self._affinity) > self._max_affinity_keys:
            self._affinity.popitem(last=False)

    def interrupt_streams(self, error: ConductorError) -> int:
        """End every running generation with ``error`` (shutdown deadline): a stream
        sends it as its last event and [DONE]. Returns how many were running."""
        streams = list(self._streams)
        for stream in streams:
            stream.interrupt(error)
        return len(streams)


_RETENTION_NAMES = {
    pb.RETENTION_STATUS_NONE: "none",
    pb.RETENTION_STATUS_GRANTED: "granted",
    pb.RETENTION_STATUS_OVER_BUDGET: "over_budget",
    pb.RETENTION_STATUS_NODE_FULL: "node_full",
    pb.RETENTION_STATUS_UNSUPPORTED: "unsupported",
    pb.RETENTION_STATUS_TOO_LONG: "too_long",
}


def retention_name(result: pb.RetentionResult) -> str:
    """A node's answer to a Tx's retention, as ``UsageCounts.retention`` names it (an
    agent that predates retention answers nothing: "unsupported")."""
    name = _RETENTION_NAMES.get(result.status, "unsupported")
    return "unsupported" if name == "none" else name


def retention_of(
    breakpoints: Sequence[Breakpoint], block_size: int, n_keys: int
) -> list[pb.Retention]:
    """The Tx's retention for ``breakpoints``: whole blocks only (a block a breakpoint
    cuts through is not retained), within the ``n_keys`` blocks the Tx holds, one entry
    per distinct length (the longest TTL)."""
    ttl_by_blocks: dict[int, float] = {}
    for bp in breakpoints:
        blocks = min(bp.tokens // block_size, n_keys)
        if blocks > 0:
            ttl_by_blocks[blocks] = max(ttl_by_blocks.get(blocks, 0.0), bp.ttl_s)
    return [pb.Retention(blocks=b, ttl_s=t) for b, t in sorted(ttl_by_blocks.items())]


# What an agent's NodeState is built from (``Dispatcher.node_states``): its NodeInfo and
# load report, reachable, model matches, ours in flight, prefill tokens and generations
# of ours ended since the report.
_ViewKey = tuple[pb.NodeInfo, pb.LoadUpdate | None, bool, bool, int, int, int]

_LEND_WAITS: dict[int, LendWait] = {
    pb.LEND_WAIT_NONE: "none",
    pb.LEND_WAIT_QUEUE: "queue",
    pb.LEND_WAIT_RUNNING: "running",
}


def _lend_wait(info: pb.NodeInfo) -> LendWait:
    """The node's ``lend_wait``; a value newer than this conductor: a full queue."""
    return _LEND_WAITS.get(info.lend_wait, "queue")


def _tier_bandwidth(tiers: Sequence[pb.KvTier]) -> tuple[float, float]:
    """(host, disk) read bandwidth a node reports; 0 for a tier it lacks or has not
    measured (the cost model then charges its default)."""
    host = disk = 0.0
    for tier in tiers:
        if tier.medium == pb.KV_MEDIUM_HOST:
            host = tier.read_bytes_per_s
        elif tier.medium == pb.KV_MEDIUM_DISK:
            disk = tier.read_bytes_per_s
    return host, disk
