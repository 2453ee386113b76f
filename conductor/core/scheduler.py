"""KV-cache-centric scheduling: Mooncake's Algorithm 1, the comparison policies, and
SLO admission with decode-load prediction (§4.1–4.3 of the paper).

Inputs per decision: the request (prompt length, block keys, max new tokens, SLOs), the
nodes (role, health, block size, free blocks, agent-reported load) and, per node, the
prefix length it holds (from the shadow ``PrefixIndex``). The scheduler owns its cost
models and a little bookkeeping of what *it* assigned (pending prefills per node, active
decodes per node with predicted end times); time is always passed in (``now_s``).

Algorithm 1 (policy ``kv_centric``), for every prefill-capable node p::

    if best_len / p.prefix_len > kvcache_balancing_threshold:   # (x/0 = inf)
        prefix, T_transfer = best_len, transfer(best_len - p.prefix_len blocks)
    else:
        prefix, T_transfer = p.prefix_len, 0
    TTFT(p) = T_queue(p) + T_prefill(n, prefix) + T_transfer (+ P→D KV hand-off)

pick the p with the lowest TTFT; pick the decode node d with the lowest predicted TBT
among those with room for the request's KV; reject (429) if TTFT > TTFT_SLO or
TBT > TBT_SLO; if p pulls the prefix, return a ``Migration`` from the best holder.

The two choices are a policy's (knob ``policy``, a name in the scheduler's registry,
``policies.BUILTIN_POLICIES`` unless given): a pipeline of small named stages that plans
each prefill candidate's prefix and ranks them, then filters and ranks decode nodes
(``policies.py``). Built-ins, for benchmarks: ``round_robin`` (rotation, prefix-blind),
``least_loaded`` (lowest queue, prefix-blind), ``local_prefix`` (Algorithm 1 without
migration), ``kv_centric`` (Algorithm 1) and ``kv_adaptive`` (Algorithm 1 with a
break-even pull rule and in-flight prefixes; measured in docs/benchmarks.md).

Admission (knob ``admission``): ``none`` never rejects on SLOs (capacity only);
``early`` checks TTFT and the decode node's *current* TBT before any work (§4.3.2);
``prefill_only`` checks TTFT only: the decode stage's load is left to the decode node
when the prefill ends (the §7.6 baseline, whose refusals waste the prefill);
``predictive`` checks the TBT forecast for the moment this request's prefill finishes
(§4.3.4, system level). The forecast does not assume a fixed output length: each
active decode counts with the probability that it is still running then, from the
output-length distribution learned per (model, tenant) (``OutputLengthModel``, capped
by the request's ``max_tokens``, conditioned on the tokens it has produced so far, so a
decode that overruns its typical length stays in the forecast); decodes whose prefill
ends before that moment join; decodes an agent reports beyond ours (other conductors')
are reconciled in. Every mode checks capacity before any work: a decode node needs
room for the request's KV (free + evictable blocks) and a free generation slot.

Admission never locks up on its own estimates: it refuses only on estimates backed by
evidence (observations near the request's size or enough of any size, or a prior the
node measured at start)
and never on an idle node (a prompt that cannot meet its TTFT SLO even there is served
once the queue has drained; an idle decode node takes any request). Each admitted
request is a new observation, so a wrong estimate heals instead of refusing forever.

``Retry-After`` on a rejection is the predicted time until the same request would be
admitted: the queue drain needed for TTFT, the earliest probe time at which the TBT
forecast meets the SLO, or the median remaining decode time when no decode slot is free.

Complexity per decision: O(P + D·A) for P prefill nodes, D decode nodes and A active
decodes per decode node (x10 probes for a TBT ``Retry-After``); the D·A part of nodes
with ``VECTOR_MIN_DECODES`` or more runs in one NumPy pass (``forecasts``), bit for bit
the per-decode loop's result; prefix matching happens before, in the index. The O(P)
and O(D) parts are lower bounds over arrays from ``policies.VECTOR_MIN_NODES`` nodes
on (``queues_s``, ``prefill_floors_s``, ``tbt_floors``, over the per-node columns of
``node_columns``, recomputed only where a node changed), and full estimates only for
the nodes whose bound reaches the best (``policies``, "Contenders").
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from conductor.core import policies
from conductor.core.cost_model import (
    DecodeTimeModel,
    FloatArray,
    IntArray,
    PrefillTimeModel,
    decode_floors,
    prefill_floors,
)
from conductor.core.decode_load import (
    VECTOR_MIN_DECODES,
    DecodeForecast,
    NodeBook,
    OwnLoad,
    PlacedDecode,
    forecast_decode_load,
    mean_context,
    own_loads,
    with_foreign,
)
from conductor.core.node_columns import NodeColumns, NodeTable
from conductor.core.output_length import LengthDistribution, OutputLengthModel, SurvivalTable
from conductor.core.policies import (
    BUILTIN_POLICIES,
    DecodeChoice,
    Migration,
    Policy,
    PolicyFactory,
    PrefillCandidate,
    SchedulingPolicy,
)
from conductor.core.prefix_index import NodeId
from conductor.core.tier_index import TierHits, tier_load_s
from conductor.core.transfer_model import TransferModel
from kvc.priors import DecodePrior, PrefillPrior
from kvc.roles import NodeRole

LendWait = Literal["none", "queue", "running"]


class Admission(enum.Enum):
    NONE = "none"
    EARLY = "early"
    PREDICTIVE = "predictive"
    PREFILL_ONLY = "prefill_only"


# Priors measured on the embedded tiny model on one CPU core (docs/benchmarks.md); a
# node's own observed durations replace them as they arrive.
EMBEDDED_CPU_PREFILL_PRIOR = PrefillPrior(fixed_s=0.002, per_token_s=2e-5, per_token_context_s=1e-9)
EMBEDDED_CPU_DECODE_PRIOR = DecodePrior(fixed_s=0.002, per_request_s=5e-4, per_context_token_s=1e-7)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    policy: str = Policy.KV_CENTRIC  # a name in the scheduler's policy registry
    admission: Admission = Admission.PREDICTIVE
    kvcache_balancing_threshold: float = 2.0
    min_migration_blocks: int = 1
    # Prior mean of the learned output-length distribution (tokens); data replaces it.
    output_length_prior_tokens: float = 256.0
    prefill_prior: PrefillPrior = EMBEDDED_CPU_PREFILL_PRIOR
    decode_prior: DecodePrior = EMBEDDED_CPU_DECODE_PRIOR
    # The priors above were measured on these engines (e.g. a simulator's profile): their
    # estimates count as evidence for admission. False: a rough guess until data arrives.
    priors_measured: bool = False
    transfer_bandwidth_bytes_per_s: float = 1e9
    transfer_latency_s: float = 0.001
    max_retry_after_s: float = 60.0


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float
    tbt_s: float


PREFILL_ROLES: frozenset[NodeRole] = frozenset(("prefill", "both"))
DECODE_ROLES: frozenset[NodeRole] = frozenset(("decode", "both"))


@dataclass(frozen=True, slots=True)
class NodeState:
    node_id: NodeId
    role: NodeRole
    healthy: bool
    block_size: int
    capacity_blocks: int
    free_blocks: int
    kv_bytes_per_token: int
    # As the agent last reported it, less this conductor's work that ended since.
    queued_prefill_tokens: int = 0
    kv_migration: bool = True  # can lend/receive prefix blocks (not engines owning their KV)
    # Nodes pull prefixes only from nodes of their family: engines that move KV the same
    # way (the embedded engine's pool payloads and vLLM's kv_transfer_params do not mix).
    kv_family: str = ""
    # What a prefix lent by this node waits for before it can leave (a pull from it is
    # charged that wait): "none", its pool is read at once (embedded engine); "queue", the
    # lend is a request to its engine queued behind its prefills (vLLM's LendBlocks leg,
    # first come first served); "running", such a request that jumps the queue but waits
    # for the prefill running there (vLLM's priority scheduling, the leg first).
    lend_wait: LendWait = "none"
    running_requests: int = 0  # as the agent last reported it, less ours ended since
    # Free plus evictable (cached, unlocked) blocks: what an allocation can obtain. None:
    # the reporter does not tell them apart (``free_blocks`` is then the allocatable count).
    allocatable_blocks: int | None = None
    max_running_requests: int = 0  # generations the node runs at once (0 = no limit)
    # Measured read bandwidth of the node's lower KV tiers (host memory, disk), bytes/s;
    # 0: no such tier or not measured (``tier_index.DEFAULT_READ_BYTES_PER_S``).
    tier_read_bytes_per_s: tuple[float, float] = (0.0, 0.0)

    @property
    def room_blocks(self) -> int:
        """Blocks a new request's KV can get here (evicting unlocked cached blocks)."""
        return self.free_blocks if self.allocatable_blocks is None else self.allocatable_blocks

    @property
    def can_prefill(self) -> bool:
        return self.healthy and self.role in PREFILL_ROLES

    @property
    def can_decode(self) -> bool:
        return self.healthy and self.role in DECODE_ROLES


