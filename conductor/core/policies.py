"""Scheduling policies as pipelines of small named stages, registered by name.

A policy is what ``Scheduler.schedule`` asks at its two choices; the scheduler keeps the
rest (role selection, admission, bookkeeping). Each stage is a small object, and a
policy is the pipeline they make (the way llm-d's inference scheduler composes filters
and scorers, here with rankers that order instead of weighted scores, so each built-in
decides exactly as Algorithm 1 and its baselines are written)::

    prefill:  PrefixPlanner  (per prefill-capable node: reusable prefix, any migration,
                              queue and prefill estimates -> PrefillCandidate)
              -> PrefillRanker (best first)
    decode:   DecodeFilter*  (drop nodes that cannot take the request after this prefill)
              -> DecodeRanker (best first, each with its predicted TBT)

Stages read the scheduler's estimates through ``Estimates`` (its cost models and books);
they never change them. Rankers may keep their own state (``RoundRobin``'s rotation), so
a registry maps a name to a *factory* that builds a fresh pipeline per scheduler from
its ``SchedulerConfig`` (stage knobs such as ``kvcache_balancing_threshold`` come from
there). ``BUILTIN_POLICIES`` is the registry of the built-ins ``Policy`` lists; a caller
adds its own by passing ``{**BUILTIN_POLICIES, "name": factory}`` to ``Scheduler``.

Built-ins (all rank decode nodes by predicted TBT except ``round_robin``)::

    round_robin   LocalPrefix      -> RoundRobin    | Colocated, FreeSlot, KvRoom -> RoundRobin
    least_loaded  LocalPrefix      -> LeastQueue    | Colocated, FreeSlot, KvRoom -> LowestTbt
    local_prefix  LocalPrefix      -> LowestTtft    | Colocated, FreeSlot, KvRoom -> LowestTbt
    kv_centric    ThresholdPull    -> LowestTtft    | Colocated, FreeSlot, KvRoom -> LowestTbt
    kv_adaptive   BreakEvenPull    -> LowestTtft    | Colocated, FreeSlot, KvRoom -> LowestTbt

``local_prefix`` is Algorithm 1 without migration (the paper's local cache-aware
scheduling); ``kv_centric`` is Algorithm 1. ``kv_adaptive`` changes two things: the
fixed ``kvcache_balancing_threshold`` is replaced by the break-even point of each
decision — p pulls the best prefix iff ``T_transfer + T_prefill(n, best_len) <
T_prefill(n, local)``, the rule §4.2 states in words — and ``local`` counts the prompt's
blocks that requests queued on p are computing right now (``ScheduleRequest.
pending_blocks``), which a FIFO prefill placed behind them will find cached
(``reads_pending``: the placement loop tracks in-flight prefixes only then).

Ties always go to the smallest node id. Complexity per decision: O(P log P) for P
prefill nodes plus the decode filters' and ranker's O(D log D).

Contenders. Under ``LowestTtft`` only the first candidate is ever used (and the
affinity node's, ``ScheduleRequest.affinity``), so the planners build candidates only
for nodes that may rank first (``PrefixPlanner.contenders``): every node gets a lower
bound of its TTFT first, O(1) — the candidate's own formula with each prefill estimate
replaced by the cost model's floor (``Estimates.prefill_floor_s``): its queue, plus the
floor for its own prefix, or the pull's wait and wire time plus the floor for the
pulled one (the smaller of the two where a pull is taken only when it pays) — and
nodes are evaluated in order of that bound until the bound passes the best TTFT found.
The first candidate is the one the full ranking puts first (property-tested against
it); what is saved is the prefill estimates and candidates of the nodes that cannot
win, most of the fleet when it is large and only a few nodes hold the prefix.
``LowestTbt`` does the same on the decode side: a lower bound of each node's TBT
(``Estimates.tbt_floors``: the node's forecast batch, this scheduler's decodes and the
reported others expected still running, and the cost model's floor of the estimate),
then TBTs in order of the bound until it passes the best.

From ``VECTOR_MIN_NODES`` nodes on, the bounds and the decode filters are computed over
the scheduler's per-node columns (``Estimates.columns``, ``node_columns.py``: rows kept
between decisions and recomputed only for nodes whose state, books or cost models
changed), the arithmetic in arrays, the same operations as the per-node code. Python
work is then per node that holds some of the prompt (the prefix holders) and per
learned link from a holder, not per node of the fleet. Below it, node by node, where
NumPy's per-call cost would lose. Either way the bound only decides which nodes are
evaluated: every estimate that ranks comes from the per-node code, so decisions are
the same (the tests compare both paths' first choice with the full ranking's, and
whole decisions over random event sequences, ``tests/unit/test_node_columns.py``).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeVar

import numpy as np

from conductor.core.cost_model import FloatArray, IntArray
from conductor.core.node_columns import NodeColumns
from conductor.core.prefix_index import NodeId
from conductor.core.transfer_model import TransferModel

if TYPE_CHECKING:
    # Only for annotations: the scheduler module builds its policies from this one.
    from conductor.core.scheduler import NodeState, SchedulerConfig, ScheduleRequest

__all__ = [
    "BUILTIN_POLICIES",
    "BreakEvenPull",
    "Colocated",
    "DecodeCandidate",
    "DecodeChoice",
    "Estimates",
    "FreeSlot",
    "KvRoom",
    "LeastQueue",
    "LocalPrefix",
    "LowestTbt",
    "LowestTtft",
    "Migration",
    "Policy",
    "PolicyFactory",
    "PrefillCandidate",
    "RoundRobin",
    "SchedulingPolicy",
    "ThresholdPull",
]


class Policy(enum.StrEnum):
    """The built-in policies' names (what settings and scenarios may choose)."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    LOCAL_PREFIX = "local_prefix"
    KV_CENTRIC = "kv_centric"
    KV_ADAPTIVE = "kv_adaptive"


