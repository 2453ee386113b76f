"""GCRA rate limiting: bursts, refill, multi-dimension atomicity, header formats."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conductor.core.ratelimit import Limit, format_reset, gcra_check

RPM = {"requests": Limit(60)}  # one per second, burst of 60


def run(tats: dict[str, float], limits: dict[str, Limit], costs: dict[str, int], now: float):  # type: ignore[no-untyped-def]
    decision, new = gcra_check(tats, limits, costs, now)
    tats.clear()
    tats.update(new)
    return decision


def test_burst_then_refill() -> None:
    tats: dict[str, float] = {}
    allowed = [run(tats, RPM, {"requests": 1}, 0.0).allowed for _ in range(61)]
    assert allowed == [True] * 60 + [False]
    refused = run(tats, RPM, {"requests": 1}, 0.0)
    assert refused.retry_after_s == pytest.approx(1.0)
    assert refused.dimensions["requests"].remaining == 0
    assert run(tats, RPM, {"requests": 1}, 1.0).allowed
    assert not run(tats, RPM, {"requests": 1}, 1.0).allowed


def test_remaining_and_reset() -> None:
    tats: dict[str, float] = {}
    d = run(tats, RPM, {"requests": 1}, 10.0)
    assert d.dimensions["requests"].remaining == 59
    assert d.dimensions["requests"].reset_s == pytest.approx(1.0)


def test_all_dimensions_or_nothing() -> None:
    limits = {"requests": Limit(100), "tokens": Limit(1000)}
    tats: dict[str, float] = {}
    assert run(tats, limits, {"requests": 1, "tokens": 900}, 0.0).allowed
    refused = run(tats, limits, {"requests": 1, "tokens": 200}, 0.0)
    assert not refused.allowed
    assert refused.refused_by == "tokens"
    assert refused.retry_after_s == pytest.approx(200 * 60 / 1000 - 100 * 60 / 1000)
    # The refused request consumed nothing: the request dimension is where it was.
    assert refused.dimensions["requests"].remaining == 99
    assert run(tats, limits, {"requests": 1, "tokens": 100}, 0.0).allowed


def test_unlimited_dimension_is_ignored() -> None:
    d, new = gcra_check({}, {"requests": Limit(0)}, {"requests": 10**9}, 0.0)
    assert d.allowed
    assert new == {}


def test_cost_larger_than_limit_never_fits() -> None:
    d, _ = gcra_check({}, {"tokens": Limit(100)}, {"tokens": 101}, 0.0)
    assert not d.allowed


@given(
    st.lists(st.tuples(st.floats(0, 5), st.integers(0, 20)), min_size=1, max_size=200),
    st.integers(1, 100),
)
def test_never_more_than_limit_plus_refill(events: list[tuple[float, int]], limit: int) -> None:
    """Over any run, admitted units ≤ burst + refill over the elapsed time."""
    tats: dict[str, float] = {}
    now = 0.0
    admitted = 0
    for dt, cost in events:
        now += dt
        if run(tats, {"u": Limit(limit)}, {"u": cost}, now).allowed:
            admitted += cost
    assert admitted <= limit + limit * now / 60.0 + 1e-6


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0, "0ms"), (0.0171, "18ms"), (1.0, "1s"), (1.44, "1.5s"), (59.99, "60s"), (360, "6m0s")],
)
def test_reset_format(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text