@dataclass(frozen=True, slots=True)
class ScheduleRequest:
    request_id: str
    prompt_tokens: int
    prefix_blocks: Mapping[NodeId, int]  # per node, blocks of this prompt it holds
    max_new_tokens: int
    slo: Slo
    # Per node, leading blocks of this prompt that requests already queued there are
    # computing (allocated, not committed yet): cached by the time a prefill placed
    # behind them starts. Only ``kv_adaptive`` reads it; callers may leave it empty.
    pending_blocks: Mapping[NodeId, int] = field(default_factory=dict)
    # Per node, the blocks of its prefix that sit in host memory or on disk (loaded back
    # before the prefill); nodes without lower-tier hits are absent.
    tier_blocks: Mapping[NodeId, TierHits] = field(default_factory=dict)
    # Whose output lengths this request's decode is predicted from: (model, tenant).
    length_key: tuple[str, str] = ("", "")
    # A routing affinity hint (OpenAI's prompt_cache_key: the node the key's last request
    # used): preferred while its predicted TTFT is within ``affinity_slack_s`` of the best.
    affinity: NodeId | None = None
    affinity_slack_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Placement:
    prefill: NodeId
    decode: NodeId
    prefix_blocks: int  # reusable on the prefill node after any migration
    migration: Migration | None
    queue_s: float
    prefill_s: float
    handoff_s: float  # prefill → decode KV transfer
    ttft_s: float
    tbt_s: float
    cached_tokens: int = 0  # prompt tokens the prefill reuses (prefix after any migration)