@dataclass(frozen=True, slots=True)
class Migration:
    """Pull ``blocks`` leading blocks of the prompt from ``source`` onto the prefill node."""

    source: NodeId
    blocks: int
    transfer_s: float
    # The holder's own work for it: its engine's lend request (a one-token prefill step,
    # ``lend_wait`` not "none"), booked on the holder's queue until the pull ends. 0 where
    # lending costs the holder's engine nothing (the embedded engine reads its pool).
    lend_s: float = 0.0


class PrefillCandidate(NamedTuple):
    """One prefill node as a prefix planner sees it for one request.

    A named tuple, not a frozen dataclass: a decision builds one per prefill node, and
    a frozen dataclass costs four times as much to construct.
    """

    node: NodeState
    prefix_blocks: int  # reusable there after any migration
    migration: Migration | None
    queue_s: float
    prefill_s: float
    load_s: float = 0.0  # loading its lower-tier prefix blocks (host memory, disk) back

    @property
    def base_ttft_s(self) -> float:
        """TTFT before the P→D hand-off: queue, tier loads, prefill and any prefix pull."""
        pull_s = self.migration.transfer_s if self.migration else 0.0
        return self.queue_s + self.load_s + self.prefill_s + pull_s


class DecodeCandidate(NamedTuple):
    """One decode node that can take the request, with its predicted TBT (a named
    tuple, one per decode node per decision, like ``PrefillCandidate``)."""

    node: NodeState
    tbt_s: float


@dataclass(frozen=True, slots=True)
class DecodeChoice:
    """The decode stage's question: where ``request`` decodes after ``prefill``.

    ``at_s`` is the moment its decode load is forecast for (the predicted end of its
    prefill under predictive admission, else ``now_s``).
    """

    request: ScheduleRequest
    prefill: NodeState
    at_s: float
    now_s: float


