"""A simulated fleet driven by the real conductor core, request by request, in virtual time.

What it runs: the live ``conductor/dispatch.py`` flow with RPCs replaced by calls. Both
drive the same ``conductor.core.placement.PlacementLoop`` (schedule → attempt → refuse →
reschedule, waiting, in-flight prefixes, the scheduler's books); only the I/O differs.
    1. Arrival: block keys from the trace's ``hash_ids`` (``BlockKey(id)``, tenant
       ``"trace"``); ``PrefixIndex.match`` over the shadow index → prefix per node. The
       request's ``max_new_tokens`` is the client's cap (``max_tokens``), never its true
       output length: the scheduler learns lengths as the live conductor does.
    2. ``RequestPlacement.decide(fleet, now)``: a ``Refusal`` is a 429 before any work; a
       ``Wait`` re-decides at its time or when a decode ends; a ``Placement`` is tried.
    3. ``TxAllocate`` (ALLOCATE) of every key on the chosen prefill node's ``BlockPool``.
       ``CapacityExhausted`` → ``failed(node, CAPACITY)``: the node is excluded and the
       loop decides again among the rest (as the dispatcher does on RESOURCE_EXHAUSTED).
       With ``retention`` the tx carries the request's prompt-cache breakpoints
       (``retain=``, trace blocks scaled to pool blocks); the pool grants or refuses
       them (never the tx) and the replay counts its answers (``RetentionCounts``).
    4. A ``Migration``: ``TxAllocate(LOCK_ONLY)`` of the prefix on the holder; when it
       locked more than the destination already reuses, the blocks travel holder →
       destination over both NICs, ``scheduler.transfer.observe`` learns from it and the
       holder's tx commits (releasing its locks); the destination's job may not start
       before. Otherwise the holder's tx commits at once and nothing moves.
    5. Prefill (FIFO on the node): cached prefix counted when it starts; duration from the
       profile (truth); the prompt's KV streams to the decode node during the prefill.
       At the end: ``TxCommit`` (new blocks become reusable prefix), ``committed()`` and
       ``prefill_done(total, cached, duration_s)``.
    6. The KV has reached the decode node → first token (TTFT), ``decode_started``; the
       decode node batches it until its output length (capped by ``max_tokens``) exists.
       Then ``finished(tokens, stopped, now_s, mean_gap_s)``: the mean gap teaches the
       decode-time model (paired with the batch and context averaged over the decode's
       life, ``Scheduler.observe_decode``), the tokens the output-length model. A request
       of one output token ends at its prefill.
    7. After every pool operation the pool's ``take_events()`` become the node's event
       stream (epoch + sequence numbers) and reach ``PrefixIndex.apply`` after
       ``index_event_delay_s`` (0: at once). A gap or bound overflow → resync from a
       snapshot (``reset_node``), like the live shadow.

    The scheduler never sees the truth: it sees ``NodeState`` (queued prompt tokens,
    free and allocatable KV blocks, running requests, as an agent reports them), the
    shadow index, and the durations its hooks are told.

Knobs: ``ClusterConfig`` (``cluster_config.py``).

Complexity
    Per request: O(blocks) for keys, matching, allocation and commit, plus the
    scheduler's decision. Per decode step O(1) amortised. Events O(R + steps).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence

from conductor.core.placement import (
    FailureKind,
    PlacementLoop,
    Refusal,
    Wait,
)
from conductor.core.prefix_index import ApplyOutcome, NodeId, PrefixIndex
from conductor.core.scheduler import (
    NodeState,
    Placement,
    Scheduler,
    SchedulerConfig,
    ScheduleRequest,
    Slo,
)
from conductor.core.tier_index import LowerTierIndex, apply_node_event, reset_node_view
from kvc.block_keys import BlockKey
from kvc.donation import choose_donee
from kvc_sim.cluster_config import ClusterConfig
from kvc_sim.engine import EventLoop
from kvc_sim.flight import Flight
from kvc_sim.instances import (
    DecodeInstance,
    DecodeSeq,
    IndexEvent,
    PrefillInstance,
    QueuedPrefill,
    TimingNoise,
    reserve_transfer,
)
from kvc_sim.metrics import (
    LoadSample,
    RequestOutcome,
    RequestRecord,
    RetentionCounts,
    SimResult,
    top_decile_mean,
)
from kvc_sim.profile import Profile
from kvc_sim.trace import TRACE_BLOCK_TOKENS, TraceRequest, cached_tokens
from node_agent.blocks.pool import Donation
from node_agent.blocks.types import (
    AllocateParams,
    CapacityExhausted,
    KvMedium,
    Retention,
    RetentionOutcome,
    TxMode,
)

__all__ = ["MODEL", "TENANT", "Cluster", "simulate"]

TENANT = "trace"
MODEL = "trace-model"  # the output-length model's key is (MODEL, TENANT)

Progress = Callable[[int, int, float], None]  # (arrived, total, virtual now)


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
        self.placer = PlacementLoop(self.scheduler, max_waiting=config.max_waiting)
        self.index = PrefixIndex()
        # The agent's lower tiers (tiered clusters): what the shadow knows of them.
        self.lower = LowerTierIndex() if config.tiered else None
        self._sub = TRACE_BLOCK_TOKENS // config.block_tokens
        capacity_blocks = self._capacity_blocks(requests)
        self.prefill: dict[NodeId, PrefillInstance] = {}
        for i in range(config.prefill_instances):
            node = NodeId(f"prefill-{i:02d}")
            tiers = (
                (config.host_tier_tokens or 0, config.disk_tier_tokens or 0)
                if config.tiered else None
            )  # fmt: skip
            replicas = (
                functools.partial(self.index.other_holders, node=node)
                if config.replica_aware_eviction else None
            )  # fmt: skip
            donate = functools.partial(self._donate, node) if config.donate_before_evict else None
            inst = PrefillInstance(
                node, profile, capacity_blocks, config.block_tokens, self.loop.clock,
                max_lease_s=config.lease_s, noise=self._noise(i), tiers=tiers,
                replicas_elsewhere=replicas,
                donate=donate, donate_min_hits=config.donate_min_hits,
                donate_max_hops=config.donate_max_hops,
                retention_budget_block_s=config.retention_budget_block_s,
                max_retained_blocks=config.max_retained_blocks,
            )  # fmt: skip
            self.prefill[node] = inst
            self.index.reset_node(node, inst.epoch, 0, ())
            if self.lower is not None:
                self.lower.reset_node(node, inst.epoch, 0, (), ())
        self.decode: dict[NodeId, DecodeInstance] = {}
        for i in range(config.decode_instances):
            node = NodeId(f"decode-{i:02d}")
            self.decode[node] = DecodeInstance(
                node, profile, config.block_tokens, self.loop.at, self.loop.clock,
                refuse=config.decode_refuses, tbt_slo_s=slo.tbt_s,
                noise=self._noise(1000 + i),
            )  # fmt: skip
        self._waiters: dict[str, Flight] = {}  # requests in a ``Wait``, by request id
        self._unavailable: set[NodeId] = set()  # nodes down or draining
        self._records: list[RequestRecord] = []
        self._samples: list[LoadSample] = []
        self._in_flight = 0
        self._arrived = 0
        self._to_arrive = 0
        self._migrations = 0
        self._migrated_blocks = 0
        self._resyncs = 0
        self._donated_blocks = 0
        self._retention: dict[RetentionOutcome, int] = dict.fromkeys(RetentionOutcome, 0)

    def _noise(self, instance: int) -> TimingNoise:
        c = self.config
        return TimingNoise(
            c.timing_noise_sigma, c.cold_start_s, c.cold_start_prefills,
            seed=c.seed * 100_003 + instance,
        )  # fmt: skip

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
            retention=self._retention_counts() if self.config.retention else None,
            donated_blocks=self._donated_blocks,
            donation_hits=sum(p.pool.donation_hits for p in self.prefill.values()),
        )

    def _retention_counts(self) -> RetentionCounts:
        counts = self._retention
        ratios = [s.retained_ratio for s in self._samples]
        return RetentionCounts(
            requests=sum(counts.values()) - counts[RetentionOutcome.NONE],
            granted=counts[RetentionOutcome.GRANTED],
            over_budget=counts[RetentionOutcome.OVER_BUDGET],
            node_full=counts[RetentionOutcome.NODE_FULL],
            retained_ratio_mean=sum(ratios) / len(ratios) if ratios else 0.0,
            retained_ratio_max=max(ratios, default=0.0),
        )

    def keys_of(self, req: TraceRequest) -> tuple[BlockKey, ...]:
        sub = self._sub
        if sub == 1:
            return tuple(BlockKey(h) for h in req.hash_ids)
        n_blocks = -(-req.input_tokens // self.config.block_tokens)
        keys = [BlockKey(h * sub + j) for h in req.hash_ids for j in range(sub)]
        return tuple(keys[:n_blocks])

    def retain_of(self, flight: Flight, inst: PrefillInstance) -> tuple[Retention, ...]:
        """The request's breakpoints as the pool's ``retain=`` (none without
        ``retention``): those with a TTL of at least ``retention_min_ttl_s``, trace blocks
        scaled to pool blocks, TTLs cut to the pool's cap."""
        config = self.config
        if not config.retention or not flight.req.breakpoints:
            return ()
        n = len(flight.keys)
        cap_s = inst.pool.max_retention_s
        return tuple(
            Retention(min(blocks * self._sub, n), min(ttl_s, cap_s))
            for blocks, ttl_s in flight.req.breakpoints
            if ttl_s >= config.retention_min_ttl_s
        )

    # ------------------------------------------------------------------ node views
    def set_available(self, node: NodeId, available: bool) -> None:
        """Take a node out of (or back into) the fleet view: down, or draining."""
        if available:
            self._unavailable.discard(node)
        else:
            self._unavailable.add(node)

    def node_states(self, excluded: set[NodeId]) -> list[NodeState]:
        """What the agents would report now (the scheduler's only view of the fleet)."""
        bt = self.config.block_tokens
        kvb = self.profile.kv_bytes_per_token
        spec = self.profile.prefill
        tier_bw = (spec.h2d_bytes_per_s, spec.disk_read_bytes_per_s) if self.lower else (0.0, 0.0)
        states = []
        for node, p in self.prefill.items():
            if node in excluded:
                continue
            stats = p.pool.stats()
            states.append(
                NodeState(
                    node_id=node,
                    role="prefill",
                    healthy=node not in self._unavailable,
                    block_size=bt,
                    capacity_blocks=stats.capacity_blocks,
                    free_blocks=stats.free_blocks,
                    allocatable_blocks=stats.free_blocks + stats.evictable_blocks,
                    kv_bytes_per_token=kvb,
                    kv_migration=self.config.kv_migration,
                    lend_wait=self.config.lend_wait if self.config.lend_wait_reported else "none",
                    queued_prefill_tokens=p.queued_tokens,
                    running_requests=len(p.queue) + (p.running is not None),
                    tier_read_bytes_per_s=tier_bw,
                )
            )
        for node, d in self.decode.items():
            states.append(
                NodeState(
                    node_id=node,
                    role="decode",
                    healthy=node not in self._unavailable,
                    block_size=bt,
                    capacity_blocks=d.capacity_tokens // bt,
                    free_blocks=d.free_blocks,
                    kv_bytes_per_token=kvb,
                    running_requests=d.running_requests,
                    # A refusing decode node turns away what its batch cannot take.
                    max_running_requests=d.max_batch if d.refuse else 0,
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
            outcome = apply_node_event(
                self.index, self.lower, inst.node_id, inst.epoch, ev.seq,
                stored=ev.stored, removed=ev.removed, moved=ev.moved, cleared=ev.cleared,
            )  # fmt: skip
            if outcome is ApplyOutcome.RESYNC:
                # Snapshot as the live shadow would; later events of this batch are then
                # duplicates (seq <= snapshot's) and are ignored.
                self._resyncs += 1
                pool = inst.pool
                reset_node_view(
                    self.index, self.lower, inst.node_id, inst.epoch, inst.last_seq,
                    cached=pool.cached_keys(), host=pool.tier_keys(KvMedium.HOST),
                    disk=pool.tier_keys(KvMedium.DISK), tiered=self.lower is not None,
                )  # fmt: skip
                return

    # ------------------------------------------------------------------ donation
    def _donate(self, donor: NodeId, donation: Donation) -> bool:
        """``donor``'s pool drops a hot block: the peer with the coldest victim takes it
        when the shadow sees no other copy (``kvc.donation``)."""
        if self.index.other_holders(donation.key, donor) > 0:
            return False
        tails = {
            node: inst.pool.lru_tail_idle_s()
            for node, inst in self.prefill.items()
            if node != donor and node not in self._unavailable
        }
        while (target := choose_donee(donation.idle_s, tails)) is not None:
            inst = self.prefill[target]
            if inst.pool.accept_donation(donation):
                self._donated_blocks += 1
                self._publish(inst)
                return True
            del tails[target]  # no parent there, or busy passing on a victim of its own
        return False

    # ------------------------------------------------------------------ arrival
    def _arrive(self, req: TraceRequest) -> None:
        self._arrived += 1
        self._to_arrive -= 1
        cap = self.config.max_tokens
        out = min(cap, self.config.output_tokens or req.output_tokens)
        flight = Flight(req, self.keys_of(req), max(1, out))
        flight.arrival_s = self.loop.now_s
        prefix_blocks = self.index.match(flight.keys)
        sreq = ScheduleRequest(
            request_id=req.request_id,
            prompt_tokens=req.input_tokens,
            prefix_blocks=prefix_blocks,
            tier_blocks=self.lower.hits(flight.keys, prefix_blocks) if self.lower else {},
            max_new_tokens=cap,  # the client's cap: the true length is not known ahead
            slo=self.slo,
            length_key=(MODEL, TENANT),
        )
        flight.loop = self.placer.begin(sreq, flight.keys, self.loop.now_s)
        self._in_flight += 1
        self._place(flight)

    def _place(self, flight: Flight) -> None:
        """Drive the shared placement loop with pool calls (the live one uses gRPC)."""
        loop = flight.loop
        assert loop is not None
        now = self.loop.now_s
        while True:
            step = loop.decide(self.node_states(set()), now)
            if isinstance(step, Wait):
                self._wait(flight, step)
                return
            self._waiters.pop(flight.req.request_id, None)
            if isinstance(step, Refusal):
                reason: str = step.reason
                if reason in ("exhausted", "unavailable"):
                    reason = "insufficient_capacity"
                loop.finished()
                self._finish(flight, "rejected", reason)
                return
            inst = self.prefill[step.prefill]
            tx_id = f"{flight.req.request_id}:{len(loop.excluded) + 1}"
            before = inst.promoted_counts()
            retain = self.retain_of(flight, inst)
            try:
                alloc = inst.pool.tx_allocate(
                    AllocateParams(tx_id, TENANT, flight.keys, self.config.lease_s, retain=retain)
                )
            except CapacityExhausted:
                loop.failed(step.prefill, FailureKind.CAPACITY)
                continue
            if retain:
                self._retention[alloc.retention] += 1
            after = inst.promoted_counts()
            load_s = inst.allocated(alloc.handles, (after[0] - before[0], after[1] - before[1]))
            self._publish(inst)
            loop.allocated()
            flight.placement = step
            flight.prefill = inst
            flight.decode = self.decode[step.decode]
            job = QueuedPrefill(
                request_id=flight.req.request_id,
                tx_id=tx_id,
                keys=flight.keys,
                handles=alloc.handles,
                input_tokens=flight.req.input_tokens,
                on_start=lambda cached, duration: self._prefill_started(flight, cached, duration),
                on_done=lambda: self._prefill_done(flight),
                load_s=load_s,
            )
            flight.job = job
            inst.enqueue(job)
            if step.migration is not None:
                self._migrate(flight, job, step, alloc.reused_blocks)
            self._try_start(inst)
            return

    def _wait(self, flight: Flight, step: Wait) -> None:
        """Decide again at ``step.until_s``, or earlier when capacity frees up."""
        flight.wait_token += 1
        token = flight.wait_token
        self._waiters[flight.req.request_id] = flight

        def wake() -> None:
            if flight.wait_token == token and flight.req.request_id in self._waiters:
                self._place(flight)

        self.loop.at(max(step.until_s, self.loop.now_s), wake)

    def _capacity_freed(self) -> None:
        """A decode ended or was refused: waiting requests decide again, oldest first."""
        if not self._waiters:
            return
        for flight in list(self._waiters.values()):
            if flight.req.request_id in self._waiters:
                flight.wait_token += 1
                self._place(flight)

    # ------------------------------------------------------------------ migration
    def _migrate(
        self, flight: Flight, job: QueuedPrefill, placement: Placement, local_blocks: int
    ) -> None:
        migration = placement.migration
        assert migration is not None
        assert flight.prefill is not None
        src = self.prefill[migration.source]
        dst = flight.prefill
        src_tx = f"{job.tx_id}:src"
        before = src.promoted_counts()
        lock = src.pool.tx_allocate(
            AllocateParams(
                src_tx, TENANT, flight.keys[: migration.blocks], self.config.lease_s,
                mode=TxMode.LOCK_ONLY,
            )
        )  # fmt: skip
        locked = lock.reused_blocks
        assert flight.loop is not None
        pulled = flight.loop.pulled
        after = src.promoted_counts()
        bt = self.config.block_tokens
        # The holder loads what it lent from host memory or disk before it sends.
        load_s = self.profile.tier_load_s((after[0] - before[0]) * bt, (after[1] - before[1]) * bt)
        if locked <= local_blocks:
            src.pool.tx_commit(src_tx)  # paired tx: the holder commits, releasing locks
            self._publish(src)
            pulled()
            return
        nbytes = (
            (locked - local_blocks) * self.config.block_tokens * self.profile.kv_bytes_per_token
        )
        job.migrating = True
        self._migrations += 1

        def send() -> None:
            now = self.loop.now_s
            _start, arrive = reserve_transfer(self.profile, src.nic, dst.nic, nbytes, now + load_s)

            def done() -> None:
                self.scheduler.transfer.observe(
                    src.node_id, dst.node_id, nbytes, arrive - now - load_s
                )
                src.pool.tx_commit(src_tx)
                self._publish(src)
                job.migrating = False
                job.migrated_blocks = locked
                self._migrated_blocks += locked - local_blocks
                pulled()
                self._try_start(dst)

            self.loop.at(arrive, done)

        if self.config.lend_wait == "none":
            send()
            return
        # The holder's engine lends with a request of its own: it waits its turn there
        # (at the back of the queue, or ahead of the waiting prefills behind the running
        # one and the lends already waiting) and computes one token; the KV leaves when
        # it ends.
        lend = QueuedPrefill(
            request_id=f"{flight.req.request_id}:lend",
            tx_id=src_tx,
            keys=(),
            handles=(),
            input_tokens=1,
            on_start=lambda _cached, _duration: None,
            on_done=lambda: self._lent(src, lend, send),
            lend=True,
        )
        if self.config.lend_wait == "queue":
            src.enqueue(lend)
        else:
            src.enqueue_lend(lend)
        self._try_start(src)

    def _lent(self, src: PrefillInstance, lend: QueuedPrefill, send: Callable[[], None]) -> None:
        """The holder's lend request ended: the prefix leaves; the holder goes on."""
        src.finish(lend)
        send()
        self._try_start(src)

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

    def _prefill_started(self, flight: Flight, cached: int, duration: float) -> None:
        job, inst, dec = flight.job, flight.prefill, flight.decode
        assert job is not None
        assert inst is not None
        assert dec is not None
        now = self.loop.now_s
        flight.cached_tokens = cached
        flight.migrated_tokens = min(job.migrated_blocks * self.config.block_tokens, cached)
        flight.prefill_s = duration
        flight.prefill_end_s = now + duration
        if flight.output_tokens > 1 and self.config.kv_handoff == "layerwise":
            # The prompt's KV streams to the decode node while the prefill runs
            # (layer by layer); it is there one latency after the later of the two ends.
            nbytes = flight.req.input_tokens * self.profile.kv_bytes_per_token
            start, arrive = reserve_transfer(self.profile, inst.nic, dec.nic, nbytes, now)
            latency = self.profile.network.latency_s
            flight.handoff_at_s = max(flight.prefill_end_s + latency, arrive)
            self.scheduler.transfer.observe(inst.node_id, dec.node_id, nbytes, arrive - start)

    def _prefill_done(self, flight: Flight) -> None:
        job, inst, placement = flight.job, flight.prefill, flight.placement
        assert job is not None
        assert inst is not None
        assert placement is not None
        inst.finish(job)
        inst.pool.tx_commit(job.tx_id)  # its blocks become reusable prefix
        self._publish(inst)
        loop = flight.loop
        assert loop is not None
        loop.committed()
        # The engine's time, as an agent reports it (tier loads precede it, in the Tx).
        loop.prefill_done(
            job.input_tokens, flight.cached_tokens, flight.prefill_s - job.load_s,
            self.loop.now_s,
        )  # fmt: skip
        if flight.output_tokens <= 1:  # the prefill produced the only token
            self._first_token(flight)
            loop.finished(1, stopped=flight.output_tokens < self.config.max_tokens)
            self._finish(flight, "completed", None)
            self._capacity_freed()
        else:
            if self.config.kv_handoff == "pull":
                # vLLM's pull: the decode node asks for the KV once the prefill is over.
                dec = flight.decode
                assert dec is not None
                nbytes = flight.req.input_tokens * self.profile.kv_bytes_per_token
                now = self.loop.now_s
                start, flight.handoff_at_s = reserve_transfer(
                    self.profile, inst.nic, dec.nic, nbytes, now
                )
                self.scheduler.transfer.observe(
                    inst.node_id, dec.node_id, nbytes, flight.handoff_at_s - start
                )
            self.loop.at(flight.handoff_at_s, lambda: self._handoff_done(flight))
        self._try_start(inst)

    # ------------------------------------------------------------------ decode
    def _handoff_done(self, flight: Flight) -> None:
        dec, placement = flight.decode, flight.placement
        assert dec is not None
        assert placement is not None
        now = self.loop.now_s
        n_out = flight.output_tokens
        pulled = self.config.kv_handoff == "pull"
        seq = DecodeSeq(
            request_id=flight.req.request_id,
            prompt_tokens=flight.req.input_tokens,
            steps_needed=n_out if pulled else n_out - 1,
            reserve_tokens=flight.req.input_tokens + n_out,
            first_token_s=now,
            on_done=lambda seq: self._decode_done(flight, seq),
            pulled=pulled,
            on_first_token=lambda seq: self._first_token(flight),
        )
        loop = flight.loop
        assert loop is not None
        if not dec.offer(seq):
            loop.finished()
            self._finish(flight, "rejected_after_prefill", "decode_refused")
            self._capacity_freed()
            return
        if not pulled:
            self._first_token(flight)

    def _first_token(self, flight: Flight) -> None:
        now = self.loop.now_s
        flight.ttft_s = now - flight.arrival_s
        loop = flight.loop
        assert loop is not None
        loop.decode_started(now)

    def _decode_done(self, flight: Flight, seq: DecodeSeq) -> None:
        dec, placement = flight.decode, flight.placement
        assert dec is not None
        assert placement is not None
        gaps = dec.gaps_s(seq)
        tbt = top_decile_mean(gaps)
        loop = flight.loop
        assert loop is not None
        n_out = flight.output_tokens
        loop.finished(
            n_out, stopped=n_out < self.config.max_tokens, now_s=self.loop.now_s,
            mean_gap_s=sum(gaps) / len(gaps),
        )  # fmt: skip
        self._finish(flight, "completed", None, tbt_s=tbt)
        self._capacity_freed()

    # ------------------------------------------------------------------ records
    def _finish(
        self,
        flight: Flight,
        outcome: RequestOutcome,
        reason: str | None,
        tbt_s: float | None = None,
    ) -> None:
        self._in_flight -= 1
        self._records.append(flight.record(outcome, reason, tbt_s, self.loop.now_s))

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
        retained = []
        for p in self.prefill.values():
            st = p.pool.stats()
            used.append((st.cached_blocks + st.allocated_blocks) / st.capacity_blocks)
            retained.append(st.retained_blocks / st.capacity_blocks)
        self._samples.append(
            LoadSample(
                t_s=self.loop.now_s,
                prefill_load=prefill_load,
                decode_load=decode_load,
                prefill_queue_tokens=sum(p.queued_tokens for p in self.prefill.values()),
                decode_requests=sum(d.running_requests for d in self.decode.values()),
                cache_used_ratio=sum(used) / len(used) if used else math.nan,
                retained_ratio=sum(retained) / len(retained) if retained else 0.0,
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
