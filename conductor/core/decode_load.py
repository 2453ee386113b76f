"""Decode load as one scheduler sees it: the decodes it placed per node and its forecast.

Each ``PlacedDecode`` is a decode this scheduler assigned: its predicted (then actual)
first-token time, its predicted step time, its prompt and its output-length distribution
(learned per (model, tenant), capped by the client's ``max_tokens``). A ``NodeBook``
holds a node's placed decodes and pending prefills.

``forecast_decode_load`` predicts a node's decode batch at a future moment ``at_s``: each
placed decode counts with the probability that it is still running then, from its
output-length distribution given what it has produced by ``now_s`` (a decode past its
typical length stays, with a heavy tail); decodes whose prefill ends before ``at_s``
join. Decodes the agent reports beyond ours (other conductors') count fully now and,
later, with the survival of the arriving request's distribution, their step time taken
from the node's decode-time model at the reported batch. O(decodes on the node).

Every decision forecasts every decode node, and a busy decode node runs hundreds of
decodes: the nodes with ``VECTOR_MIN_DECODES`` or more of ours are evaluated together,
in one NumPy pass over all their decodes (``own_loads`` over each book's
``DecodeColumns``, rebuilt only after the book changes; the distributions sit in one
shared ``SurvivalTable``), the others decode by decode. Both paths perform the same
IEEE operations in the same order per decode and sum each node's terms in the same
order, so the forecast is bit-for-bit the same (hypothesis tests compare them):
decisions do not depend on which path ran.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, NamedTuple

import numpy as np
import numpy.typing as npt

from conductor.core.cost_model import DecodeTimeModel
from conductor.core.output_length import LengthDistribution, SurvivalEntries, SurvivalTable

__all__ = [
    "VECTOR_MIN_DECODES",
    "DecodeColumns",
    "DecodeForecast",
    "NodeBook",
    "OwnLoad",
    "PlacedDecode",
    "forecast_decode_load",
    "mean_context",
    "own_loads",
    "with_foreign",
]

# Decodes on a node from which its forecast joins the one pass over NumPy columns
# (below this the loop costs less than the node's columns; docs/benchmarks.md).
VECTOR_MIN_DECODES: Final = 8


@dataclass(slots=True)
class PlacedDecode:
    """One decode this scheduler placed: when it starts, how fast it runs, how long it may be."""

    start_s: float  # predicted first-token time; the actual one once known
    step_s: float  # predicted time between its tokens
    prompt_tokens: int
    cap_tokens: int  # the client's max_tokens
    lengths: LengthDistribution  # its output length, learned per (model, tenant)
    length_key: tuple[str, str]
    started: bool = False
    # What other decodes on its node added while it ran, from those that already left:
    # request-seconds and context-token-seconds (see ``Scheduler.observe_decode``).
    others_s: float = 0.0
    others_context_s: float = 0.0

    def tokens_at(self, t_s: float) -> float:
        """Output tokens predicted to exist at ``t_s`` (0 before the first token)."""
        if t_s <= self.start_s or self.step_s <= 0:
            return 0.0
        return (t_s - self.start_s) / self.step_s

    def active_probability(self, at_s: float, now_s: float) -> float:
        """P(still decoding at ``at_s``), knowing it was still running at ``now_s``."""
        if at_s < self.start_s:
            return 0.0  # its prefill has not ended yet then
        if at_s <= now_s:
            return 1.0  # running now (the scheduler is told when it ends)
        target = self.tokens_at(at_s)
        if target >= self.cap_tokens:
            return 0.0  # max_tokens stops it by then
        done = min(self.tokens_at(now_s), max(0.0, self.cap_tokens - 1.0))
        return self.lengths.conditional_survival(done, max(done, target))


def mean_context(d: PlacedDecode, begin_s: float, end_s: float) -> float:
    """Mean context (prompt + generated tokens) of ``d`` over ``[begin_s, end_s]``."""
    return d.prompt_tokens + (d.tokens_at(begin_s) + d.tokens_at(end_s)) / 2


@dataclass(slots=True)
class NodeBook:
    """What one scheduler assigned to one node: pending prefills and placed decodes."""

    pending_prefill_s: dict[str, float] = field(default_factory=dict)
    pending_prefill_tokens: dict[str, int] = field(default_factory=dict)
    pending_cached_tokens: dict[str, int] = field(default_factory=dict)
    pending_model_version: int = -1  # the prefill model's version the estimates are from
    pending_since_s: dict[str, float] = field(default_factory=dict)  # when assigned
    prefill_free_s: float = -math.inf  # when the last of ours ended there (if told when)
    # Lend requests of our prefix pulls from this node (its engine lends with a request
    # of its own, ahead of waiting prefills): predicted seconds per pulling request.
    pending_lends: dict[str, float] = field(default_factory=dict)
    # Changed only through add_decode, pop_decode and start_decode (they drop ``columns``).
    decodes: dict[str, PlacedDecode] = field(default_factory=dict)
    # The last queue estimate: (prefill model version, agent-reported queued tokens,
    # seconds); None once the pending prefills or lends above change.
    queue_memo: tuple[int, int, float] | None = None
    # The decode step at the agent-reported batch: (decode model version, reported
    # running requests, seconds).
    step_memo: tuple[int, int, float] | None = None
    # ``decodes`` as columns for the forecast; None after any change to them.
    columns: DecodeColumns | None = None

    def add_decode(self, request_id: str, decode: PlacedDecode) -> None:
        self.decodes[request_id] = decode
        self.columns = None

    def pop_decode(self, request_id: str) -> PlacedDecode | None:
        decode = self.decodes.pop(request_id, None)
        if decode is not None:
            self.columns = None
        return decode

    def start_decode(self, request_id: str, now_s: float) -> None:
        """The decode's first token came at ``now_s`` (its prediction is replaced)."""
        d = self.decodes.get(request_id)
        if d is not None:
            d.start_s, d.started = now_s, True
            self.columns = None

    def columns_in(self, table: SurvivalTable) -> DecodeColumns:
        """``decodes`` as columns, distributions in ``table`` (kept until they change)."""
        columns = self.columns
        if columns is None or columns.epoch != table.epoch:
            columns = self.columns = DecodeColumns.build(self.decodes.values(), table)
        return columns


