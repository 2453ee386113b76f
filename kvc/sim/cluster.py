"""A simulated fleet driven by the real conductor core, request by request, in virtual time.

What it runs (the live ``conductor/dispatch.py`` flow, with RPCs replaced by calls)
    1. Arrival: block keys from the trace's ``hash_ids`` (``BlockKey(id)``, tenant
       ``"trace"``); ``PrefixIndex.match`` over the shadow index → prefix per node.
    2. ``Scheduler.schedule(req, nodes, now)`` (Algorithm 1 + admission). A ``Rejection``
       is a 429 before any work. Otherwise ``on_assigned``.
    3. ``TxAllocate`` (ALLOCATE) of every key on the chosen prefill node's ``BlockPool``.
       ``CapacityExhausted`` → ``on_finished``, the node is excluded and the request is
       scheduled again among the rest (as the dispatcher does on RESOURCE_EXHAUSTED).
    4. A ``Migration``: ``TxAllocate(LOCK_ONLY)`` of the prefix on the holder; when it
       locked more than the destination already reuses, the blocks travel holder →
       destination over both NICs, ``scheduler.transfer.observe`` learns from it and the
       holder's tx commits (releasing its locks); the destination's job may not start
       before. Otherwise the holder's tx commits at once and nothing moves.
    5. Prefill (FIFO on the node): cached prefix counted when it starts; duration from the
       profile (truth); the prompt's KV streams to the decode node during the prefill.
       At the end: ``TxCommit`` (new blocks become reusable prefix) and
       ``on_prefill_done(request_id, node, total, cached, duration_s)``.
    6. The KV has reached the decode node → first token (TTFT), ``on_decode_started``;
       the decode node batches it until ``output_length`` tokens exist. Then
       ``observe_tbt(node, batch, context, mean gap)`` with the scheduler's own view of the
       batch, and ``on_finished``. A request of one output token ends at its prefill.
    7. After every pool operation the pool's ``take_events()`` become the node's event
       stream (epoch + sequence numbers) and reach ``PrefixIndex.apply`` after
       ``index_event_delay_s`` (0: at once). A gap or bound overflow → resync from a
       snapshot (``reset_node``), like the live shadow.

    For ``kv_adaptive`` the cluster also keeps, per node, the blocks its queued prefills
    are computing (from each ``TxAllocate``'s ``reused_blocks``, dropped at commit) and
    passes them as ``ScheduleRequest.pending_blocks`` — the conductor-side view that
    policy reads.

    The scheduler never sees the truth: it sees ``NodeState`` (queued prompt tokens,
    free KV blocks, running requests, as an agent reports them), the shadow index, and
    the durations its hooks are told.

Knobs (``ClusterConfig``)
    ``prefill_instances``, ``decode_instances``, ``block_tokens`` (a divisor of the
    trace's 512: each trace block becomes ``512 / block_tokens`` pool blocks with derived
    chained keys ``id * (512 / block_tokens) + j``), ``cache_tokens`` per prefill instance
    (None: the profile's) or ``unbounded_cache`` (the pool is sized to hold every block
    of the replayed requests: no eviction ever), ``index_event_delay_s``,
    ``decode_refuses`` (decode nodes refuse what does not fit or would break the TBT
    SLO), ``output_tokens`` (override every request's output length, e.g. 1),
    ``lease_s``, ``load_sample_s``.

Complexity
    Per request: O(blocks) for keys, matching, allocation and commit, plus the
    scheduler's O(P + D + A). Per decode step O(1) amortised. Events O(R + steps).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from pydantic import ConfigDict

from conductor.core.block_keys import BlockKey
from conductor.core.prefix_index import ApplyOutcome, NodeId, PrefixIndex
from conductor.core.scheduler import (
    NodeState,
    Placement,
    Policy,
    Rejection,
    Scheduler,
    SchedulerConfig,
    ScheduleRequest,
    Slo,
)
from kvc.sim.engine import EventLoop
from kvc.sim.instances import (
    DecodeInstance,
    DecodeSeq,
    IndexEvent,
    PrefillInstance,
    PrefillJob,
    reserve_transfer,
)
from kvc.sim.metrics import LoadSample, Outcome, RequestRecord, SimResult, top_decile_mean
from kvc.sim.profile import Profile
from kvc.sim.trace import TRACE_BLOCK_TOKENS, TraceRequest, cached_tokens
from node_agent.blocks.pool import AllocateParams, CapacityExhausted, TxMode

__all__ = ["TENANT", "Cluster", "ClusterConfig", "simulate"]

TENANT = "trace"

Progress = Callable[[int, int, float], None]  # (arrived, total, virtual now)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(extra="forbid")

    prefill_instances: int
    decode_instances: int
    block_tokens: int = TRACE_BLOCK_TOKENS
    cache_tokens: int | None = None
    unbounded_cache: bool = False
    index_event_delay_s: float = 0.0
    decode_refuses: bool = False
    output_tokens: int | None = None
    lease_s: float = 86_400.0
    load_sample_s: float = 5.0

    def __post_init__(self) -> None:
        if self.prefill_instances <= 0 or self.decode_instances <= 0:
            raise ValueError("a cluster needs at least one prefill and one decode instance")
        if self.block_tokens <= 0 or TRACE_BLOCK_TOKENS % self.block_tokens:
            raise ValueError(f"block_tokens must divide {TRACE_BLOCK_TOKENS}")
        if self.cache_tokens is not None and self.cache_tokens < self.block_tokens:
            raise ValueError("cache_tokens must hold at least one block")
        if self.index_event_delay_s < 0 or self.load_sample_s <= 0 or self.lease_s <= 0:
            raise ValueError("delays must be >= 0, sample interval and lease > 0")
        if self.output_tokens is not None and self.output_tokens < 1:
            raise ValueError("output_tokens must be >= 1")


class _Flight:
    """Everything known about one request while it is in the system (mutable)."""

    __slots__ = (
        "arrival_s",
        "cached_tokens",
        "computing",
        "decode",
        "handoff_at_s",
        "job",
        "keys",
        "migrated_tokens",
        "output_tokens",
        "placement",
        "prefill",
        "prefill_end_s",
        "prefill_s",
        "req",
        "sreq",
        "ttft_s",
    )

    def __init__(self, req: TraceRequest, keys: tuple[BlockKey, ...], output_tokens: int) -> None:
        self.req = req
        self.arrival_s = 0.0  # virtual (speed applied)
        self.job: PrefillJob | None = None
        self.keys = keys
        self.computing: tuple[BlockKey, ...] = ()  # keys it allocated fresh (in flight)
        self.output_tokens = output_tokens
        self.sreq: ScheduleRequest | None = None
        self.placement: Placement | None = None
        self.prefill: PrefillInstance | None = None
        self.decode: DecodeInstance | None = None
        self.cached_tokens = 0
        self.migrated_tokens = 0
        self.prefill_s = 0.0
        self.prefill_end_s = 0.0
        self.handoff_at_s = 0.0
        self.ttft_s: float | None = None


class Cluster:
    """Prefill and decode instances, one ``Scheduler`` and one ``PrefixIndex``."""

    def __init__(
        self,
        profile: Profile,
        config: ClusterConfig,
        scheduler_config: SchedulerConfig,
        slo: Slo,
        requests: Sequence[TraceRequest] = (),
    ) -> None:
        self.profile = profile
        self.config = config
        self.slo = slo
        self.loop = EventLoop()
        self.scheduler = Scheduler(scheduler_config)
        self.index = PrefixIndex()
        self._sub = TRACE_BLOCK_TOKENS // config.block_tokens
        capacity_blocks = self._capacity_blocks(requests)
        self.prefill: dict[NodeId, PrefillInstance] = {}
        for i in range(config.prefill_instances):
            node = NodeId(f"prefill-{i:02d}")
            inst = PrefillInstance(
                node, profile, capacity_blocks, config.block_tokens, self.loop.clock,
                max_lease_s=config.lease_s,
            )  # fmt: skip
            self.prefill[node] = inst
            self.index.reset_node(node, inst.epoch, 0, ())
        self.decode: dict[NodeId, DecodeInstance] = {}
        for i in range(config.decode_instances):
            node = NodeId(f"decode-{i:02d}")
            self.decode[node] = DecodeInstance(
                node, profile, config.block_tokens, self.loop.at, self.loop.clock,
                refuse=config.decode_refuses, tbt_slo_s=slo.tbt_s,
            )  # fmt: skip
        # Blocks each node's queued prefills are computing (allocated, not committed),
        # with reference counts: the conductor-side view ``kv_adaptive`` reads.
        self._inflight: dict[NodeId, dict[BlockKey, int]] = {n: {} for n in self.prefill}
        self._track_inflight = scheduler_config.policy is Policy.KV_ADAPTIVE
        self._records: list[RequestRecord] = []
        self._samples: list[LoadSample] = []
        self._in_flight = 0
        self._arrived = 0
        self._to_arrive = 0
        self._migrations = 0
        self._migrated_blocks = 0
        self._resyncs = 0

    def _capacity_blocks(self, requests: Sequence[TraceRequest]) -> int:
        if self.config.unbounded_cache:
            distinct = len({h for r in requests for h in r.hash_ids})
            return max(1, distinct * self._sub)
        tokens = self.config.cache_tokens or self.profile.prefill.cache_tokens
        return max(1, tokens // self.config.block_tokens)

    # ------------------------------------------------------------------ driving
    def run(
        self, requests: Sequence[TraceRequest], speed: float = 1.0, progress: Progress | None = None
    ) -> SimResult:
        """Replay ``requests`` (arrivals divided by ``speed``) until every one is done."""
        if speed <= 0:
            raise ValueError("speed must be > 0")
        started = time.perf_counter()
        total = len(requests)
        self._to_arrive = total
        step = max(1, total // 200)

        def arrival(req: TraceRequest) -> Callable[[], None]:
            def fire() -> None:
                self._arrive(req)
                if progress is not None and (self._arrived % step == 0 or self._arrived == total):
                    progress(self._arrived, total, self.loop.now_s)

            return fire

        origin = requests[0].arrival_s if requests else 0.0
        for req in requests:
            self.loop.at((req.arrival_s - origin) / speed, arrival(req))
        if requests:
            self.loop.at(0.0, self._sample)
        self.loop.run()
        self._records.sort(key=lambda r: (r.arrival_s, r.request_id))
        return SimResult(
            records=tuple(self._records),
            samples=tuple(self._samples),
            migrations=self._migrations,
            migrated_blocks=self._migrated_blocks,
            virtual_s=self.loop.now_s,
            events=self.loop.events_run,
            wall_s=time.perf_counter() - started,
            prefill_busy_s=sum(p.busy_s for p in self.prefill.values()),
            prefill_instances=len(self.prefill),
        )

    def keys_of(self, req: TraceRequest) -> tuple[BlockKey, ...]:
        sub = self._sub
        if sub == 1:
            return tuple(BlockKey(h) for h in req.hash_ids)
        n_blocks = -(-req.input_tokens // self.config.block_tokens)
        keys = [BlockKey(h * sub + j) for h in req.hash_ids for j in range(sub)]
        return tuple(keys[:n_blocks])

    # ------------------------------------------------------------------ node views
    def node_states(self, excluded: set[NodeId]) -> list[NodeState]:
        """What the agents would report now (the scheduler's only view of the fleet)."""
        bt = self.config.block_tokens
        kvb = self.profile.kv_bytes_per_token
        states = []
        for node, p in self.prefill.items():
            if node in excluded:
                continue
            stats = p.pool.stats()
            states.append(
                NodeState(
                    node_id=node,
                    role="prefill",
                    healthy=True,
                    block_size=bt,
                    capacity_blocks=stats.capacity_blocks,
                    free_blocks=stats.free_blocks + stats.evictable_blocks,
                    kv_bytes_per_token=kvb,
                    queued_prefill_tokens=p.queued_tokens,
                    running_requests=len(p.queue) + (p.running is not None),
                )
            )
        for node, d in self.decode.items():
            states.append(
                NodeState(
                    node_id=node,
                    role="decode",
                    healthy=True,
                    block_size=bt,
                    capacity_blocks=d.capacity_tokens // bt,
                    free_blocks=d.free_blocks,
                    kv_bytes_per_token=kvb,
                    running_requests=d.running_requests,
                )
            )
        return states

    # ------------------------------------------------------------------ index stream
    def _publish(self, inst: PrefillInstance) -> None:
        events = inst.drain_events()
        if not events:
            return
        delay = self.config.index_event_delay_s
        if delay <= 0:
            self._apply(inst, events)
        else:
            self.loop.after(delay, lambda: self._apply(inst, events))

    def _apply(self, inst: PrefillInstance, events: list[IndexEvent]) -> None:
        for ev in events:
            outcome = self.index.apply(
                inst.node_id, inst.epoch, ev.seq,
                stored=ev.stored, removed=ev.removed, cleared=ev.cleared,
            )  # fmt: skip
            if outcome is ApplyOutcome.RESYNC:
                # Snapshot as the live shadow would; later events of this batch are then
                # duplicates (seq <= snapshot's) and are ignored.
                self._resyncs += 1
                self.index.reset_node(
                    inst.node_id, inst.epoch, inst.last_seq, inst.pool.cached_keys()
                )
                return

    # ------------------------------------------------------------------ arrival
    def _arrive(self, req: TraceRequest) -> None:
        self._arrived += 1
        self._to_arrive -= 1
        out = self.config.output_tokens or req.output_tokens
        flight = _Flight(req, self.keys_of(req), max(1, out))
        flight.arrival_s = self.loop.now_s
        prefix = self.index.match(flight.keys)
        flight.sreq = ScheduleRequest(
            request_id=req.request_id,
            prompt_tokens=req.input_tokens,
            prefix_blocks=prefix,
            max_new_tokens=flight.output_tokens,
            slo=self.slo,
            pending_blocks=self._pending(flight.keys, prefix) if self._track_inflight else {},
        )
        self._in_flight += 1
        self._place(flight, set(), attempt=0)

    def _pending(self, keys: tuple[BlockKey, ...], prefix: dict[NodeId, int]) -> dict[NodeId, int]:
        """Per node: leading blocks cached there or being computed there right now."""
        out: dict[NodeId, int] = {}
        for node, inflight in self._inflight.items():
            i = prefix.get(node, 0)
            while i < len(keys) and keys[i] in inflight:
                i += 1
            if i:
                out[node] = i
        return out

    def _inflight_add(self, node: NodeId, keys: Sequence[BlockKey]) -> None:
        if self._track_inflight:
            counts = self._inflight[node]
            for key in keys:
                counts[key] = counts.get(key, 0) + 1

    def _inflight_remove(self, node: NodeId, keys: Sequence[BlockKey]) -> None:
        if self._track_inflight:
            counts = self._inflight[node]
            for key in keys:
                left = counts[key] - 1
                if left:
                    counts[key] = left
                else:
                    del counts[key]

    def _place(self, flight: _Flight, excluded: set[NodeId], attempt: int) -> None:
        sreq = flight.sreq
        assert sreq is not None
        now = self.loop.now_s
        while True:
            decision = self.scheduler.schedule(sreq, self.node_states(excluded), now)
            if isinstance(decision, Rejection):
                reason: str = decision.reason
                if excluded and reason in ("no_prefill_node", "no_decode_node"):
                    reason = "insufficient_capacity"
                self._finish(flight, "rejected", reason)
                return
            self.scheduler.on_assigned(sreq, decision, now)
            inst = self.prefill[decision.prefill]
            attempt += 1
            tx_id = f"{sreq.request_id}:{attempt}"
            try:
                alloc = inst.pool.tx_allocate(
                    AllocateParams(tx_id, TENANT, flight.keys, self.config.lease_s)
                )
            except CapacityExhausted:
                self.scheduler.on_finished(sreq.request_id, decision.prefill, decision.decode)
                excluded.add(decision.prefill)
                continue
            self._publish(inst)
            flight.computing = flight.keys[alloc.reused_blocks :]
            self._inflight_add(inst.node_id, flight.computing)
            flight.placement = decision
            flight.prefill = inst
            flight.decode = self.decode[decision.decode]
            job = PrefillJob(
                request_id=sreq.request_id,
                tx_id=tx_id,
                keys=flight.keys,
                handles=alloc.handles,
                input_tokens=sreq.prompt_tokens,
                on_start=lambda cached, duration: self._prefill_started(flight, cached, duration),
                on_done=lambda: self._prefill_done(flight),
            )
            flight.job = job
            inst.enqueue(job)
            if decision.migration is not None:
                self._migrate(flight, job, decision, alloc.reused_blocks)
            self._try_start(inst)
            return

    # ------------------------------------------------------------------ migration
    def _migrate(
        self, flight: _Flight, job: PrefillJob, placement: Placement, local_blocks: int
    ) -> None:
        migration = placement.migration
        assert migration is not None
        assert flight.prefill is not None
        src = self.prefill[migration.source]
        dst = flight.prefill
        src_tx = f"{job.tx_id}:src"
        lock = src.pool.tx_allocate(
            AllocateParams(
                src_tx, TENANT, flight.keys[: migration.blocks], self.config.lease_s,
                mode=TxMode.LOCK_ONLY,
            )
        )  # fmt: skip
        locked = lock.reused_blocks
        if locked <= local_blocks:
            src.pool.tx_commit(src_tx)  # paired tx: the holder commits, releasing locks
            self._publish(src)
            return
        nbytes = (
            (locked - local_blocks) * self.config.block_tokens * self.profile.kv_bytes_per_token
        )
        now = self.loop.now_s
        _start, arrive = reserve_transfer(self.profile, src.nic, dst.nic, nbytes, now)
        job.migrating = True
        self._migrations += 1

        def done() -> None:
            self.scheduler.transfer.observe(src.node_id, dst.node_id, nbytes, arrive - now)
            src.pool.tx_commit(src_tx)
            self._publish(src)
            job.migrating = False
            job.migrated_blocks = locked
            self._migrated_blocks += locked - local_blocks
            self._try_start(dst)

        self.loop.at(arrive, done)

    # ------------------------------------------------------------------ prefill
    def _try_start(self, inst: PrefillInstance) -> None:
        job = inst.next_ready()
        if job is None:
            return
        blocks = inst.cached_prefix_blocks(job)
        cached = cached_tokens(blocks, job.input_tokens, self.config.block_tokens)
        duration = inst.prefill_duration_s(job, blocks, cached)
        inst.busy_s += duration
        job.on_start(cached, duration)
        self.loop.after(duration, job.on_done)

    def _prefill_started(self, flight: _Flight, cached: int, duration: float) -> None:
        job, inst, dec = flight.job, flight.prefill, flight.decode
        assert job is not None
        assert inst is not None
        assert dec is not None
        now = self.loop.now_s
        flight.cached_tokens = cached
        flight.migrated_tokens = min(job.migrated_blocks * self.config.block_tokens, cached)
        flight.prefill_s = duration
        flight.prefill_end_s = now + duration
        if flight.output_tokens > 1:
            # The prompt's KV streams to the decode node while the prefill runs
            # (layer by layer); it is there one latency after the later of the two ends.
            nbytes = flight.req.input_tokens * self.profile.kv_bytes_per_token
            start, arrive = reserve_transfer(self.profile, inst.nic, dec.nic, nbytes, now)
            latency = self.profile.network.latency_s
            flight.handoff_at_s = max(flight.prefill_end_s + latency, arrive)
            self.scheduler.transfer.observe(inst.node_id, dec.node_id, nbytes, arrive - start)

    def _prefill_done(self, flight: _Flight) -> None:
        job, inst, placement = flight.job, flight.prefill, flight.placement
        assert job is not None
        assert inst is not None
        assert placement is not None
        inst.finish(job)
        inst.pool.tx_commit(job.tx_id)  # its blocks become reusable prefix
        self._publish(inst)
        self._inflight_remove(inst.node_id, flight.computing)
        self.scheduler.on_prefill_done(
            job.request_id, inst.node_id, job.input_tokens, flight.cached_tokens, flight.prefill_s
        )
        if flight.output_tokens <= 1:  # the prefill produced the only token
            now = self.loop.now_s
            flight.ttft_s = now - flight.arrival_s
            self.scheduler.on_decode_started(job.request_id, placement.decode, now)
            self.scheduler.on_finished(job.request_id, placement.prefill, placement.decode)
            self._finish(flight, "completed", None)
        else:
            self.loop.at(flight.handoff_at_s, lambda: self._handoff_done(flight))
        self._try_start(inst)

    # ------------------------------------------------------------------ decode
    def _handoff_done(self, flight: _Flight) -> None:
        dec, placement = flight.decode, flight.placement
        assert dec is not None
        assert placement is not None
        now = self.loop.now_s
        n_out = flight.output_tokens
        seq = DecodeSeq(
            request_id=flight.req.request_id,
            prompt_tokens=flight.req.input_tokens,
            steps_needed=n_out - 1,
            reserve_tokens=flight.req.input_tokens + n_out,
            first_token_s=now,
            on_done=lambda seq: self._decode_done(flight, seq),
        )
        if not dec.offer(seq):
            self.scheduler.on_finished(flight.req.request_id, placement.prefill, placement.decode)
            self._finish(flight, "rejected_after_prefill", "decode_refused")
            return
        flight.ttft_s = now - flight.arrival_s
        self.scheduler.on_decode_started(flight.req.request_id, placement.decode, now)

    def _decode_done(self, flight: _Flight, seq: DecodeSeq) -> None:
        dec, placement = flight.decode, flight.placement
        assert dec is not None
        assert placement is not None
        gaps = dec.gaps_s(seq)
        tbt = top_decile_mean(gaps)
        batch, context = self.scheduler.active_decodes(placement.decode)
        mean_gap = sum(gaps) / len(gaps)
        self.scheduler.observe_tbt(placement.decode, max(1, batch), context, mean_gap)
        self.scheduler.on_finished(flight.req.request_id, placement.prefill, placement.decode)
        self._finish(flight, "completed", None, tbt_s=tbt)

    # ------------------------------------------------------------------ records
    def _finish(
        self, flight: _Flight, outcome: Outcome, reason: str | None, tbt_s: float | None = None
    ) -> None:
        self._in_flight -= 1
        placement = flight.placement
        prefilled = outcome != "rejected"
        self._records.append(
            RequestRecord(
                request_id=flight.req.request_id,
                arrival_s=flight.arrival_s,
                input_tokens=flight.req.input_tokens,
                output_tokens=flight.output_tokens,
                outcome=outcome,
                reject_reason=reason,
                prefill_node=placement.prefill if placement and prefilled else None,
                decode_node=placement.decode if placement and prefilled else None,
                cached_tokens=flight.cached_tokens if prefilled else 0,
                migrated_tokens=flight.migrated_tokens if prefilled else 0,
                prefill_s=flight.prefill_s if prefilled else 0.0,
                ttft_s=flight.ttft_s if outcome == "completed" else None,
                tbt_s=tbt_s,
                finish_s=self.loop.now_s,
            )
        )

    def _sample(self) -> None:
        """Load over time (the paper's Fig. 6 view), every ``load_sample_s``."""
        states = self.node_states(set())
        prefill_states = [s for s in states if s.role == "prefill"]
        ttft_slo = self.slo.ttft_s
        prefill_load = sum(self.scheduler.queue_s(s) for s in prefill_states) / (
            len(prefill_states) * ttft_slo
        )
        decode_load = sum(d.current_tbt_s() for d in self.decode.values()) / (
            len(self.decode) * self.slo.tbt_s
        )
        used = []
        for p in self.prefill.values():
            st = p.pool.stats()
            used.append((st.cached_blocks + st.allocated_blocks) / st.capacity_blocks)
        self._samples.append(
            LoadSample(
                t_s=self.loop.now_s,
                prefill_load=prefill_load,
                decode_load=decode_load,
                prefill_queue_tokens=sum(p.queued_tokens for p in self.prefill.values()),
                decode_requests=sum(d.running_requests for d in self.decode.values()),
                cache_used_ratio=sum(used) / len(used) if used else math.nan,
            )
        )
        if self._to_arrive > 0 or self._in_flight > 0:
            self.loop.after(self.config.load_sample_s, self._sample)


def simulate(
    profile: Profile,
    config: ClusterConfig,
    scheduler_config: SchedulerConfig,
    slo: Slo,
    requests: Sequence[TraceRequest],
    speed: float = 1.0,
    progress: Progress | None = None,
) -> SimResult:
    """Build a fresh cluster and replay ``requests`` through it."""
    cluster = Cluster(profile, config, scheduler_config, slo, requests)
    return cluster.run(requests, speed, progress)
