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
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from conductor.core.cost_model import DecodeTimeModel
from conductor.core.output_length import LengthDistribution

__all__ = ["DecodeForecast", "NodeBook", "PlacedDecode", "forecast_decode_load", "mean_context"]


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
