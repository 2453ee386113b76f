"""Simulated serving instances: prefill (chunked, FIFO, real ``BlockPool``), decode
(continuous batching) and their NICs.

What it models
    * ``Nic``: one instance's network card, one transfer at a time in each direction. A
      transfer of ``b`` bytes that may start at ``ready_s`` starts when both the sender's
      egress and the receiver's ingress are free, occupies both for
      ``b / nic_bytes_per_s`` and lands ``latency_s`` later (``reserve_transfer``). So a
      hot prefix pulled by many instances queues on its holder's NIC: the congestion that
      Mooncake's hot-spot replication relieves (§4.2).
    * ``PrefillInstance``: the real ``node_agent.blocks.pool.BlockPool`` as its KV cache
      (HBM + DRAM tiers, ``cache_tokens`` in all), an LRU of the keys held in the HBM
      share (reuse from HBM needs no host-to-device load), a FIFO of ``QueuedPrefill``s
      (one prefill at a time; its chunks run back to back), and the event stream the
      conductor's shadow index follows (``drain_events``: epoch + sequence numbers).
    * ``DecodeInstance``: continuous batching. A step of ``b`` requests holding ``k`` KV
      tokens lasts ``profile.tbt_s(b, k)``; every request in the batch gains one token per
      step; requests join and leave only at step boundaries (or at once when the instance
      is idle). A request handed off by vLLM's pull (``DecodeSeq.pulled``) spends its
      join step computing the prompt's last token (``prefill_compute_s(n, n - 1)`` added
      to that step, outside the decode batch's ``tbt_s``) and gets its first token at
      that step's end. KV for ``prompt + output`` tokens is reserved on admission and bounded by
      ``hbm_kv_tokens``; so is the batch (``max_batch_requests``). Requests that do not fit
      wait in FIFO order (``queue`` mode) — or, with ``refuse=True``, are refused when they
      do not fit or would push the step time over the TBT SLO (the decode node's own load
      check, after the prefill has been spent: the §7.6 baseline's waste).

    Step durations and end times are kept per instance, so a request's token gaps are a
    slice of them: no per-token work.

Knobs
    From the profile (capacities, tiers, decode limits) and the cluster config (block size,
    lease, ``refuse``).

Complexity
    Prefill start O(blocks of the prompt) (cached-prefix count and HBM LRU refresh).
    Decode step O(1) + O(requests joining or leaving); memory O(steps) per instance.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from conductor.core.prefix_index import NodeId
from conductor.core.tier_index import Medium
from kvc.block_keys import BlockKey
from kvc_sim.profile import Profile
from node_agent.blocks.pool import BlockPool, Donation
from node_agent.blocks.tiers import LowerTiers, MemoryStore
from node_agent.blocks.types import (
    AllBlocksCleared,
    BlockMoved,
    BlockRemoved,
    BlockRetained,
    BlockState,
    BlockStored,
    KvMedium,
)
from node_agent.kv import KvContent, KvLayout

__all__ = [
    "DecodeInstance",
    "DecodeSeq",
    "IndexEvent",
    "Nic",
    "PrefillInstance",
    "QueuedPrefill",
    "TimingNoise",
    "reserve_transfer",
]


class TimingNoise:
    """Engines are not their profile: multiplicative noise and cold starts on true times.

    Each duration is multiplied by ``exp(N(0, sigma) - sigma^2/2)`` (log-normal, mean 1);
    an instance's first ``cold_prefills`` prefills take ``cold_extra_s`` longer (a cold
    engine compiles kernels, captures graphs and warms allocators once: a fixed cost,
    20x a short prefill, a few percent of a long one). Seeded per instance: reproducible.
    """

    __slots__ = ("_cold_extra_s", "_cold_left", "_rng", "_sigma")

    def __init__(
        self, sigma: float = 0.0, cold_extra_s: float = 0.0, cold_prefills: int = 0, seed: int = 0
    ) -> None:
        self._sigma = sigma
        self._cold_extra_s = cold_extra_s
        self._cold_left = cold_prefills
        self._rng = random.Random(seed)

    def decode(self, seconds: float) -> float:
        if self._sigma <= 0:
            return seconds
        return seconds * math.exp(self._rng.gauss(0.0, self._sigma) - self._sigma**2 / 2)

    def prefill(self, seconds: float) -> float:
        seconds = self.decode(seconds)
        if self._cold_left > 0:
            self._cold_left -= 1
            seconds += self._cold_extra_s
        return seconds


@dataclass(slots=True)
class Nic:
    egress_free_s: float = 0.0
    ingress_free_s: float = 0.0
    bytes_sent: int = 0


def reserve_transfer(
    profile: Profile, src: Nic, dst: Nic, nbytes: int, ready_s: float
) -> tuple[float, float]:
    """Book ``nbytes`` from ``src`` to ``dst``: (wire start, arrival) in virtual seconds."""
    start = max(ready_s, src.egress_free_s, dst.ingress_free_s)
    end = start + profile.wire_s(nbytes)
    src.egress_free_s = end
    dst.ingress_free_s = end
    src.bytes_sent += nbytes
    return start, end + profile.network.latency_s


@dataclass(frozen=True, slots=True)
class IndexEvent:
    """One event of a node's stream as the shadow index consumes it."""

    seq: int
    stored: tuple[BlockKey, ...] = ()
    removed: tuple[BlockKey, ...] = ()
    cleared: bool = False
    moved: tuple[Medium, tuple[BlockKey, ...]] | None = None  # still held, another tier