class Estimates(Protocol):
    """What the stages may ask of the scheduler: its cost models and its books."""

    @property
    def transfer(self) -> TransferModel: ...

    def queue_s(self, node: NodeState) -> float: ...

    def prefill_s(self, node: NodeState, prompt_tokens: int, prefix_blocks: int) -> float: ...

    def prefill_floor_s(self, node: NodeState, prompt_tokens: int, prefix_blocks: int) -> float: ...

    def columns(self, nodes: Sequence[NodeState]) -> NodeColumns: ...

    def queues_s(self, nodes: Sequence[NodeState]) -> FloatArray: ...

    def prefill_floors_s(
        self, nodes: Sequence[NodeState], prompt_tokens: int, *prefix_blocks: IntArray
    ) -> list[FloatArray]: ...

    def load_s(self, node: NodeState, req: ScheduleRequest) -> float: ...

    def lend_wait_s(self, node: NodeState) -> float: ...

    def lend_s(self, node: NodeState) -> float: ...

    def decode_slots_free(self, node: NodeState) -> bool: ...

    def tbt_at(self, node: NodeState, at_s: float, now_s: float, req: ScheduleRequest) -> float: ...

    def tbt_all(
        self, nodes: Sequence[NodeState], at_s: float, now_s: float, req: ScheduleRequest
    ) -> list[float]: ...

    def tbt_floors(
        self, nodes: Sequence[NodeState], at_s: float, now_s: float, req: ScheduleRequest
    ) -> list[float]: ...


# ---------------------------------------------------------------------------- prefill stage
class PrefixPlanner(Protocol):
    """Builds the prefill candidates: what each node would reuse and how long it takes."""

    @property
    def reads_pending(self) -> bool:
        """Whether it reads ``ScheduleRequest.pending_blocks`` (in-flight prefixes)."""
        ...

    def candidates(
        self, req: ScheduleRequest, nodes: Sequence[NodeState], est: Estimates
    ) -> list[PrefillCandidate]: ...

    def contenders(
        self, req: ScheduleRequest, nodes: Sequence[NodeState], est: Estimates
    ) -> list[PrefillCandidate]:
        """The candidates that may have the lowest TTFT (ties: smallest node id) and the
        affinity node's: ``LowestTtft`` ranks them first as it would rank all."""
        ...


class PrefillRanker(Protocol):
    def rank(self, candidates: list[PrefillCandidate]) -> list[PrefillCandidate]: ...


@dataclass(frozen=True, slots=True)
class LocalPrefix:
    """Each node reuses only the prefix it holds itself (no migration)."""

    @property
    def reads_pending(self) -> bool:
        return False

    def candidates(
        self, req: ScheduleRequest, nodes: Sequence[NodeState], est: Estimates
    ) -> list[PrefillCandidate]:
        return [self._candidate(req, node, est) for node in nodes]

    def contenders(
        self, req: ScheduleRequest, nodes: Sequence[NodeState], est: Estimates
    ) -> list[PrefillCandidate]:
        prefix_blocks, prompt_tokens = req.prefix_blocks, req.prompt_tokens
        bounds: list[float] | FloatArray
        if len(nodes) >= VECTOR_MIN_NODES:
            local = est.columns(nodes).of(prefix_blocks)
            (floors,) = est.prefill_floors_s(nodes, prompt_tokens, local)
            bounds = est.queues_s(nodes) + floors
        else:
            bounds = [
                est.queue_s(n)
                + est.prefill_floor_s(n, prompt_tokens, prefix_blocks.get(n.node_id, 0))
                for n in nodes
            ]
        return _contenders(req, nodes, bounds, lambda node: self._candidate(req, node, est))

    @staticmethod
    def _candidate(req: ScheduleRequest, node: NodeState, est: Estimates) -> PrefillCandidate:
        local = req.prefix_blocks.get(node.node_id, 0)
        prefill_s = est.prefill_s(node, req.prompt_tokens, local)
        load_s = est.load_s(node, req)
        return PrefillCandidate(node, local, None, est.queue_s(node), prefill_s, load_s)


