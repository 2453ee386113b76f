"""The one placement loop: what the live conductor and the simulator both run per request.

The scheduler (``scheduler.py``) makes one decision from one view of the fleet. Around
it sits a loop that every driver needs and that must not exist twice: build the fleet
view, schedule, try the placement, and when a node refuses (capacity, busy, draining,
unreachable) exclude it and schedule again among the rest; hold a request that would
be admitted soon in a bounded wait instead of refusing it; keep the bookkeeping of
prefixes being computed right now (in flight) and of the scheduler's books. This module
is that loop, written sans-I/O: a driver asks ``decide`` and performs what it answers.

    placement = loop.begin(request, keys, prefix, now_s)  # one per request
    while True:
        step = placement.decide(fleet, now_s)    # Placement | Wait | Refusal
        Refusal   -> answer it (429 / 503); stop
        Wait      -> sleep until step.until_s or until capacity frees up; continue
        Placement -> TxAllocate on step.prefill ...
            a node refused          -> placement.failed(node, kind); continue
            allocated               -> placement.allocated()
            blocks committed        -> placement.committed()
            prefix pull ended       -> placement.pulled()    (only with a migration)
            prefill measured        -> placement.prefill_done(total, cached, seconds)
            first token             -> placement.decode_started(now_s)
            end / error / cancel    -> placement.finished(output_tokens, stopped)

The live dispatcher (``conductor/dispatch.py``) drives it with gRPC calls and asyncio
waits; the simulator (``kvc_sim/cluster.py``) drives the very same object in virtual
time. Decisions are therefore the same given the same fleet view, observations and
clock (``tests/integration/test_placement_drivers.py`` runs one scenario table through
both).

Fleet view
    One snapshot type, ``NodeState`` (what each agent last reported), built by the
    drivers and filtered here by ``fleet_view``: excluded nodes dropped, nodes whose block
    size differs from the fleet's (the smallest usable one) marked unhealthy.

In-flight prefixes
    Per node, the block keys of this loop's open allocations (reference counted, added at
    ``allocated``, removed at ``committed`` or when the request ends), kept only when the
    policy's prefix planner reads them (``reads_pending``: ``kv_adaptive``): a node's
    prefix for a request is its cached prefix extended by the keys being computed there
    (``InflightPrefixes.pending``), which a FIFO prefill queued behind them will find
    cached.

Waiting (knob ``max_waiting``)
    A scheduler rejection that time will lift — the decode forecast breaks the TBT SLO, or
    no decode node has room or a free slot — becomes ``Wait`` when the request's predicted
    TTFT including the wait still meets its TTFT SLO and fewer than ``max_waiting``
    requests wait. Each new ``decide`` charges the time already waited against the TTFT
    SLO. A TTFT rejection never waits (waiting cannot shorten the queue it waits for).

Complexity
    ``decide`` is the scheduler's decision plus O(blocks x nodes) for the in-flight
    prefix (only under a policy that reads it); every other call O(1) or O(blocks).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from conductor.core.prefix_index import NodeId
from conductor.core.scheduler import (
    NodeState,
    Placement,
    Rejection,
    RejectReason,
    Scheduler,
    ScheduleRequest,
    Slo,
)
from kvc.block_keys import BlockKey

__all__ = [
    "FailureKind",
    "InflightPrefixes",
    "PlacementLoop",
    "Refusal",
    "RequestPlacement",
    "Wait",
    "fleet_view",
]


class FailureKind(enum.Enum):
    """Why a chosen node refused or failed an attempt; each excludes it for this request."""

    CAPACITY = "capacity"  # no room for the blocks (RESOURCE_EXHAUSTED, reason capacity)
    BUSY = "busy"  # no free generation slot (RESOURCE_EXHAUSTED, reason busy)
    DRAINING = "draining"  # leaving the fleet
    UNREACHABLE = "unreachable"  # down or not answering


RefusalReason = Literal[RejectReason, "exhausted", "unavailable"]


@dataclass(frozen=True, slots=True)
class Refusal:
    """The request is refused before any work (429, or 503 when nothing is usable).

    ``exhausted``: every node that could take it refused an attempt (``last_failure``
    says how the last one failed); ``unavailable``: no usable prefill-capable or no
    usable decode-capable node at all.
    """

    reason: RefusalReason
    retry_after_s: float
    ttft_s: float
    tbt_s: float
    last_failure: tuple[NodeId, FailureKind] | None = None
    queue_full: bool = False  # it would have waited, but ``max_waiting`` requests already do


@dataclass(frozen=True, slots=True)
class Wait:
    """Not now, but soon: decide again at ``until_s`` or when capacity frees up."""

    until_s: float
    rejection: Rejection  # what would be refused now


def fleet_view(
    nodes: Sequence[NodeState], excluded: set[NodeId] | frozenset[NodeId] = frozenset()
) -> tuple[int | None, list[NodeState]]:
    """The fleet's block size (smallest among healthy nodes) and the schedulable view.

    Excluded nodes are left out; a node whose block size differs is marked unhealthy
    (its block keys would not match the request's). ``None``: no healthy node.
    """
    sizes = [n.block_size for n in nodes if n.healthy]
    if not sizes:
        return None, [n for n in nodes if n.node_id not in excluded]
    uniform = sizes.count(sizes[0]) == len(sizes)  # in C, without comparing orders
    block_size = sizes[0] if uniform else min(sizes)
    if not excluded and uniform and len(sizes) == len(nodes):
        return block_size, list(nodes)  # every node healthy, of one block size
    view = [
        n if n.block_size == block_size or not n.healthy else replace(n, healthy=False)
        for n in nodes
        if n.node_id not in excluded
    ]
    return block_size, view


class InflightPrefixes:
    """Per node, block keys that open allocations are computing (reference counted)."""

    __slots__ = ("_nodes",)

    def __init__(self) -> None:
        self._nodes: dict[NodeId, dict[BlockKey, int]] = {}

    def add(self, node: NodeId, keys: Sequence[BlockKey]) -> None:
        counts = self._nodes.setdefault(node, {})
        for key in keys:
            counts[key] = counts.get(key, 0) + 1

    def remove(self, node: NodeId, keys: Sequence[BlockKey]) -> None:
        counts = self._nodes.get(node)
        if counts is None:
            return
        for key in keys:
            left = counts.get(key, 0) - 1
            if left > 0:
                counts[key] = left
            else:
                counts.pop(key, None)
        if not counts:
            del self._nodes[node]

    def pending(self, keys: Sequence[BlockKey], prefix: dict[NodeId, int]) -> dict[NodeId, int]:
        """Per node: leading blocks of ``keys`` cached there or being computed there."""
        out: dict[NodeId, int] = {}
        for node, counts in self._nodes.items():
            i = prefix.get(node, 0)
            while i < len(keys) and keys[i] in counts:
                i += 1
            if i:
                out[node] = i
        return out

    def __len__(self) -> int:
        return sum(len(c) for c in self._nodes.values())


class PlacementLoop:
    """Shared state of every request's loop: the scheduler, in-flight prefixes, waiters."""

    def __init__(self, scheduler: Scheduler, *, max_waiting: int = 0) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.scheduler = scheduler
        self.max_waiting = max_waiting
        self.inflight = InflightPrefixes()
        self.waiting = 0
        self._track = scheduler.policy.prefix.reads_pending

    def begin(
        self,
        request: ScheduleRequest,
        keys: Sequence[BlockKey],
        now_s: float,
    ) -> RequestPlacement:
        """Start placing ``request`` (its ``prefix_blocks`` from the shadow index)."""
        return RequestPlacement(self, request, tuple(keys), now_s)


class RequestPlacement:
    """One request's way through the loop (see the module docstring for the protocol)."""

    __slots__ = (
        "_arrived_s",
        "_excluded",
        "_keys",
        "_last_failure",
        "_lending",
        "_loop",
        "_open",
        "_request",
        "_tracked",
        "_waiting",
        "placement",
    )

    def __init__(
        self, loop: PlacementLoop, request: ScheduleRequest, keys: tuple[BlockKey, ...],
        now_s: float,
    ) -> None:  # fmt: skip
        self._loop = loop
        self._request = request
        self._keys = keys
        self._arrived_s = now_s
        self._excluded: set[NodeId] = set()
        self._last_failure: tuple[NodeId, FailureKind] | None = None
        self._tracked: NodeId | None = None  # node whose in-flight set holds our keys
        self._lending: NodeId | None = None  # holder whose queue books our pull's lend
        self._waiting = False
        self._open = False  # the scheduler's books hold this request
        self.placement: Placement | None = None

    @property
    def request(self) -> ScheduleRequest:
        return self._request

    @property
    def excluded(self) -> frozenset[NodeId]:
        return frozenset(self._excluded)

    @property
    def would_have_hit_blocks(self) -> int:
        """Blocks of this prompt another node held at decision time that the chosen
        prefill node recomputes (0 when it reuses the longest prefix anywhere)."""
        if self.placement is None:
            return 0
        best = max(self._request.prefix_blocks.values(), default=0)
        return max(0, best - self.placement.prefix_blocks)

    # ------------------------------------------------------------------ deciding
    def decide(self, fleet: Sequence[NodeState], now_s: float) -> Placement | Wait | Refusal:
        """Schedule among ``fleet`` minus the excluded nodes; see the module docstring."""
        loop = self._loop
        scheduler = loop.scheduler
        self._release_books()
        _, states = fleet_view(fleet, self._excluded)
        req = self._request
        waited = max(0.0, now_s - self._arrived_s)
        if waited > 0:
            req = replace(req, slo=Slo(max(0.0, req.slo.ttft_s - waited), req.slo.tbt_s))
        if loop._track:
            req = replace(
                req, pending_blocks=loop.inflight.pending(self._keys, dict(req.prefix_blocks))
            )
        decision = scheduler.schedule(req, states, now_s)
        if isinstance(decision, Placement):
            self._stop_waiting()
            scheduler.on_assigned(req, decision, now_s)
            self._open = True
            if decision.migration is not None and decision.migration.lend_s > 0:
                self._lending = decision.migration.source
            self.placement = decision
            return decision
        capacity = decision.reason in ("no_prefill_node", "no_decode_node")
        if capacity and self._last_failure is not None:
            self._stop_waiting()
            return Refusal(
                "exhausted", decision.retry_after_s, decision.ttft_s, decision.tbt_s,
                self._last_failure,
            )  # fmt: skip
        usable = any(n.can_prefill for n in states) and any(n.can_decode for n in states)
        if capacity and not usable:  # no node of a role at all: nothing to wait for
            self._stop_waiting()
            return Refusal("unavailable", decision.retry_after_s, decision.ttft_s, decision.tbt_s)
        if self._may_wait(decision, req):
            if not self._waiting:
                self._waiting = True
                loop.waiting += 1
            return Wait(now_s + decision.retry_after_s, decision)
        self._stop_waiting()
        return Refusal(
            decision.reason, decision.retry_after_s, decision.ttft_s, decision.tbt_s,
            queue_full=self._waits_in_time(decision, req),
        )  # fmt: skip

    def _may_wait(self, rejection: Rejection, req: ScheduleRequest) -> bool:
        if not self._waits_in_time(rejection, req):
            return False
        return self._waiting or self._loop.waiting < self._loop.max_waiting

    @staticmethod
    def _waits_in_time(rejection: Rejection, req: ScheduleRequest) -> bool:
        """Time lifts this rejection before the request's TTFT SLO runs out."""
        if rejection.reason not in ("tbt_slo", "no_decode_node"):
            return False
        ttft = rejection.ttft_s
        return math.isfinite(ttft) and rejection.retry_after_s + ttft <= req.slo.ttft_s

    def _stop_waiting(self) -> None:
        if self._waiting:
            self._waiting = False
            self._loop.waiting -= 1

    # ------------------------------------------------------------------ attempt results
    def failed(self, node: NodeId, kind: FailureKind) -> None:
        """The attempt failed at ``node``: exclude it; the next ``decide`` retries."""
        self._release_books()
        self._excluded.add(node)
        self._last_failure = (node, kind)

    def allocated(self) -> None:
        """The prefill node holds the prompt's blocks: they are in flight there."""
        placement = self.placement
        assert placement is not None, "allocated() before a placement"
        if self._loop._track and self._tracked is None:
            self._loop.inflight.add(placement.prefill, self._keys)
            self._tracked = placement.prefill

    def committed(self) -> None:
        """The prompt's blocks became cached on the prefill node (no longer in flight)."""
        if self._tracked is not None:
            self._loop.inflight.remove(self._tracked, self._keys)
            self._tracked = None

    def pulled(self) -> None:
        """The placement's prefix pull ended (done, failed or given up). Idempotent."""
        if self._lending is not None:
            self._loop.scheduler.on_pulled(self._request.request_id, self._lending)
            self._lending = None

    def prefill_done(
        self,
        total_tokens: int,
        cached_tokens: int,
        duration_s: float | None,
        now_s: float | None = None,
    ) -> None:
        """The prefill ended at ``now_s`` (None: the driver does not say when)."""
        placement = self.placement
        assert placement is not None, "prefill_done() before a placement"
        self._loop.scheduler.on_prefill_done(
            self._request.request_id, placement.prefill, total_tokens, cached_tokens,
            duration_s, now_s,
        )  # fmt: skip

    def decode_started(self, now_s: float) -> None:
        placement = self.placement
        assert placement is not None, "decode_started() before a placement"
        self._loop.scheduler.on_decode_started(self._request.request_id, placement.decode, now_s)

    def finished(
        self,
        output_tokens: int | None = None,
        *,
        stopped: bool = False,
        now_s: float | None = None,
        mean_gap_s: float | None = None,
    ) -> None:
        """The request left the system (done, failed, cancelled or refused). Idempotent.

        ``output_tokens`` teaches the output-length model: exact when ``stopped`` (the
        model ended it), a lower bound otherwise. ``mean_gap_s`` (its decode's mean time
        between tokens, ended at ``now_s``) teaches the node's decode-time model.
        """
        self._stop_waiting()
        self.committed()
        self.pulled()
        placement = self.placement
        if self._open and placement is not None:
            self._open = False
            scheduler = self._loop.scheduler
            request_id = self._request.request_id
            if mean_gap_s is not None and now_s is not None:
                scheduler.observe_decode(request_id, placement.decode, mean_gap_s, now_s)
            scheduler.on_finished(
                request_id, placement.prefill, placement.decode,
                output_tokens=output_tokens, stopped=stopped, now_s=now_s,
            )  # fmt: skip

    def _release_books(self) -> None:
        """Undo the previous attempt's bookkeeping before scheduling again."""
        self.committed()
        self.pulled()
        placement = self.placement
        if self._open and placement is not None:
            self._open = False
            self._loop.scheduler.on_finished(
                self._request.request_id, placement.prefill, placement.decode
            )
