"""Rate limiting by GCRA (generic cell rate algorithm), pure.

A limit of ``limit`` units per ``period_s`` (e.g. 600 requests/min) allows a burst of
``limit`` and refills continuously at ``limit/period_s``. State per (tenant, dimension)
is one number, the theoretical arrival time ``tat``. A request of ``cost`` units at
``now`` is allowed iff ``max(tat, now) + cost·T - now <= period_s`` with ``T = period_s /
limit``; then ``tat`` advances. Several dimensions (requests, tokens) are checked
together and consumed only if all allow — the Redis Lua script in
``conductor/adapters/ratelimit.py`` implements exactly this, atomically.

Outputs match OpenAI's headers: ``remaining`` units now, ``reset_s`` until the bucket is
full again, and on refusal ``retry_after_s`` until the cost would fit. O(1) per check.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Limit:
    limit: int  # units per period (0 = unlimited)
    period_s: float = 60.0


@dataclass(frozen=True, slots=True)
class DimensionResult:
    limit: int
    remaining: int
    reset_s: float


@dataclass(frozen=True, slots=True)
class RateDecision:
    allowed: bool
    retry_after_s: float
    dimensions: Mapping[str, DimensionResult]
    refused_by: str | None = None


def gcra_check(
    tats: Mapping[str, float],
    limits: Mapping[str, Limit],
    costs: Mapping[str, int],
    now_s: float,
) -> tuple[RateDecision, dict[str, float]]:
    """Check every limited dimension; return the decision and the new ``tat`` values
    (unchanged when refused). Dimensions with ``limit == 0`` are unlimited."""
    new_tats: dict[str, float] = {}
    results: dict[str, DimensionResult] = {}
    refused_by: str | None = None
    retry_after = 0.0
    for name, lim in limits.items():
        if lim.limit <= 0:
            continue
        interval = lim.period_s / lim.limit
        tat = max(tats.get(name, now_s), now_s)
        cost = max(0, costs.get(name, 0))
        new_tat = tat + cost * interval
        if new_tat - now_s > lim.period_s + 1e-9:
            wait = new_tat - now_s - lim.period_s
            if refused_by is None or wait > retry_after:
                refused_by, retry_after = name, wait
            new_tat = tat
        results[name] = dimension_state(lim, new_tat, now_s)
        new_tats[name] = new_tat
    if refused_by is not None:
        unchanged = {n: tats.get(n, now_s) for n in new_tats}
        refused = {n: dimension_state(limits[n], unchanged[n], now_s) for n in results}
        return RateDecision(False, retry_after, refused, refused_by), unchanged
    return RateDecision(True, 0.0, results), new_tats


def dimension_state(lim: Limit, tat: float, now_s: float) -> DimensionResult:
    """Remaining units and time to full for a dimension whose state is ``tat``."""
    interval = lim.period_s / lim.limit
    backlog = max(0.0, tat - now_s)
    remaining = max(0, math.floor((lim.period_s - backlog) / interval + 1e-6))
    return DimensionResult(lim.limit, remaining, backlog)


def format_reset(seconds: float) -> str:
    """OpenAI's ``x-ratelimit-reset-*`` format: ``17ms``, ``1.5s``, ``6m0s``."""
    seconds = max(0.0, seconds)
    if seconds < 1.0:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60.0:
        return f"{math.ceil(seconds * 10) / 10:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"
