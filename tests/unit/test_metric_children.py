"""The conductor's per-request metrics remember their label children
(``conductor.metrics._RememberedChildren``): the same child for the same values, counted
as before, and forgotten with ``remove`` and ``clear``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from conductor.metrics import ConductorMetrics, _Counter, _Histogram


def test_children_are_remembered_and_count_as_before() -> None:
    registry = CollectorRegistry()
    counter = _Counter("kvc_test_total", "t", ["endpoint", "outcome"], registry=registry)
    child = counter.labels("chat", "success")
    assert counter.labels("chat", "success") is child
    assert counter.labels(endpoint="chat", outcome="success") is child  # prometheus' own
    child.inc()
    counter.labels("chat", "success").inc(2)
    sample = {"endpoint": "chat", "outcome": "success"}
    assert registry.get_sample_value("kvc_test_total", sample) == 3.0
    counter.remove("chat", "success")
    assert registry.get_sample_value("kvc_test_total", sample) is None
    fresh = counter.labels("chat", "success")
    assert fresh is not child
    counter.clear()
    assert counter.labels("chat", "success") is not fresh
    histogram = _Histogram("kvc_test_seconds", "t", ["endpoint"], registry=registry)
    histogram.labels("chat").observe(0.5)
    assert registry.get_sample_value("kvc_test_seconds_count", {"endpoint": "chat"}) == 1.0


def test_the_request_metrics_use_them() -> None:
    metrics = ConductorMetrics()
    for metric in (metrics.requests, metrics.ttft, metrics.tbt, metrics.agent_calls):
        assert isinstance(metric, _Counter | _Histogram)