@dataclass(frozen=True, slots=True)
class ThresholdPull:
    """Algorithm 1: a node pulls the best holder's prefix when ``best / local > threshold``
    (``x / 0 = inf``) and the pull is at least ``min_blocks`` blocks."""

    threshold: float
    min_blocks: int

    @property
    def reads_pending(self) -> bool:
        return False

    def candidates(
        self, req: ScheduleRequest, nodes: Sequence[NodeState], est: Estimates
    ) -> list[PrefillCandidate]:
        return _pull_candidates(req, nodes, est, self.min_blocks, self.threshold)

    def contenders(
        self, req: ScheduleRequest, nodes: Sequence[NodeState], est: Estimates
    ) -> list[PrefillCandidate]:
        return _pull_candidates(req, nodes, est, self.min_blocks, self.threshold, bounded=True)


@dataclass(frozen=True, slots=True)
class BreakEvenPull:
    """``kv_adaptive``: a node pulls the best prefix iff transfer plus the shorter prefill
    beats computing from its local prefix, which counts blocks in flight there."""

    min_blocks: int

    @property
    def reads_pending(self) -> bool:
        return True

    def candidates(
        self, req: ScheduleRequest, nodes: Sequence[NodeState], est: Estimates
    ) -> list[PrefillCandidate]:
        return _pull_candidates(req, nodes, est, self.min_blocks, None)

    def contenders(
        self, req: ScheduleRequest, nodes: Sequence[NodeState], est: Estimates
    ) -> list[PrefillCandidate]:
        return _pull_candidates(req, nodes, est, self.min_blocks, None, bounded=True)


# Relative slack of a lower bound against the best TTFT found: the bound and the
# estimate reach the same value by different float roundings.
# Nodes from which a stage bounds them over arrays (NumPy's per-call overhead loses below).
VECTOR_MIN_NODES = 96
_BOUND_SLACK = 1e-9


_Evaluated = TypeVar("_Evaluated")


def _in_bound_order(
    bounds: list[float] | FloatArray,
    evaluate: Callable[[int], _Evaluated],
    cost: Callable[[_Evaluated], float],
) -> list[_Evaluated]:
    """``evaluate(i)`` for the indices in order of their lower bound ``bounds[i]`` (ties:
    the lower index), until a bound passes the lowest ``cost`` evaluated: every index
    whose cost may be the lowest, or tie with it, is evaluated."""
    out: list[_Evaluated] = []
    best = math.inf
    for i, bound in _by_bound(bounds):
        if bound > best + abs(best) * _BOUND_SLACK:
            break
        item = evaluate(i)
        out.append(item)
        best = min(best, cost(item))
    return out


def _by_bound(bounds: list[float] | FloatArray) -> Iterator[tuple[int, float]]:
    """``(i, bounds[i])`` in order of the bound, ties by index. An array is read in
    growing slices of its order: most searches end after a few nodes."""
    if not isinstance(bounds, np.ndarray):
        for i in sorted(range(len(bounds)), key=bounds.__getitem__):
            yield i, bounds[i]
        return
    order = np.argsort(bounds, kind="stable")
    start, size = 0, 8
    while start < len(order):
        at = order[start : start + size]
        yield from zip(at.tolist(), bounds.take(at).tolist(), strict=True)
        start += size
        size *= 4


def _contenders(
    req: ScheduleRequest,
    nodes: Sequence[NodeState],
    bounds: list[float] | FloatArray,
    candidate: Callable[[NodeState], PrefillCandidate],
) -> list[PrefillCandidate]:
    """Candidates of the nodes whose TTFT lower bound (``bounds[i]`` of ``nodes[i]``)
    does not pass the lowest TTFT among them, evaluated in order of the bound, plus the
    affinity node's. A node left out has a TTFT above the lowest: it neither wins nor
    ties."""
    out = _in_bound_order(bounds, lambda i: candidate(nodes[i]), lambda c: c.base_ttft_s)
    affinity = req.affinity
    if affinity is not None and all(c.node.node_id != affinity for c in out):
        out.extend(candidate(n) for n in nodes if n.node_id == affinity)
    return out


