"""A request's Tx lease covers its predicted time to first token."""

from __future__ import annotations

import math

import pytest

from conductor.dispatch import tx_lease_s


@pytest.mark.parametrize(
    ("lease_s", "ttft_s", "expected"),
    [
        (30.0, 0.0, 30.0),  # nothing predicted: the configured lease
        (30.0, 50.0, 130.0),  # a long prompt behind a queue: twice its TTFT on top
        (30.0, 1_000.0, 600.0),  # never past the agents' default max_lease_s
        (30.0, math.inf, 600.0),
        (30.0, -1.0, 30.0),
    ],
)
def test_the_lease_grows_with_the_predicted_ttft(
    lease_s: float, ttft_s: float, expected: float
) -> None:
    assert tx_lease_s(lease_s, ttft_s) == expected