RejectReason = Literal["ttft_slo", "tbt_slo", "no_prefill_node", "no_decode_node"]


@dataclass(frozen=True, slots=True)
class Rejection:
    reason: RejectReason
    retry_after_s: float
    ttft_s: float
    tbt_s: float


# Nodes from which ``forecasts`` takes the reported decodes' survivals in one array call.
_VECTOR_MIN_SHARES = 8
_NO_LOAD = DecodeForecast(0.0, 0.0)
# Delays (s) at which a TBT-refused request is re-forecast for ``Retry-After``.
# Distributions the forecasts' table holds before it is first reset to the placed ones.
_LENGTH_TABLE_MIN_RESET = 1024
_RETRY_PROBES_S = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 120.0)


def _with_affinity(
    ordered: list[PrefillCandidate], affinity: NodeId, slack_s: float
) -> list[PrefillCandidate]:
    """``ordered`` with the affinity node first when it is within ``slack_s`` of the best."""
    for i, candidate in enumerate(ordered):
        if candidate.node.node_id == affinity:
            if candidate.base_ttft_s <= ordered[0].base_ttft_s + slack_s:
                return [candidate, *ordered[:i], *ordered[i + 1 :]]
            break
    return ordered


class Scheduler:
    """Algorithm 1 plus admission; one instance per conductor (or per simulation).

    ``policies``: the registry ``config.policy`` is looked up in (built-ins by default).
    """

    def __init__(
        self, config: SchedulerConfig, policies: Mapping[str, PolicyFactory] = BUILTIN_POLICIES
    ) -> None:
        factory = policies.get(config.policy)
        if factory is None:
            raise ValueError(f"unknown policy {config.policy!r}; known: {sorted(policies)}")
        self.config = config
        self.policy: SchedulingPolicy = factory(config)
        self.transfer = TransferModel(
            default_bandwidth_bytes_per_s=config.transfer_bandwidth_bytes_per_s,
            default_latency_s=config.transfer_latency_s,
        )
        self.output_lengths = OutputLengthModel(prior_mean_tokens=config.output_length_prior_tokens)
        self._prefill_models: dict[NodeId, PrefillTimeModel] = {}
        self._decode_models: dict[NodeId, DecodeTimeModel] = {}
        self._books: dict[NodeId, NodeBook] = {}
        # The output-length distributions of busy nodes' decodes, for the forecasts
        # over columns; reset (to those still placed) once it has doubled since.
        self._length_table = SurvivalTable()
        self._length_table_limit = _LENGTH_TABLE_MIN_RESET
        # Decodes (over the nodes of one forecast) from which forecasts run over
        # columns (decode_load).
        self.vector_min_decodes = VECTOR_MIN_DECODES
        # One decision asks for the request's output-length distribution once per decode
        # node: (length key, the model's sample count, the distribution) of the last ask.
        self._lengths_memo: tuple[tuple[str, str], int, LengthDistribution] | None = None
        self._decision_now_s = 0.0  # the clock of the decision being made
        # Per-node columns for decisions over large fleets (``node_columns``): rows
        # recomputed when a node's state, books or cost models change.
        self._table = NodeTable(self)

    # ------------------------------------------------------------------ models
    def prefill_model(self, node: NodeId) -> PrefillTimeModel:
        model = self._prefill_models.get(node)
        if model is None:
            model = self._prefill_models[node] = PrefillTimeModel(
                self.config.prefill_prior, prior_measured=self.config.priors_measured,
                on_change=lambda: self._table.touch(node),
            )  # fmt: skip
        return model

    def decode_model(self, node: NodeId) -> DecodeTimeModel:
        model = self._decode_models.get(node)
        if model is None:
            model = self._decode_models[node] = DecodeTimeModel(
                self.config.decode_prior, prior_measured=self.config.priors_measured,
                on_change=lambda: self._table.touch(node),
            )  # fmt: skip
        return model

    def set_measured_priors(
        self, node: NodeId, prefill: PrefillPrior | None, decode: DecodePrior | None
    ) -> None:
        """A node measured its own engine (start-up calibration): use it as that node's prior.

        Estimates from a measured prior count as evidence for admission everywhere.
        Idempotent: the same prior again changes nothing (learned corrections are kept).
        """
        if prefill is not None:
            model = self.prefill_model(node)
            if model.prior != prefill or not model.prior_measured:
                model.set_prior(prefill, measured=True)
        if decode is not None:
            dmodel = self.decode_model(node)
            if dmodel.prior != decode or not dmodel.prior_measured:
                dmodel.set_prior(decode, measured=True)

    def _book(self, node: NodeId) -> NodeBook:
        book = self._books.get(node)
        if book is None:
            book = self._books[node] = NodeBook()
        return book

    def lengths_for(self, req: ScheduleRequest) -> LengthDistribution:
        """The output-length distribution ``req``'s decode is predicted from.

        Remembered within one decision (``schedule`` forgets it first, so every decision
        asks the model once and keeps its key recently used): the same snapshot as
        asking again, since the model changes only by an observation.
        """
        memo = self._lengths_memo
        samples = self.output_lengths.samples
        if memo is not None and memo[0] == req.length_key and memo[1] == samples:
            return memo[2]
        dist = self.output_lengths.distribution(*req.length_key)
        self._lengths_memo = (req.length_key, samples, dist)
        return dist

    # ------------------------------------------------------------------ estimates
    def queue_s(self, node: NodeState) -> float:
        """Predicted wait before a new prefill starts on ``node``.

        The larger of this scheduler's own pending prefills (their predicted durations)
        and the agent-reported queued tokens (work other conductors sent), so neither
        is double counted.
        """
        # Asked of every prefill node per decision: the remembered answer first.
        book = self._books.get(node.node_id) or self._book(node.node_id)
        model = self._prefill_models.get(node.node_id) or self.prefill_model(node.node_id)
        memo = book.queue_memo
        if memo is not None and memo[0] == model.version and memo[1] == node.queued_prefill_tokens:
            return memo[2]
        if book.pending_model_version != model.version:
            # The model learned since these were estimated: re-estimate, or a queue
            # predicted by a wrong prior outlives the correction. O(pending) per change.
            for rid, tokens in book.pending_prefill_tokens.items():
                cached = book.pending_cached_tokens.get(rid, 0)
                book.pending_prefill_s[rid] = model.estimate(tokens, cached)
            book.pending_model_version = model.version
        own_s = sum(book.pending_prefill_s.values())
        if book.pending_lends:
            own_s += sum(book.pending_lends.values())
        own_tokens = sum(book.pending_prefill_tokens.values())
        foreign_tokens = max(0, node.queued_prefill_tokens - own_tokens)
        foreign_s = 0.0
        if foreign_tokens:
            foreign_s = model.per_token_s * foreign_tokens
        book.queue_memo = (model.version, node.queued_prefill_tokens, own_s + foreign_s)
        return own_s + foreign_s

    def forecast(
        self, node: NodeState, at_s: float, now_s: float, lengths: LengthDistribution
    ) -> DecodeForecast:
        """Expected decode batch on ``node`` at ``at_s`` (before a new request joins).

        See ``decode_load.forecast_decode_load``. O(decodes on the node).
        """
        return self.forecasts([node], at_s, now_s, lengths)[0]

    def forecasts(
        self, nodes: Sequence[NodeState], at_s: float, now_s: float, lengths: LengthDistribution
    ) -> list[DecodeForecast]:
        """``forecast`` of each of ``nodes``: once they run ``vector_min_decodes`` or
        more of ours in all, one pass over their decodes' columns (``own_loads``), else
        decode by decode — the same numbers either way. O(decodes on them)."""
        # Asked of every decode node per decision: one loop, remembered steps read in it.
        by_id, models = self._books, self._decode_models
        books = [by_id.get(n.node_id) or self._book(n.node_id) for n in nodes]
        # One pass over columns for every node with decodes of ours once they hold
        # ``vector_min_decodes`` in all (the pass's cost is per call, not per node).
        vector = sum(len(b.decodes) for b in books) >= max(1, self.vector_min_decodes)
        busy = [b for b in books if b.decodes] if vector else []
        own = iter(self._own_loads(busy, at_s, now_s) if busy else ())
        out: list[DecodeForecast] = []
        # Nodes with none of our decodes whose reported ones are forecast at ``at_s``:
        # (position, reported decodes, steps ahead), their survivals in one array call.
        later: list[tuple[int, int, float]] = []
        ahead_s = at_s - now_s
        for node, book in zip(nodes, books, strict=True):
            model = models.get(node.node_id) or self.decode_model(node.node_id)
            running = node.running_requests
            step_s = self._reported_step_s(node, book, model)
            decodes = book.decodes
            if not decodes:  # ``forecast_decode_load`` of no decodes of ours
                if running > 0 and ahead_s > 0 and step_s > 0:
                    later.append((len(out), running, ahead_s / step_s))
                    forecast = _NO_LOAD  # set below
                else:
                    forecast = with_foreign(
                        0.0, 0.0, 0, running, at_s, now_s, lengths, model, step_s
                    )
            elif vector:
                load = next(own)
                forecast = with_foreign(
                    load.requests, load.context_tokens, load.running_now,
                    running, at_s, now_s, lengths, model, step_s,
                )  # fmt: skip
            else:
                forecast = forecast_decode_load(
                    decodes.values(), running, at_s, now_s, lengths, model, step_s
                )
            out.append(forecast)
        if later:
            # ``with_foreign(0.0, 0.0, 0, running, ...)`` of each, in its operations: the
            # share is ``survival(ahead)`` (``survivals`` is that, bit for bit), our
            # context per decode 0.
            aheads = [ahead for _, _, ahead in later]
            if len(later) >= _VECTOR_MIN_SHARES:
                shares = lengths.survivals(np.array(aheads)).tolist()
            else:
                shares = [lengths.survival(ahead) for ahead in aheads]
            for (at, foreign, _), share in zip(later, shares, strict=True):
                out[at] = DecodeForecast(0.0 + foreign * share, 0.0 + foreign * share * 0.0)
        return out

    def _own_loads(self, books: list[NodeBook], at_s: float, now_s: float) -> list[OwnLoad]:
        table = self._length_table
        parts = [book.columns_in(table) for book in books]
        if len(table) > self._length_table_limit:
            # Distributions of decodes that left: keep only those still placed.
            table.reset(d.lengths for b in self._books.values() for d in b.decodes.values())
            self._length_table_limit = max(_LENGTH_TABLE_MIN_RESET, 2 * len(table))
            parts = [book.columns_in(table) for book in books]
        return own_loads(parts, table, at_s, now_s)

    @staticmethod
    def _reported_step_s(node: NodeState, book: NodeBook, model: DecodeTimeModel) -> float:
        """The node's decode step at its reported batch (remembered per model version
        and reported count: every decision asks it of every decode node)."""
        running = node.running_requests
        memo = book.step_memo
        if memo is not None and memo[0] == model.version and memo[1] == running:
            return memo[2]
        step_s = model.estimate(max(1, running), 0)
        book.step_memo = (model.version, running, step_s)
        return step_s

    def tbt_at(self, node: NodeState, at_s: float, now_s: float, req: ScheduleRequest) -> float:
        """Predicted TBT on ``node`` at ``at_s`` with ``req`` joining."""
        return self.tbt_all([node], at_s, now_s, req)[0]

    def tbt_all(
        self, nodes: Sequence[NodeState], at_s: float, now_s: float, req: ScheduleRequest
    ) -> list[float]:
        """``tbt_at`` of each of ``nodes`` (their forecasts in one pass)."""
        loads = self.forecasts(nodes, at_s, now_s, self.lengths_for(req))
        models, prompt_tokens = self._decode_models, req.prompt_tokens  # ``forecasts`` made them
        return [
            models[node.node_id].estimate(load.requests + 1, load.context_tokens + prompt_tokens)
            for node, load in zip(nodes, loads, strict=True)
        ]

    def tbt_floors(
        self, nodes: Sequence[NodeState], at_s: float, now_s: float, req: ScheduleRequest
    ) -> list[float]:
        """Lower bounds of ``tbt_at`` for each of ``nodes``, over arrays: each node's
        forecast (this scheduler's decodes there in one pass over their columns,
        ``own_loads``; then ``with_foreign``'s arithmetic for the decodes its agent
        reports beyond ours) and its model's ``floor`` of the estimate
        (``decode_floors``). Per-node inputs from the columns (``node_columns``); Python
        work only for the nodes with decodes of ours."""
        lengths = self.lengths_for(req)
        columns = self._table.columns(nodes)
        count = len(nodes)
        reported = columns.running
        requests, context, running_now = np.zeros(count), np.zeros(count), np.zeros(count)
        busy = np.flatnonzero(columns.placed > 0).tolist()
        if busy:
            books = self._books
            own = self._own_loads([books[nodes[i].node_id] for i in busy], at_s, now_s)
            requests[busy] = [load.requests for load in own]
            context[busy] = [load.context_tokens for load in own]
            running_now[busy] = [load.running_now for load in own]
        # with_foreign: the reported decodes beyond ours, each with our mean context,
        # running at ``at_s`` with the arriving request's survival at the reported step.
        foreign = np.maximum(reported - running_now, 0.0)
        mean_context = np.where(requests > 0, context / np.where(requests > 0, requests, 1.0), 0.0)
        if at_s <= now_s:
            share = np.ones(count)
        else:
            step = columns.step_s
            positive = step > 0
            ahead = (at_s - now_s) / np.where(positive, step, 1.0)
            share = np.where(positive, lengths.survivals(ahead), 0.0)
        requests += foreign * share
        context += foreign * share * mean_context
        floors = decode_floors(columns.decode_terms, requests + 1, context + req.prompt_tokens)
        out: list[float] = floors.tolist()
        return out

    def load_s(self, node: NodeState, req: ScheduleRequest) -> float:
        """Time to load the node's lower-tier blocks of this prompt back onto its device."""
        hits = req.tier_blocks.get(node.node_id)
        return tier_load_s(
            hits, node.block_size * node.kv_bytes_per_token, node.tier_read_bytes_per_s
        )

    def lend_wait_s(self, node: NodeState) -> float:
        """Predicted wait before ``node`` can lend a prefix (``NodeState.lend_wait``).

        "running": what is left of the oldest of this scheduler's prefills pending there
        (under FIFO the one running): its predicted end, from when it could start (its
        assignment, or the end of the previous one there) plus its predicted duration,
        less the decision's time, plus the lends of our pulls already waiting there
        (lends go before waiting prefills, first come first served among themselves);
        with none of ours pending, the queue (other conductors' work and our lends).
        Never more than the queue.
        """
        if node.lend_wait == "none":
            return 0.0
        queue = self.queue_s(node)
        if node.lend_wait == "running":
            book = self._book(node.node_id)
            for rid, duration_s in book.pending_prefill_s.items():
                since = book.pending_since_s.get(rid, self._decision_now_s)
                started = max(since, book.prefill_free_s)
                left = max(0.0, started + duration_s - self._decision_now_s)
                if book.pending_lends:
                    left += sum(book.pending_lends.values())
                return min(queue, left)
        return queue

    def lend_s(self, node: NodeState) -> float:
        """Predicted time ``node``'s engine spends lending a prefix: one prefill step
        of one token where lending is a request to its engine (``lend_wait`` not
        "none"; the prefix itself is cached there), else 0."""
        if node.lend_wait == "none":
            return 0.0
        return self.prefill_model(node.node_id).estimate(1, 0)

    def prefill_s(self, node: NodeState, prompt_tokens: int, prefix_blocks: int) -> float:
        """Predicted prefill time of ``prompt_tokens`` reusing ``prefix_blocks`` blocks."""
        cached = min(prompt_tokens - 1, prefix_blocks * node.block_size)
        return self.prefill_model(node.node_id).estimate(prompt_tokens, max(0, cached))

    def prefill_floor_s(self, node: NodeState, prompt_tokens: int, prefix_blocks: int) -> float:
        """A lower bound of ``prefill_s`` with the same arguments (O(1)); it is also
        a lower bound for any more ``prefix_blocks``."""
        cached = min(prompt_tokens - 1, prefix_blocks * node.block_size)
        model = self._prefill_models.get(node.node_id) or self.prefill_model(node.node_id)
        return model.estimate_floor(prompt_tokens, cached if cached > 0 else 0)

    def columns(self, nodes: Sequence[NodeState]) -> NodeColumns:
        """Per-node columns of ``nodes`` (``node_columns``), for bounds over arrays."""
        return self._table.columns(nodes)

    def queues_s(self, nodes: Sequence[NodeState]) -> FloatArray:
        """``queue_s`` of each of ``nodes`` (prefill-capable ones), from the columns."""
        return self._table.columns(nodes).queue_s

    def prefill_floors_s(
        self, nodes: Sequence[NodeState], prompt_tokens: int, *prefix_blocks: IntArray
    ) -> list[FloatArray]:
        """``prefill_floor_s`` of each of ``nodes`` (up to float rounding: a lower bound
        to pass over nodes with) at each array of ``prefix_blocks`` (one per node)."""
        columns = self._table.columns(nodes)
        terms, block_size = columns.prefill_terms, columns.block_size
        limit = prompt_tokens - 1
        cached = [
            np.maximum(np.minimum(b * block_size, limit), 0).astype(np.int64) for b in prefix_blocks
        ]
        return [prefill_floors(terms, prompt_tokens, c) for c in cached]

    # ``node_columns.RowSource``: what a node's row is computed from.
    def prefill_terms(self, node: NodeState) -> tuple[float, float, float, float]:
        return self.prefill_model(node.node_id).floor_row()

    def decode_terms(self, node: NodeState) -> tuple[float, float, float, float]:
        return self.decode_model(node.node_id).floor_row()

    def reported_step_s(self, node: NodeState) -> float:
        node_id = node.node_id
        return self._reported_step_s(node, self._book(node_id), self.decode_model(node_id))

    def placed_decodes(self, node: NodeState) -> int:
        return len(self._book(node.node_id).decodes)

    def _prefill_evidence(self, node: NodeState, prompt_tokens: int, prefix_blocks: int) -> bool:
        cached = max(0, min(prompt_tokens - 1, prefix_blocks * node.block_size))
        return self.prefill_model(node.node_id).has_evidence(prompt_tokens, cached)

    def _node_idle(self, node: NodeState) -> bool:
        book = self._book(node.node_id)
        return not book.pending_prefill_s and node.queued_prefill_tokens == 0

    def decode_slots_free(self, node: NodeState) -> bool:
        """The node can start one more generation (its agent's ``max_running``)."""
        if node.max_running_requests <= 0:
            return True
        placed = len(self._book(node.node_id).decodes)
        return max(placed, node.running_requests) < node.max_running_requests

    # ------------------------------------------------------------------ decision
    def schedule(
        self, req: ScheduleRequest, nodes: Sequence[NodeState], now_s: float
    ) -> Placement | Rejection:
        """Place ``req`` or say why not (and when to retry).

        Admission refuses only on estimates it has evidence for (``has_evidence`` of
        the cost models, or a prior the node measured itself), and never on an
        idle node: a prompt that cannot meet its TTFT SLO even there is served when
        the node is idle (``Retry-After`` is the queue drain), and an idle decode node
        takes any request. Learned estimates therefore cannot lock the service into
        refusing work: every admitted request is a new observation.
        """
        self._lengths_memo = None
        self._decision_now_s = now_s
        self._table.begin()
        try:
            return self._schedule(req, nodes, now_s)
        finally:
            self._table.end()  # its lists are the caller's again

    def _schedule(
        self, req: ScheduleRequest, nodes: Sequence[NodeState], now_s: float
    ) -> Placement | Rejection:
        if len(nodes) >= 2 * policies.VECTOR_MIN_NODES:
            # The roles from the columns kept between decisions (``node_columns``); the
            # lists stay registered with their columns for the stages' bounds. (A
            # smaller fleet keeps at least one stage node by node: a stage that has
            # ``VECTOR_MIN_NODES`` nodes there looks its columns up.)
            table = self._table
            fleet = table.sync(nodes)
            prefill_nodes = table.pick_role("prefill", fleet, fleet.can_prefill)
            decode_nodes = table.pick_role("decode", fleet, fleet.can_decode)
        else:
            # ``can_prefill`` and ``can_decode`` without a property call per node.
            prefill_nodes = [n for n in nodes if n.healthy and n.role in PREFILL_ROLES]
            decode_nodes = [n for n in nodes if n.healthy and n.role in DECODE_ROLES]
        if not prefill_nodes:
            return Rejection("no_prefill_node", self._retry(1.0), math.inf, math.inf)
        if not decode_nodes:
            return Rejection("no_decode_node", self._retry(1.0), math.inf, math.inf)
        ordered = self.policy.order_prefill(req, prefill_nodes, self)
        if req.affinity is not None and ordered[0].node.node_id != req.affinity:
            ordered = _with_affinity(ordered, req.affinity, req.affinity_slack_s)
        best = ordered[0]
        # The P→D KV hand-off for the chosen pair is added once the decode node is known.
        at_s = now_s
        if self.config.admission is Admission.PREDICTIVE:
            at_s = now_s + best.base_ttft_s
        choice = DecodeChoice(req, best.node, at_s, now_s)
        options = self.policy.order_decode(decode_nodes, choice, self)
        if not options:
            return Rejection(
                "no_decode_node", self._retry(self._slot_wait_s(decode_nodes, now_s)),
                best.base_ttft_s, math.inf,
            )  # fmt: skip
        tbt, decode = options[0].tbt_s, options[0].node
        handoff_s = 0.0
        if decode.node_id != best.node.node_id:
            nbytes = req.prompt_tokens * best.node.kv_bytes_per_token
            handoff_s = self.transfer.estimate(best.node.node_id, decode.node_id, nbytes)
        ttft = best.base_ttft_s + handoff_s
        if self.config.admission is not Admission.NONE:
            rejection = self._admit(req, best, decode, ttft, tbt, at_s, now_s)
            if rejection is not None:
                return rejection
        return Placement(
            prefill=best.node.node_id,
            decode=decode.node_id,
            prefix_blocks=best.prefix_blocks,
            migration=best.migration,
            queue_s=best.queue_s,
            prefill_s=best.prefill_s,
            handoff_s=handoff_s,
            ttft_s=ttft,
            tbt_s=tbt,
            cached_tokens=max(
                0, min(req.prompt_tokens - 1, best.prefix_blocks * best.node.block_size)
            ),
        )

    def _admit(
        self,
        req: ScheduleRequest,
        best: PrefillCandidate,
        decode: NodeState,
        ttft: float,
        tbt: float,
        at_s: float,
        now_s: float,
    ) -> Rejection | None:
        """The SLO checks of ``schedule`` (None: admitted)."""
        if ttft > req.slo.ttft_s and not self._node_idle(best.node):
            unloaded = ttft - best.queue_s
            evidence = self._prefill_evidence(best.node, req.prompt_tokens, best.prefix_blocks)
            if evidence and unloaded > req.slo.ttft_s:
                # Unattainable even on an idle node: served once the queue has drained.
                return Rejection("ttft_slo", self._retry(best.queue_s), ttft, tbt)
            if evidence:
                return Rejection("ttft_slo", self._retry(ttft - req.slo.ttft_s), ttft, tbt)
        if tbt > req.slo.tbt_s and self.config.admission is not Admission.PREFILL_ONLY:
            load = self.forecast(decode, at_s, now_s, self.lengths_for(req))
            evidence = self.decode_model(decode.node_id).has_evidence(
                load.requests + 1, load.context_tokens + req.prompt_tokens
            )
            if evidence and load.requests >= 0.5:  # an idle decode node takes anything
                drain = self._tbt_drain_s(decode, req, at_s, now_s)
                return Rejection("tbt_slo", self._retry(drain), ttft, tbt)
        return None

    def _tbt_drain_s(
        self, node: NodeState, req: ScheduleRequest, at_s: float, now_s: float
    ) -> float:
        """Earliest wait after which the decode TBT forecast meets the SLO."""
        for delay in _RETRY_PROBES_S:
            if self.tbt_at(node, at_s + delay, now_s, req) <= req.slo.tbt_s:
                return delay + (at_s - now_s)
        return self.config.max_retry_after_s

    def _slot_wait_s(self, decode_nodes: Sequence[NodeState], now_s: float) -> float:
        """Predicted wait until some decode node has a free slot or room (median end)."""
        best = math.inf
        for node in decode_nodes:
            for d in self._book(node.node_id).decodes.values():
                left = d.lengths.quantile(0.5, d.cap_tokens) - d.tokens_at(now_s)
                end = max(d.start_s, now_s) + max(0.0, left) * d.step_s
                best = min(best, end - now_s)
        return 1.0 if math.isinf(best) else best

    def _retry(self, seconds: float) -> float:
        return min(self.config.max_retry_after_s, max(1.0, seconds))

    # ------------------------------------------------------------------ bookkeeping
    def on_assigned(self, req: ScheduleRequest, placement: Placement, now_s: float) -> None:
        """Record the assignment so the next decisions see its queue and decode load."""
        table = self._table
        table.touch(placement.prefill)
        table.touch(placement.decode)
        book = self._book(placement.prefill)
        book.queue_memo = None
        book.pending_prefill_s[req.request_id] = placement.prefill_s
        book.pending_prefill_tokens[req.request_id] = req.prompt_tokens
        book.pending_cached_tokens[req.request_id] = placement.cached_tokens
        book.pending_since_s[req.request_id] = now_s
        migration = placement.migration
        if migration is not None and migration.lend_s > 0:
            source = self._book(migration.source)
            source.pending_lends[req.request_id] = migration.lend_s
            source.queue_memo = None
            table.touch(migration.source)
        decode = PlacedDecode(
            start_s=now_s + placement.ttft_s,
            step_s=placement.tbt_s,
            prompt_tokens=req.prompt_tokens,
            cap_tokens=max(1, req.max_new_tokens),
            lengths=self.lengths_for(req),
            length_key=req.length_key,
        )
        self._book(placement.decode).add_decode(req.request_id, decode)

    def on_prefill_done(
        self, request_id: str, node: NodeId, total_tokens: int, cached_tokens: int,
        duration_s: float | None, now_s: float | None = None,
    ) -> None:  # fmt: skip
        """The prefill finished (or failed: ``duration_s`` None) at ``now_s`` (None: not
        told; the next prefill there is then taken to start when it was assigned);
        learn from its duration."""
        self._table.touch(node)
        book = self._book(node)
        book.queue_memo = None
        book.pending_prefill_s.pop(request_id, None)
        book.pending_prefill_tokens.pop(request_id, None)
        book.pending_cached_tokens.pop(request_id, None)
        if book.pending_since_s.pop(request_id, None) is not None and now_s is not None:
            book.prefill_free_s = max(book.prefill_free_s, now_s)
        if duration_s is not None and duration_s > 0:
            self.prefill_model(node).observe(total_tokens, cached_tokens, duration_s)

    def on_pulled(self, request_id: str, source: NodeId) -> None:
        """The request's prefix pull from ``source`` ended (done, failed or given up):
        the lend booked there no longer waits on its queue."""
        book = self._books.get(source)
        if book is not None and book.pending_lends.pop(request_id, None) is not None:
            book.queue_memo = None
            self._table.touch(source)

    def on_decode_started(self, request_id: str, node: NodeId, now_s: float) -> None:
        self._book(node).start_decode(request_id, now_s)

    def on_finished(
        self,
        request_id: str,
        prefill: NodeId,
        decode: NodeId,
        *,
        output_tokens: int | None = None,
        stopped: bool = False,
        now_s: float | None = None,
    ) -> None:
        """The request left the system (done, failed or cancelled) at ``now_s``.

        ``output_tokens`` with ``stopped`` (the model ended it) is an exact output
        length; without ``stopped`` (max_tokens, cancelled, failed) it says only that
        the length is at least that much. Both teach the output-length model.
        """
        self._table.touch(prefill)
        self._table.touch(decode)
        book = self._book(prefill)
        book.queue_memo = None
        book.pending_prefill_s.pop(request_id, None)
        book.pending_prefill_tokens.pop(request_id, None)
        book.pending_cached_tokens.pop(request_id, None)
        book.pending_since_s.pop(request_id, None)
        decode_book = self._book(decode)
        d = decode_book.pop_decode(request_id)
        decodes = decode_book.decodes
        if d is not None and d.started and now_s is not None and now_s > d.start_s:
            # Hand its share of the batch to the decodes that ran beside it.
            for o in decodes.values():
                if o.started and now_s > max(o.start_s, d.start_s):
                    begin = max(o.start_s, d.start_s)
                    o.others_s += now_s - begin
                    o.others_context_s += (now_s - begin) * mean_context(d, begin, now_s)
        if d is not None and output_tokens is not None and output_tokens > 0:
            model, tenant = d.length_key
            self.output_lengths.observe(model, tenant, output_tokens, censored=not stopped)

    def observe_decode(
        self, request_id: str, node: NodeId, mean_gap_s: float, now_s: float
    ) -> tuple[float, float] | None:
        """A decode ending at ``now_s`` ran at ``mean_gap_s`` per token: learn from it.

        The gap is a mean over the request's whole decode, so it is paired with the batch
        and context averaged over the same interval (this request, plus every other decode
        of this scheduler on the node weighted by how long it overlapped) — not with the
        batch at the end, which a decode that ran through a burst never saw. Call before
        ``on_finished``. Returns the (batch, context) it learned at, None when the
        request's decode never started here. O(decodes on the node).
        """
        d = self._book(node).decodes.get(request_id)
        if d is None or not d.started or mean_gap_s <= 0:
            return None
        span = now_s - d.start_s
        if span <= 0:
            return None
        others_s, others_context_s = d.others_s, d.others_context_s
        for other_id, o in self._book(node).decodes.items():
            if other_id != request_id and o.started:
                overlap = now_s - max(o.start_s, d.start_s)
                if overlap > 0:
                    others_s += overlap
                    others_context_s += overlap * mean_context(o, now_s - overlap, now_s)
        batch = 1.0 + others_s / span
        context = mean_context(d, d.start_s, now_s) + others_context_s / span
        self.decode_model(node).observe(batch, context, mean_gap_s)
        return batch, context

    def active_decodes(self, node: NodeId, now_s: float) -> tuple[int, int]:
        """(requests, context tokens) this scheduler has decoding on ``node`` at ``now_s``."""
        live = [d for d in self._book(node).decodes.values() if d.start_s <= now_s]
        return len(live), sum(d.prompt_tokens + int(d.tokens_at(now_s)) for d in live)