def _pull_candidates(
    req: ScheduleRequest,
    nodes: Sequence[NodeState],
    est: Estimates,
    min_blocks: int,
    threshold: float | None,
    *,
    bounded: bool = False,
) -> list[PrefillCandidate]:
    """Candidates that may pull the longest prefix; ``threshold`` None: break-even rule.
    ``bounded``: only the contenders (``PrefixPlanner.contenders``)."""
    break_even = threshold is None
    # FindBestPrefixMatch: the longest holder; ties go to the smallest node id. A holder
    # lends from every tier: what sits in its host memory or on disk is loaded first.
    # Nodes pull only within their KV family (engines that move KV the same way).
    prefix_blocks = req.prefix_blocks
    holders: dict[str, tuple[NodeState, int]] = {}
    # Over the columns (bounds only): the holders among the nodes that hold some of the
    # prompt. A family where none does has no pull (``min_blocks`` >= 1), so no holder.
    columns = None
    if bounded and min_blocks >= 1 and len(nodes) >= VECTOR_MIN_NODES:
        columns = est.columns(nodes)
        held_at = columns.of(prefix_blocks)
        at = np.flatnonzero(held_at)
        if len(at):
            families = columns.family.take(at)
            for code in np.unique(families).tolist():  # usually one family
                mine = at[families == code]
                held = held_at.take(mine)
                most = int(held.max())
                tied = [nodes[i] for i in mine[held == most].tolist()]
                holder = min(tied, key=lambda n: n.node_id)
                holders[holder.kv_family] = (holder, most)
    else:
        for n in nodes:
            held = prefix_blocks.get(n.node_id, 0)
            best = holders.get(n.kv_family)
            if best is None or held > best[1] or (held == best[1] and n.node_id < best[0].node_id):
                holders[n.kv_family] = (n, held)
    # What a pull waits for at the holder before the wire: loading its lower-tier blocks,
    # and its engine's queue where lending is a request to its engine (``lend_wait``).
    holder_wait: dict[str, float] = {
        f: est.load_s(h, req) + est.lend_wait_s(h) for f, (h, _) in holders.items()
    }
    holder_lend: dict[str, float] = {f: est.lend_s(h) for f, (h, _) in holders.items()}
    prompt_tokens = req.prompt_tokens
    pending_blocks = req.pending_blocks

    def local_of(node: NodeState) -> int:
        local = prefix_blocks.get(node.node_id, 0)
        if break_even:
            local = max(local, pending_blocks.get(node.node_id, 0))
        return local

    def pull_s(node: NodeState, local: int) -> float | None:
        """Wait and wire time of pulling the holder's longer prefix, None: no pull."""
        entry = holders.get(node.kv_family)
        if entry is None:
            return None
        holder, best_len = entry
        if not (
            holder.node_id != node.node_id
            and node.kv_migration
            and holder.kv_migration
            and best_len - local >= min_blocks
            and (threshold is None or (math.inf if local == 0 else best_len / local) > threshold)
        ):
            return None
        nbytes = (best_len - local) * node.block_size * node.kv_bytes_per_token
        wire_s = est.transfer.estimate(holder.node_id, node.node_id, nbytes)
        return holder_wait[node.kv_family] + wire_s

    # Algorithm 1 pulls past the threshold whatever it costs; a pull that must first wait
    # at the holder (loading its blocks from host memory or disk, or its engine's queue)
    # is taken only when it still beats computing here.
    def must_pay(node: NodeState) -> bool:
        return break_even or holder_wait[node.kv_family] > 0

    def bound(node: NodeState) -> float:
        # ``candidate`` with each prefill estimate replaced by its floor; tier loads
        # only add.
        local = local_of(node)
        transfer_s = pull_s(node, local)
        if transfer_s is None:
            return est.queue_s(node) + est.prefill_floor_s(node, prompt_tokens, local)
        best_len = holders[node.kv_family][1]
        pulled_s = transfer_s + est.prefill_floor_s(node, prompt_tokens, best_len)
        if must_pay(node):
            pulled_s = min(pulled_s, est.prefill_floor_s(node, prompt_tokens, local))
        return est.queue_s(node) + pulled_s

    def bounds(columns: NodeColumns, held_at: IntArray) -> FloatArray:
        # ``bound`` of every node over the columns: ``pull_s`` and the floors as array
        # operations in the same order; Python work only per holder and learned link.
        count = len(nodes)
        local = held_at
        if break_even and pending_blocks:
            local = np.maximum(local, columns.of(pending_blocks))
        family = columns.family
        size = int(family.max()) + 1
        # Per family code: the holder's prefix, position, migration ability and wait.
        best_by = np.zeros(size, np.int64)
        holder_by = np.full(size, -1, np.int64)
        migrates_by = np.zeros(size, np.bool_)
        wait_by = np.zeros(size)
        for name, (holder, held) in holders.items():
            code = columns.code(name)
            if code < size:
                best_by[code], migrates_by[code] = held, holder.kv_migration
                holder_by[code] = columns.position_of(holder.node_id)
                wait_by[code] = holder_wait[name]
        best_len, holder_at = best_by[family], holder_by[family]
        able = (holder_at >= 0) & (holder_at != np.arange(count))
        able &= columns.kv_migration & migrates_by[family]
        pull = able & (best_len - local >= min_blocks)
        if threshold is not None:
            ratio = best_len / np.where(local == 0, 1, local)
            pull &= np.where(local == 0, math.inf > threshold, ratio > threshold)
        at = np.flatnonzero(pull)
        transfer = np.zeros(count)
        if len(at):
            latency_s, spb = est.transfer.default_fit
            latency, per_byte = np.full(count, latency_s), np.full(count, spb)
            for name, (holder, _) in holders.items():  # learned links from the holders
                code = columns.code(name)
                for dst, link_latency_s, link_spb in est.transfer.fits_from(holder.node_id):
                    i = columns.position_of(dst)
                    if i >= 0 and family[i] == code:
                        latency[i], per_byte[i] = link_latency_s, link_spb
            nbytes = (best_len - local).take(at) * columns.unit_bytes.take(at)
            wire = latency.take(at) + np.maximum(nbytes, 0) * per_byte.take(at)
            transfer[at] = wait_by[family.take(at)] + wire
        own, pulled = est.prefill_floors_s(nodes, prompt_tokens, local, best_len)
        pulled = transfer + pulled
        paying = np.ones(count, np.bool_) if break_even else wait_by[family] > 0
        with_pull = np.where(paying, np.minimum(pulled, own), pulled)
        return est.queues_s(nodes) + np.where(pull, with_pull, own)

    def candidate(node: NodeState) -> PrefillCandidate:
        local = local_of(node)
        migration = None
        prefix = local
        prefill_s = est.prefill_s(node, prompt_tokens, local)
        transfer_s = pull_s(node, local)
        if transfer_s is not None:
            holder, best_len = holders[node.kv_family]
            pulled_s = est.prefill_s(node, prompt_tokens, best_len)
            if not must_pay(node) or transfer_s + pulled_s < prefill_s:
                migration = Migration(
                    holder.node_id, best_len, transfer_s, holder_lend[node.kv_family]
                )
                prefix = best_len
                prefill_s = pulled_s
        load_s = est.load_s(node, req)
        return PrefillCandidate(node, prefix, migration, est.queue_s(node), prefill_s, load_s)

    if bounded:
        if columns is not None:
            return _contenders(req, nodes, bounds(columns, held_at), candidate)
        return _contenders(req, nodes, [bound(node) for node in nodes], candidate)
    return [candidate(node) for node in nodes]


