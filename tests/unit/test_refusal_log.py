"""The conductor's refusal log: every reason logged with its figures, rate limited."""

from __future__ import annotations

import logging

import pytest

from conductor.core.placement import Refusal
from conductor.core.scheduler import Slo
from conductor.refusals import RefusalLog


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "conductor.dispatch"]


def test_a_schedule_refusal_names_its_estimates_and_the_slo_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="conductor.dispatch")
    refusals = RefusalLog()
    refusal = Refusal("ttft_slo", retry_after_s=3.0, ttft_s=11.625, tbt_s=0.0916)
    refusals.log_schedule("req-1", refusal, Slo(30.0, 0.2), waited_s=19.0)
    (msg,) = _messages(caplog)
    assert "req-1: ttft_slo" in msg
    assert "predicted TTFT 11.625 s vs SLO 30.000 s less 19.000 s waited" in msg
    assert "TBT 0.0916 s vs SLO 0.2000 s" in msg
    assert "Retry-After 3.0 s" in msg
    assert "queue is full" not in msg


def test_a_refusal_for_a_full_waiting_queue_says_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="conductor.dispatch")
    refusal = Refusal("tbt_slo", retry_after_s=2.0, ttft_s=1.0, tbt_s=0.3, queue_full=True)
    RefusalLog().log_schedule("req-2", refusal, Slo(30.0, 0.2), waited_s=0.0)
    (msg,) = _messages(caplog)
    assert "the waiting queue is full" in msg
    assert "waited" not in msg


def test_refusals_of_one_reason_are_rate_limited_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="conductor.dispatch")
    refusals = RefusalLog(interval_s=0.0)
    refusals.log("tbt_slo", "a", "x")
    refusals.log("tbt_slo", "b", "y")
    assert len(_messages(caplog)) == 2  # no interval: every refusal is logged

    caplog.clear()
    now = [0.0]
    slow = RefusalLog(interval_s=1.0, clock=lambda: now[0])
    slow.log("tbt_slo", "a", "x")
    slow.log("tbt_slo", "b", "y")
    slow.log("tbt_slo", "c", "z")
    slow.log("ttft_slo", "d", "w")  # another reason has its own budget
    msgs = _messages(caplog)
    assert len(msgs) == 2
    assert msgs[0].startswith("refused a: tbt_slo")
    assert msgs[1].startswith("refused d: ttft_slo")
    now[0] = 1.5  # the interval has passed: the next line says what it hid
    slow.log("tbt_slo", "e", "v")
    assert "(+2 more for this reason since its last line)" in _messages(caplog)[-1]