@dataclass(frozen=True, slots=True)
class DecodeColumns:
    """Placed decodes as arrays, in their book's order (``PlacedDecode``'s fields, and
    their distributions as ``SurvivalTable`` entries of table epoch ``epoch``)."""

    count: int
    start_s: npt.NDArray[np.float64]
    step_s: npt.NDArray[np.float64]
    prompt: npt.NDArray[np.float64]
    cap: npt.NDArray[np.float64]
    entries: SurvivalEntries
    epoch: int

    @staticmethod
    def build(decodes: Collection[PlacedDecode], table: SurvivalTable) -> DecodeColumns:
        rows = np.fromiter((table.row(d.lengths) for d in decodes), np.intp, len(decodes))
        return DecodeColumns(
            count=len(decodes),
            start_s=np.array([d.start_s for d in decodes], dtype=np.float64),
            step_s=np.array([d.step_s for d in decodes], dtype=np.float64),
            prompt=np.array([float(d.prompt_tokens) for d in decodes], dtype=np.float64),
            cap=np.array([float(d.cap_tokens) for d in decodes], dtype=np.float64),
            entries=table.entries(rows),
            epoch=table.epoch,
        )

    @staticmethod
    def join(parts: Sequence[DecodeColumns]) -> DecodeColumns:
        """The decodes of ``parts`` one after another (of one table epoch)."""
        if len(parts) == 1:
            return parts[0]
        return DecodeColumns(
            count=sum(p.count for p in parts),
            start_s=np.concatenate([p.start_s for p in parts]),
            step_s=np.concatenate([p.step_s for p in parts]),
            prompt=np.concatenate([p.prompt for p in parts]),
            cap=np.concatenate([p.cap for p in parts]),
            entries=SurvivalEntries.join([p.entries for p in parts]),
            epoch=parts[0].epoch,
        )

    def tokens_at(self, t_s: float) -> npt.NDArray[np.float64]:
        """``PlacedDecode.tokens_at`` of every decode."""
        ticking = (t_s > self.start_s) & (self.step_s > 0)
        return np.divide(t_s - self.start_s, self.step_s, out=np.zeros(self.count), where=ticking)

    def active_probability(
        self, table: SurvivalTable, at_s: float, now_s: float, target: npt.NDArray[np.float64]
    ) -> npt.NDArray[np.float64]:
        """``PlacedDecode.active_probability`` of every decode (``target``: their
        ``tokens_at(at_s)``)."""
        if at_s <= now_s:
            return np.where(at_s < self.start_s, 0.0, 1.0)
        done = np.minimum(self.tokens_at(now_s), np.maximum(0.0, self.cap - 1.0))
        ahead = np.maximum(done, target)
        alive = table.conditional_survival(done, ahead, self.entries.twice())
        return np.where((at_s < self.start_s) | (target >= self.cap), 0.0, alive)