@dataclass(frozen=True, slots=True)
class LeastQueue:
    """Shortest predicted queue first (prefix-blind)."""

    def rank(self, candidates: list[PrefillCandidate]) -> list[PrefillCandidate]:
        return sorted(candidates, key=lambda c: (c.queue_s, c.node.node_id))


@dataclass(frozen=True, slots=True)
class LowestTtft:
    """Lowest predicted TTFT before the hand-off first (Algorithm 1's choice)."""

    def rank(self, candidates: list[PrefillCandidate]) -> list[PrefillCandidate]:
        return sorted(candidates, key=lambda c: (c.base_ttft_s, c.node.node_id))


# ---------------------------------------------------------------------------- decode stage
class DecodeFilter(Protocol):
    def keep(
        self, nodes: list[NodeState], choice: DecodeChoice, est: Estimates
    ) -> list[NodeState]: ...


class DecodeRanker(Protocol):
    def rank(self, options: list[DecodeCandidate]) -> list[DecodeCandidate]: ...


@dataclass(frozen=True, slots=True)
class Colocated:
    """A prefill node that also decodes keeps the request (no KV hand-off)."""

    def keep(self, nodes: list[NodeState], choice: DecodeChoice, est: Estimates) -> list[NodeState]:
        return [choice.prefill] if choice.prefill.role == "both" else nodes


