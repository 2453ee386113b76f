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
decodes: from ``VECTOR_MIN_DECODES`` on, ``NodeBook.forecast`` evaluates the node's
decodes as NumPy columns (``DecodeColumns``, rebuilt after the book changes) instead of
one by one. Both paths perform the same IEEE operations in the same order per decode and
sum in the same order, so the forecast is bit-for-bit the same (a hypothesis test
compares them): decisions do not depend on which path ran.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Final, NamedTuple

import numpy as np
import numpy.typing as npt

from conductor.core.cost_model import DecodeTimeModel
from conductor.core.output_length import LengthDistribution, SurvivalTable

__all__ = [
    "VECTOR_MIN_DECODES",
    "DecodeColumns",
    "DecodeForecast",
    "NodeBook",
    "PlacedDecode",
    "forecast_columns",
    "forecast_decode_load",
    "mean_context",
]

# Decodes on a node from which its forecast runs over NumPy columns (below this the
# per-call overhead of NumPy costs more than the loop; docs/benchmarks.md).
VECTOR_MIN_DECODES: Final = 32


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

    def forecast(
        self,
        reported_running: int,
        at_s: float,
        now_s: float,
        lengths: LengthDistribution,
        model: DecodeTimeModel,
        reported_step_s: float | None = None,
    ) -> DecodeForecast:
        """``forecast_decode_load`` of this node's decodes (over columns when there
        are ``VECTOR_MIN_DECODES`` or more; the same result either way)."""
        if len(self.decodes) < VECTOR_MIN_DECODES:
            return forecast_decode_load(
                self.decodes.values(), reported_running, at_s, now_s, lengths, model,
                reported_step_s,
            )  # fmt: skip
        columns = self.columns
        if columns is None:
            columns = self.columns = DecodeColumns(self.decodes.values())
        return forecast_columns(
            columns, reported_running, at_s, now_s, lengths, model, reported_step_s
        )


class DecodeColumns:
    """A node's placed decodes as arrays, in the book's order (``PlacedDecode``'s
    fields; distributions shared by several decodes stacked once)."""

    __slots__ = ("cap", "cap_done", "count", "prompt", "start_s", "step_s", "stepping", "table")

    def __init__(self, decodes: Collection[PlacedDecode]) -> None:
        rows: dict[int, int] = {}
        dists: list[LengthDistribution] = []
        row_of: list[int] = []
        for d in decodes:
            row = rows.get(id(d.lengths))
            if row is None:
                row = rows[id(d.lengths)] = len(dists)
                dists.append(d.lengths)
            row_of.append(row)
        self.count = len(row_of)
        self.start_s = np.array([d.start_s for d in decodes], dtype=np.float64)
        self.step_s = np.array([d.step_s for d in decodes], dtype=np.float64)
        self.stepping = self.step_s > 0
        self.prompt = np.array([float(d.prompt_tokens) for d in decodes], dtype=np.float64)
        self.cap = np.array([float(d.cap_tokens) for d in decodes], dtype=np.float64)
        self.cap_done = np.maximum(0.0, self.cap - 1.0)  # the most tokens "done" can say
        self.table = SurvivalTable(dists, np.array(row_of, dtype=np.intp))

    def tokens_at(self, t_s: float) -> npt.NDArray[np.float64]:
        """``PlacedDecode.tokens_at`` of every decode."""
        ticking = (t_s > self.start_s) & self.stepping
        return np.divide(t_s - self.start_s, self.step_s, out=np.zeros(self.count), where=ticking)

    def active_probability(
        self, at_s: float, now_s: float, target: npt.NDArray[np.float64]
    ) -> npt.NDArray[np.float64]:
        """``PlacedDecode.active_probability`` of every decode (``target``: their
        ``tokens_at(at_s)``)."""
        if at_s <= now_s:
            return np.where(at_s < self.start_s, 0.0, 1.0)
        done = np.minimum(self.tokens_at(now_s), self.cap_done)
        alive = self.table.conditional_survival(done, np.maximum(done, target))
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
    return _with_foreign(
        requests, context, running_now, reported_running, at_s, now_s, lengths, model,
        reported_step_s,
    )  # fmt: skip


def forecast_columns(
    columns: DecodeColumns,
    reported_running: int,
    at_s: float,
    now_s: float,
    lengths: LengthDistribution,
    model: DecodeTimeModel,
    reported_step_s: float | None = None,
) -> DecodeForecast:
    """``forecast_decode_load`` over ``columns``: the same result, bit for bit (the
    per-decode terms are the same operations; ``add.accumulate`` sums them in order,
    the skipped ones as exact zeros)."""
    requests = 0.0
    context = 0.0
    if columns.count:
        target = columns.tokens_at(at_s)
        p = columns.active_probability(at_s, now_s, target)
        live = p > 0
        requests = float(np.add.accumulate(np.where(live, p, 0.0))[-1])
        terms = np.where(live, p * (columns.prompt + target), 0.0)
        context = float(np.add.accumulate(terms)[-1])
    running_now = int(np.count_nonzero(columns.start_s <= now_s))
    return _with_foreign(
        requests, context, running_now, reported_running, at_s, now_s, lengths, model,
        reported_step_s,
    )  # fmt: skip


def _with_foreign(
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
    """Our decodes' expected load plus the reported decodes beyond ours."""
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
