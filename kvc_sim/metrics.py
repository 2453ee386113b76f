"""Per-request records of a simulated replay and the summary statistics drawn from them.

What it computes (definitions follow the paper, §7.1)
    * ``hit_ratio``: cached input tokens / input tokens, over every request that was
      prefilled (served, or refused by its decode node afterwards). Migrated prefixes
      count as cached: they were not recomputed.
    * ``ttft_*``: arrival → first token, over served requests. ``tbt`` of a request: the
      mean of the longest 10% of its token gaps (at least one gap); ``tbt_p90_s`` is the
      90th percentile of that over served requests with two or more output tokens.
    * ``rejected``: 429s before any work plus refusals after the prefill;
      ``wasted_prefill_s``: GPU seconds of prefills whose request was then refused.
    * ``prefill_gpu_s``: GPU seconds of every prefill (``prefill_gpu_s_per_request``: the
      mean, the paper's Fig. 15/17 metric).
    * ``effective_capacity_ratio``: share of *all* requests (rejected ones included)
      served with TTFT <= the TTFT SLO and TBT <= the TBT SLO; ``effective_capacity_by_tbt``
      the same for each TBT threshold (the paper's 100/200/300 ms).
    * ``RetentionCounts`` (clusters that honour prompt-cache breakpoints only): the
      allocations that asked for a retention and what the pools answered, and the share
      of the pools' blocks retained (load samples, mean over the prefill nodes).

Knobs: the TTFT/TBT SLOs and TBT thresholds passed to ``summarize``. Percentiles are
nearest-rank on the sorted sample. Complexity O(R log R) for R requests.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "LoadSample",
    "RequestOutcome",
    "RequestRecord",
    "RetentionCounts",
    "SimResult",
    "Summary",
    "percentile",
    "summarize",
    "top_decile_mean",
]

RequestOutcome = Literal["completed", "rejected", "rejected_after_prefill"]


@dataclass(frozen=True, slots=True)
class RequestRecord:
    request_id: str
    arrival_s: float
    input_tokens: int
    output_tokens: int
    outcome: RequestOutcome
    reject_reason: str | None
    prefill_node: str | None
    decode_node: str | None
    cached_tokens: int
    migrated_tokens: int
    prefill_s: float  # GPU seconds spent on its prefill (0 if none)
    ttft_s: float | None
    tbt_s: float | None  # mean of the longest 10% of token gaps
    finish_s: float | None


@dataclass(frozen=True, slots=True)
class LoadSample:
    t_s: float
    prefill_load: float  # mean over prefill nodes of predicted queue time / TTFT SLO
    decode_load: float  # mean over decode nodes of the current step time / TBT SLO
    prefill_queue_tokens: int
    decode_requests: int
    cache_used_ratio: float  # cached + allocated blocks / capacity, mean over prefill nodes
    retained_ratio: float = 0.0  # retained blocks / capacity, mean over prefill nodes


@dataclass(frozen=True, slots=True)
class RetentionCounts:
    """What became of the breakpoints a replay passed to the pools (``retain=``)."""

    requests: int = 0  # allocations that carried breakpoints
    granted: int = 0
    over_budget: int = 0  # refused: the tenant's block-second budget
    node_full: int = 0  # refused: the node retains as many blocks as it may
    retained_ratio_mean: float = 0.0  # retained blocks / pool capacity, over load samples
    retained_ratio_max: float = 0.0


@dataclass(frozen=True, slots=True)
class SimResult:
    records: tuple[RequestRecord, ...]
    samples: tuple[LoadSample, ...]
    migrations: int
    migrated_blocks: int
    virtual_s: float
    events: int
    wall_s: float
    prefill_busy_s: float = 0.0  # GPU seconds the prefill nodes spent computing
    prefill_instances: int = 0
    retention: RetentionCounts | None = None  # None: breakpoints ignored (LRU only)
    donated_blocks: int = 0  # victims a peer took instead of their being dropped
    donation_hits: int = 0  # reuses of donated blocks on the peers that took them


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a sample; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[rank]


def top_decile_mean(gaps: Sequence[float]) -> float:
    """Mean of the longest 10% of ``gaps`` (at least one): the paper's TBT of a request."""
    k = max(1, math.ceil(len(gaps) * 0.1))
    longest = sorted(gaps, reverse=True)[:k]
    return sum(longest) / k


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else math.nan


@dataclass(frozen=True, slots=True)
class Summary:
    """One run's figures: the per-policy block of ``summary.json``."""

    requests: int
    completed: int
    hit_ratio: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tbt_p90_s: float
    rejected: int
    rejected_before_prefill: int
    rejected_after_prefill: int
    wasted_prefill_s: float
    prefill_gpu_s: float
    prefill_gpu_s_per_request: float
    effective_capacity_ratio: float
    effective_capacity_by_tbt: dict[str, float]
    migrations: int
    migrated_tokens: int
    prefill_utilization: float  # busy / (prefill nodes x virtual time)
    virtual_s: float
    events: int
    sim_wall_s: float
    donated_blocks: int = 0
    donation_hits: int = 0


def summarize(
    result: SimResult, ttft_slo_s: float, tbt_slo_s: float, tbt_thresholds_s: Sequence[float]
) -> Summary:
    """The figures of one run (definitions in the module docstring)."""
    records = result.records
    served = [r for r in records if r.outcome == "completed"]
    prefilled = [r for r in records if r.outcome != "rejected"]
    ttfts = [r.ttft_s for r in served if r.ttft_s is not None]
    tbts = [r.tbt_s for r in served if r.tbt_s is not None]
    input_tokens = sum(r.input_tokens for r in prefilled)
    cached = sum(r.cached_tokens for r in prefilled)
    prefill_gpu_s = sum(r.prefill_s for r in prefilled)
    n = len(records)

    def effective(tbt_limit_s: float) -> float:
        ok = 0
        for r in served:
            if r.ttft_s is None or r.ttft_s > ttft_slo_s:
                continue
            if r.tbt_s is not None and r.tbt_s > tbt_limit_s:
                continue
            ok += 1
        return ok / n if n else math.nan

    return Summary(
        requests=n,
        completed=len(served),
        hit_ratio=cached / input_tokens if input_tokens else math.nan,
        ttft_mean_s=_mean(ttfts),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        tbt_p90_s=percentile(tbts, 90),
        rejected=sum(1 for r in records if r.outcome != "completed"),
        rejected_before_prefill=sum(1 for r in records if r.outcome == "rejected"),
        rejected_after_prefill=sum(1 for r in records if r.outcome == "rejected_after_prefill"),
        wasted_prefill_s=sum(r.prefill_s for r in records if r.outcome == "rejected_after_prefill"),
        prefill_gpu_s=prefill_gpu_s,
        prefill_gpu_s_per_request=prefill_gpu_s / len(prefilled) if prefilled else math.nan,
        effective_capacity_ratio=effective(tbt_slo_s),
        effective_capacity_by_tbt={f"{t:g}": effective(t) for t in tbt_thresholds_s},
        migrations=result.migrations,
        migrated_tokens=sum(r.migrated_tokens for r in records),
        prefill_utilization=(
            result.prefill_busy_s / (result.prefill_instances * result.virtual_s)
            if result.prefill_instances and result.virtual_s > 0
            else math.nan
        ),
        virtual_s=result.virtual_s,
        events=result.events,
        sim_wall_s=result.wall_s,
        donated_blocks=result.donated_blocks,
        donation_hits=result.donation_hits,
    )