@dataclass(frozen=True, slots=True)
class FreeSlot:
    """Nodes with a free generation slot (else the agent refuses it after the prefill)."""

    def keep(self, nodes: list[NodeState], choice: DecodeChoice, est: Estimates) -> list[NodeState]:
        if len(nodes) >= VECTOR_MIN_NODES:  # ``decode_slots_free`` over the columns
            columns = est.columns(nodes)
            limit = columns.max_running
            free = (limit <= 0) | (np.maximum(columns.placed, columns.running) < limit)
            return nodes if free.all() else columns.pick(nodes, free)[0]
        return [n for n in nodes if est.decode_slots_free(n)]


@dataclass(frozen=True, slots=True)
class KvRoom:
    """Nodes with room for the request's KV (prompt plus ``max_new_tokens``), counting
    allocatable blocks (free + evictable): a warm cache of unlocked blocks has room.
    The prefill node itself has the prompt's blocks already."""

    def keep(self, nodes: list[NodeState], choice: DecodeChoice, est: Estimates) -> list[NodeState]:
        need_tokens = choice.request.prompt_tokens + choice.request.max_new_tokens
        if len(nodes) >= VECTOR_MIN_NODES:
            columns = est.columns(nodes)
            room = columns.room_tokens >= need_tokens
            at = columns.position_of(choice.prefill.node_id)
            if at >= 0 and nodes[at] is choice.prefill:
                room[at] = True
            return nodes if room.all() else columns.pick(nodes, room)[0]
        return [
            n for n in nodes if n is choice.prefill or n.room_blocks * n.block_size >= need_tokens
        ]


@dataclass(frozen=True, slots=True)
class LowestTbt:
    """Lowest predicted TBT first; then the most room."""

    def rank(self, options: list[DecodeCandidate]) -> list[DecodeCandidate]:
        return sorted(options, key=lambda o: (o.tbt_s, -o.node.room_blocks, o.node.node_id))


_Item = TypeVar("_Item")


@dataclass(slots=True)
class RoundRobin:
    """Rotation over the candidates in fleet order, one step per decision that has any."""

    next_start: int = 0

    def rank(self, items: list[_Item]) -> list[_Item]:
        if not items:
            return items
        start = self.next_start % len(items)
        self.next_start += 1
        return items[start:] + items[:start]