class DecodeForecast(NamedTuple):
    """Decode load on a node at a moment: expected batch (requests) and KV tokens (a
    named tuple: one per decode node per decision)."""

    requests: float
    context_tokens: float


def forecast_decode_load(
    decodes: Iterable[PlacedDecode],
    reported_running: int,
    at_s: float,
    now_s: float,
    lengths: LengthDistribution,
    model: DecodeTimeModel,
    reported_step_s: float | None = None,
) -> DecodeForecast:
    """Expected decode batch at ``at_s`` of a node running ``decodes`` (ours) and
    ``reported_running`` in all (its agent's count); ``lengths``: the arriving request's.
    ``reported_step_s``: ``model``'s step at the reported batch, if the caller has it."""
    requests = 0.0
    context = 0.0
    running_now = 0
    for d in decodes:
        if d.start_s <= now_s:
            running_now += 1
        p = d.active_probability(at_s, now_s)
        if p > 0:
            requests += p
            context += p * (d.prompt_tokens + d.tokens_at(at_s))
    return with_foreign(
        requests, context, running_now, reported_running, at_s, now_s, lengths, model,
        reported_step_s,
    )  # fmt: skip


class OwnLoad(NamedTuple):
    """This scheduler's decodes on a node at a moment: expected requests, expected
    context tokens, and how many run now (the parts of ``forecast_decode_load`` before
    the node's other decodes are reconciled in by ``with_foreign``)."""

    requests: float
    context_tokens: float
    running_now: int


def own_loads(
    parts: Sequence[DecodeColumns], table: SurvivalTable, at_s: float, now_s: float
) -> list[OwnLoad]:
    """Each part's own load at ``at_s``, evaluated in one pass over all their decodes:
    bit for bit what ``forecast_decode_load``'s loop sums (the per-decode terms are the
    same operations; each part's terms are summed in order by ``add.accumulate`` along
    a row padded with exact zeros). Every part must hold at least one decode."""
    joined = DecodeColumns.join(parts)
    target = joined.tokens_at(at_s)
    p = joined.active_probability(table, at_s, now_s, target)
    live = p > 0
    terms = np.concatenate(
        (np.where(live, p, 0.0), np.where(live, p * (joined.prompt + target), 0.0))
    )
    counts = np.fromiter((part.count for part in parts), np.intp, len(parts))
    firsts = np.cumsum(counts) - counts
    width = int(counts.max())
    # Entry i of part r goes to column i - firsts[r] of row r (requests rows, then context).
    slot = np.arange(joined.count) + np.repeat(np.arange(len(parts)) * width - firsts, counts)
    rows = np.zeros(2 * len(parts) * width)
    rows[np.concatenate((slot, slot + len(parts) * width))] = terms
    sums = np.add.accumulate(rows.reshape(2 * len(parts), width), axis=1)[:, -1].tolist()
    running = np.add.reduceat((joined.start_s <= now_s).astype(np.intp), firsts).tolist()
    return [OwnLoad(sums[r], sums[len(parts) + r], running[r]) for r in range(len(parts))]


def with_foreign(
    requests: float,
    context: float,
    running_now: int,
    reported_running: int,
    at_s: float,
    now_s: float,
    lengths: LengthDistribution,
    model: DecodeTimeModel,
    reported_step_s: float | None,
) -> DecodeForecast:
    """Our decodes' expected load plus the node's decodes beyond ours (the end of
    ``forecast_decode_load``)."""
    foreign = max(0, reported_running - running_now)
    if foreign:
        per_decode_context = context / requests if requests > 0 else 0.0
        if at_s <= now_s:
            share = 1.0
        else:
            step = reported_step_s
            if step is None:
                step = model.estimate(max(1, reported_running), 0)
            share = lengths.survival((at_s - now_s) / step) if step > 0 else 0.0
        requests += foreign * share
        context += foreign * share * per_decode_context
    return DecodeForecast(requests, context)