@dataclass(slots=True)
class QueuedPrefill:
    """A request queued on a prefill instance, holding an open ALLOCATE tx there."""

    request_id: str
    tx_id: str
    keys: tuple[BlockKey, ...]
    handles: tuple[int, ...]
    input_tokens: int
    on_start: Callable[[int, float], None]  # (cached tokens, duration): it starts now
    on_done: Callable[[], None]  # it finished
    migrating: bool = False  # a prefix pull is in flight; the job may not start
    migrated_blocks: int = 0  # leading blocks whose KV arrived from another node
    load_s: float = 0.0  # promoting its blocks from host memory / disk (tiered clusters)
    lend: bool = False  # the node's lend request for another node's prefix pull


class SimBlockKv:
    """A pool block's content in the simulator: its size and nothing else (the agent's
    tiers move it by reference; only capacities and bandwidths are modelled)."""

    __slots__ = ("_layout", "_tokens")

    def __init__(self, block_tokens: int, kv_bytes_per_token: int) -> None:
        # One layer, one head, float16: ``bytes_per_token == kv_bytes_per_token``.
        if kv_bytes_per_token % 4:
            raise ValueError("kv_bytes_per_token must be a multiple of 4")
        self._layout = KvLayout(1, 1, kv_bytes_per_token // 4, "float16")
        self._tokens = block_tokens

    @property
    def num_tokens(self) -> int:
        return self._tokens

    @property
    def layout(self) -> KvLayout:
        return self._layout

    @property
    def nbytes(self) -> int:
        return self._tokens * self._layout.bytes_per_token

    def slice(self, start: int, end: int) -> SimBlockKv:
        raise NotImplementedError("the simulator never cuts a block's content")

    def to_bytes(self) -> bytes:
        raise NotImplementedError("the simulator's blocks have a size, not bytes")

    def to_buffers(self) -> Iterator[memoryview]:
        raise NotImplementedError("the simulator's blocks have a size, not bytes")


class SimKvCodec:
    """Moves ``SimBlockKv`` between tiers by reference."""

    def concat(self, parts: Sequence[KvContent]) -> KvContent:
        raise NotImplementedError("the simulator never joins blocks' content")

    def from_bytes(
        self, layout: KvLayout, data: bytes | bytearray | memoryview, num_tokens: int
    ) -> KvContent:
        raise NotImplementedError("the simulator's disk tier keeps objects, not bytes")

    def to_host(self, content: KvContent) -> KvContent:
        return content

    def to_device(self, content: KvContent) -> KvContent:
        return content

    def to_device_many(self, contents: Sequence[KvContent]) -> Sequence[KvContent]:
        return list(contents)


class PrefillInstance:
    """One prefill node: block pool, HBM tier LRU, FIFO queue, NIC."""

    def __init__(
        self,
        node_id: NodeId,
        profile: Profile,
        capacity_blocks: int,
        block_tokens: int,
        clock: Callable[[], float],
        max_lease_s: float,
        noise: TimingNoise | None = None,
        tiers: tuple[int, int] | None = None,
        replicas_elsewhere: Callable[[BlockKey], int] | None = None,
        retention_budget_block_s: float | None = None,
        max_retained_blocks: int | None = None,
        donate: Callable[[Donation], bool] | None = None,
        donate_min_hits: int = 1,
        donate_max_hops: int = 1,
    ) -> None:
        """``tiers``: (host, disk) tokens of the agent's lower tiers below a pool of
        ``capacity_blocks`` (L1); None: the profile's HBM share of that pool instead.
        ``retention_budget_block_s``, ``max_retained_blocks``: the pool's retention knobs
        (None: its defaults). ``donate``, ``donate_min_hits``, ``donate_max_hops``: the
        pool's donate-before-evict hook (None: victims are dropped)."""
        self.node_id = node_id
        self.noise = noise or TimingNoise()
        self.epoch = f"sim-{node_id}"
        self.profile = profile
        self.block_tokens = block_tokens
        self.block_kv = SimBlockKv(block_tokens, profile.kv_bytes_per_token)
        self.tiered = tiers is not None
        lower = None
        if tiers is not None:
            block_bytes = self.block_kv.nbytes
            lower = LowerTiers(
                SimKvCodec(),
                host_bytes=tiers[0] // block_tokens * block_bytes,
                disk_bytes=tiers[1] // block_tokens * block_bytes,
                disk_store=MemoryStore(),
            )
        self.pool = BlockPool(
            capacity_blocks,
            clock,
            max_lease_s=max_lease_s,
            max_finished_txs=1024,
            max_finished_keys=65_536,
            lower=lower,
            replicas_elsewhere=replicas_elsewhere,
            donate=donate,
            donate_min_hits=donate_min_hits,
            donate_max_hops=donate_max_hops,
            retention_budget_block_s=retention_budget_block_s,
            max_retained_blocks=(
                None if max_retained_blocks is None else min(max_retained_blocks, capacity_blocks)
            ),
        )
        self.hbm_capacity_blocks = (
            0
            if self.tiered
            else min(profile.prefill.hbm_cache_tokens // block_tokens, capacity_blocks)
        )
        self._hbm: OrderedDict[BlockKey, None] = OrderedDict()
        self.queue: deque[QueuedPrefill] = deque()
        self.running: QueuedPrefill | None = None
        self.queued_tokens = 0  # prompt tokens of queued + running jobs
        self.nic = Nic()
        self.busy_s = 0.0
        self.evicted_blocks = 0
        self._seq = 0

    # ------------------------------------------------------------------ events
    def drain_events(self) -> list[IndexEvent]:
        """The pool's queued block events, numbered as the agent's stream would be.

        ``BlockRetained`` (a retention granted or ended) is left out: the shadow index
        does not follow retention, and leaving it out keeps the numbering gap-free."""
        out: list[IndexEvent] = []
        for event in self.pool.take_events():
            if isinstance(event, BlockRetained):
                continue
            self._seq += 1
            if isinstance(event, BlockStored):
                out.append(IndexEvent(self._seq, stored=event.keys))
            elif isinstance(event, BlockRemoved):
                self.evicted_blocks += len(event.keys)
                out.append(IndexEvent(self._seq, removed=event.keys))
            elif isinstance(event, BlockMoved):
                out.append(IndexEvent(self._seq, moved=(Medium(event.medium), event.keys)))
            else:
                assert isinstance(event, AllBlocksCleared)
                out.append(IndexEvent(self._seq, cleared=True))
        return out

    @property
    def last_seq(self) -> int:
        return self._seq

    # ------------------------------------------------------------------ queue
    def enqueue(self, job: QueuedPrefill) -> None:
        self.queue.append(job)
        self.queued_tokens += job.input_tokens

    def enqueue_lend(self, job: QueuedPrefill) -> None:
        """Queue a lend before every waiting prefill, after the lends already waiting
        (after the running one): vLLM's priority scheduling with the lend legs first,
        first come first served among equal priorities."""
        queue = self.queue
        i = 0
        while i < len(queue) and queue[i].lend:
            i += 1
        queue.insert(i, job)
        self.queued_tokens += job.input_tokens

    def next_ready(self) -> QueuedPrefill | None:
        """Pop the head job if the instance is idle and the head may start (FIFO)."""
        if self.running is not None or not self.queue or self.queue[0].migrating:
            return None
        job = self.queue.popleft()
        self.running = job
        return job

    def finish(self, job: QueuedPrefill) -> None:
        assert self.running is job
        self.running = None
        self.queued_tokens -= job.input_tokens

    def cached_prefix_blocks(self, job: QueuedPrefill) -> int:
        """Leading blocks whose KV is valid now: migrated ones, then CACHED ones.

        Counted at prefill start, not at allocation: a block another queued request was
        computing has been committed by now (FIFO), exactly as a real engine checks its
        prefix cache when the request is scheduled, not when it arrives.
        """
        state = self.pool.block_state
        n = 0
        migrated = job.migrated_blocks
        for h in job.handles:
            if n >= migrated and state(h) is not BlockState.CACHED:
                break
            n += 1
        return n

    def allocated(self, job_handles: Sequence[int], promoted: tuple[int, int]) -> float:
        """After a tx allocated ``job_handles``: give its new blocks their content (what
        the agent's prefill does) and return the load time of the ``promoted`` (host,
        disk) blocks it brought back from the lower tiers."""
        pool = self.pool
        for h in job_handles:
            if pool.block_state(h) is BlockState.ALLOCATED and pool.get_payload(h) is None:
                pool.set_payload(h, self.block_kv)
        bt = self.block_tokens
        return self.profile.tier_load_s(promoted[0] * bt, promoted[1] * bt)

    def promoted_counts(self) -> tuple[int, int]:
        """Blocks promoted so far from (host, disk): deltas give one tx's."""
        counts = self.pool.promoted_blocks
        return counts[KvMedium.HOST], counts[KvMedium.DISK]

    def prefill_duration_s(
        self, job: QueuedPrefill, cached_blocks: int, cached_tokens: int
    ) -> float:
        """Truth. Tiered: the promotions' load, then the compute. Else: compute, overlapped
        with loading reused DRAM blocks; refreshes the HBM LRU."""
        if self.tiered:
            compute = self.profile.prefill_compute_s(job.input_tokens, cached_tokens)
            return self.noise.prefill(compute) + job.load_s
        hbm = self._hbm
        dram_blocks = 0
        for key in job.keys[:cached_blocks]:
            if key not in hbm:
                dram_blocks += 1
        load_tokens = min(dram_blocks * self.block_tokens, cached_tokens)
        compute = self.profile.prefill_compute_s(job.input_tokens, cached_tokens)
        duration = self.noise.prefill(max(compute, self.profile.h2d_load_s(load_tokens)))
        cap = self.hbm_capacity_blocks
        if cap:
            move = hbm.move_to_end
            for key in job.keys:
                if key in hbm:
                    move(key)
                else:
                    hbm[key] = None
            while len(hbm) > cap:
                hbm.popitem(last=False)
        return duration


@dataclass(slots=True)
class DecodeSeq:
    """One request on a decode instance."""

    request_id: str
    prompt_tokens: int
    # Output tokens this node makes: all after the first (which the prefill produced),
    # or every one when ``pulled``.
    steps_needed: int
    reserve_tokens: int
    first_token_s: float  # when the prefill's first token came (not ``pulled``)
    on_done: Callable[[DecodeSeq], None]
    join_step: int = -1  # index of its first decode step
    admitted: bool = False
    # vLLM's pull hand-off (``ClusterConfig.kv_handoff``): the join step computes the
    # prompt's last token again and yields the first token (``on_first_token``).
    pulled: bool = False
    on_first_token: Callable[[DecodeSeq], None] | None = None

    @property
    def join_context(self) -> int:
        """KV tokens it brings to the batch: the prompt, and the prefill's token."""
        return self.prompt_tokens if self.pulled else self.prompt_tokens + 1


@dataclass(slots=True)
class DecodeStats:
    steps: list[float] = field(default_factory=list)  # durations
    step_ends: list[float] = field(default_factory=list)


class DecodeInstance:
    """One decode node running continuous batching (see the module docstring)."""

    def __init__(
        self,
        node_id: NodeId,
        profile: Profile,
        block_tokens: int,
        schedule_at: Callable[[float, Callable[[], None]], None],
        clock: Callable[[], float],
        refuse: bool,
        tbt_slo_s: float,
        noise: TimingNoise | None = None,
    ) -> None:
        self.node_id = node_id
        self.noise = noise or TimingNoise()
        self.profile = profile
        self.block_tokens = block_tokens
        self.capacity_tokens = profile.decode.hbm_kv_tokens
        self.max_batch = profile.decode.max_batch_requests
        self.refuse = refuse
        self.tbt_slo_s = tbt_slo_s
        self._schedule_at = schedule_at
        self._clock = clock
        self.reserved_tokens = 0
        self.batch_requests = 0
        self.context_tokens = 0
        self.joining: list[DecodeSeq] = []  # admitted, join at the next step boundary
        self.waiting: deque[DecodeSeq] = deque()  # not admitted yet (queue mode)
        self._finish_at: dict[int, list[DecodeSeq]] = {}
        self._first_token: list[DecodeSeq] = []  # pulled joiners of the running step
        self.stats = DecodeStats()
        self._stepping = False
        self._step_s = 0.0
        self.nic = Nic()

    @property
    def free_blocks(self) -> int:
        return max(0, self.capacity_tokens - self.reserved_tokens) // self.block_tokens

    @property
    def running_requests(self) -> int:
        return self.batch_requests + len(self.joining) + len(self.waiting)

    def current_tbt_s(self) -> float:
        if not self.batch_requests:
            return 0.0
        return self.profile.tbt_s(self.batch_requests, self.context_tokens)

    def _fits(self, seq: DecodeSeq) -> bool:
        return (
            self.reserved_tokens + seq.reserve_tokens <= self.capacity_tokens
            and self.batch_requests + len(self.joining) < self.max_batch
        )

    def offer(self, seq: DecodeSeq) -> bool:
        """A request whose KV just arrived. False: refused (``refuse`` mode only)."""
        if not self.waiting and self._fits(seq):
            if self.refuse:
                b = self.batch_requests + len(self.joining) + 1
                k = self.context_tokens + seq.prompt_tokens + 1
                k += sum(s.prompt_tokens + 1 for s in self.joining)
                if self.profile.tbt_s(b, k) > self.tbt_slo_s:
                    return False
            self._admit(seq)
        elif self.refuse:
            return False
        else:
            self.waiting.append(seq)
        if not self._stepping:
            self._start_step()
        return True

    def _admit(self, seq: DecodeSeq) -> None:
        self.reserved_tokens += seq.reserve_tokens
        seq.admitted = True
        self.joining.append(seq)

    def _start_step(self) -> None:
        decoding, context = self.batch_requests, self.context_tokens
        recompute_s = 0.0  # pulled joiners' last prompt token
        if self.joining:
            step = len(self.stats.steps)
            for seq in self.joining:
                seq.join_step = step
                self.batch_requests += 1
                self.context_tokens += seq.join_context
                self._finish_at.setdefault(step + seq.steps_needed, []).append(seq)
                if seq.pulled:
                    n = seq.prompt_tokens
                    recompute_s += self.profile.prefill_compute_s(n, n - 1)
                    self._first_token.append(seq)
                else:
                    decoding += 1
                    context += seq.join_context
            self.joining = []
        if not self.batch_requests:
            self._stepping = False
            return
        self._stepping = True
        decode_s = self.profile.tbt_s(decoding, context) if decoding else 0.0
        self._step_s = self.noise.decode(decode_s + recompute_s)
        self._schedule_at(self._clock() + self._step_s, self._end_step)

    def _end_step(self) -> None:
        stats = self.stats
        stats.steps.append(self._step_s)
        stats.step_ends.append(self._clock())
        self.context_tokens += self.batch_requests
        firsts, self._first_token = self._first_token, []
        for seq in firsts:
            if seq.on_first_token is not None:
                seq.on_first_token(seq)
        done = self._finish_at.pop(len(stats.steps), None)
        if done:
            for seq in done:
                self.batch_requests -= 1
                self.context_tokens -= seq.join_context + seq.steps_needed
                self.reserved_tokens -= seq.reserve_tokens
            for seq in done:
                seq.on_done(seq)
        while self.waiting and self._fits(self.waiting[0]):
            self._admit(self.waiting.popleft())
        self._start_step()

    def gaps_s(self, seq: DecodeSeq) -> list[float]:
        """Token gaps of a finished request: first-token→first step end, then step times
        (a pulled request's first token is its first step's end: step times only)."""
        stats = self.stats
        if seq.pulled:
            return stats.steps[seq.join_step + 1 : seq.join_step + seq.steps_needed]
        first = stats.step_ends[seq.join_step] - seq.first_token_s
        return [first, *stats.steps[seq.join_step + 1 : seq.join_step + seq.steps_needed]]