def _decode_contenders(
    nodes: list[NodeState], choice: DecodeChoice, est: Estimates
) -> list[DecodeCandidate]:
    """The decode nodes whose TBT lower bound (``Estimates.tbt_floors``) does not pass
    the lowest TBT among them, with their TBTs, evaluated in order of the bound: the
    node ``LowestTbt`` ranks first and every node tied with it on TBT are among them."""
    at_s, now_s, req = choice.at_s, choice.now_s, choice.request
    return _in_bound_order(
        est.tbt_floors(nodes, at_s, now_s, req),
        lambda i: DecodeCandidate(nodes[i], est.tbt_at(nodes[i], at_s, now_s, req)),
        lambda c: c.tbt_s,
    )


# ---------------------------------------------------------------------------- pipelines
_DECODE_FILTERS: tuple[DecodeFilter, ...] = (Colocated(), FreeSlot(), KvRoom())


@dataclass(frozen=True, slots=True)
class SchedulingPolicy:
    """One named pipeline (see the module docstring)."""

    name: str
    prefix: PrefixPlanner
    prefill_ranker: PrefillRanker
    decode_ranker: DecodeRanker
    decode_filters: tuple[DecodeFilter, ...] = _DECODE_FILTERS

    def order_prefill(
        self, req: ScheduleRequest, nodes: Sequence[NodeState], est: Estimates
    ) -> list[PrefillCandidate]:
        """The prefill-capable ``nodes`` as candidates, best first (never empty given
        nodes). Ranked by TTFT, only the contenders: the first is the same."""
        if isinstance(self.prefill_ranker, LowestTtft):
            return self.prefill_ranker.rank(self.prefix.contenders(req, nodes, est))
        return self.prefill_ranker.rank(self.prefix.candidates(req, nodes, est))

    def order_decode(
        self, nodes: list[NodeState], choice: DecodeChoice, est: Estimates
    ) -> list[DecodeCandidate]:
        """The decode-capable ``nodes`` that can take the request, best first (maybe none)."""
        for decode_filter in self.decode_filters:
            nodes = decode_filter.keep(nodes, choice, est)
        req = choice.request
        if isinstance(self.decode_ranker, LowestTbt) and len(nodes) >= VECTOR_MIN_NODES:
            return self.decode_ranker.rank(_decode_contenders(nodes, choice, est))
        tbts = est.tbt_all(nodes, choice.at_s, choice.now_s, req)
        options = [DecodeCandidate(n, tbt) for n, tbt in zip(nodes, tbts, strict=True)]
        return self.decode_ranker.rank(options)


PolicyFactory = Callable[["SchedulerConfig"], SchedulingPolicy]


def _round_robin(config: SchedulerConfig) -> SchedulingPolicy:
    return SchedulingPolicy(Policy.ROUND_ROBIN, LocalPrefix(), RoundRobin(), RoundRobin())


def _least_loaded(config: SchedulerConfig) -> SchedulingPolicy:
    return SchedulingPolicy(Policy.LEAST_LOADED, LocalPrefix(), LeastQueue(), LowestTbt())


def _local_prefix(config: SchedulerConfig) -> SchedulingPolicy:
    return SchedulingPolicy(Policy.LOCAL_PREFIX, LocalPrefix(), LowestTtft(), LowestTbt())


def _kv_centric(config: SchedulerConfig) -> SchedulingPolicy:
    pull = ThresholdPull(config.kvcache_balancing_threshold, config.min_migration_blocks)
    return SchedulingPolicy(Policy.KV_CENTRIC, pull, LowestTtft(), LowestTbt())


def _kv_adaptive(config: SchedulerConfig) -> SchedulingPolicy:
    pull = BreakEvenPull(config.min_migration_blocks)
    return SchedulingPolicy(Policy.KV_ADAPTIVE, pull, LowestTtft(), LowestTbt())


BUILTIN_POLICIES: Mapping[str, PolicyFactory] = MappingProxyType(
    {
        Policy.ROUND_ROBIN: _round_robin,
        Policy.LEAST_LOADED: _least_loaded,
        Policy.LOCAL_PREFIX: _local_prefix,
        Policy.KV_CENTRIC: _kv_centric,
        Policy.KV_ADAPTIVE: _kv_adaptive,
    }
)
