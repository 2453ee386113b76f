"""The vLLM adapter's load poll reads three samples out of a Prometheus exposition
(``sample_values``): it must agree with prometheus_client's full parser on any valid
exposition, label values with spaces, braces and escapes included."""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from node_agent.engines.vllm.http_parsing import metric_values, sample_values

WANTED = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")

label_text = st.text(
    alphabet=st.sampled_from('ab z{}"\\,=\n:_é0'), min_size=0, max_size=12
)  # fmt: skip
value = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@settings(max_examples=int(os.environ.get("KVC_METRIC_EXAMPLES", "80")), deadline=None)
@given(
    gauges=st.lists(st.tuples(label_text, value), max_size=4),
    near_miss=value,
    buckets=st.lists(value, max_size=5),
)
def test_it_agrees_with_the_full_parser(
    gauges: list[tuple[str, float]], near_miss: float, buckets: list[float]
) -> None:
    registry = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "r", ["model_name", "engine"], registry=registry)
    for i, (label, v) in enumerate(gauges):
        running.labels(label, str(i)).set(v)
    Gauge("vllm:kv_cache_usage_perc", "u", registry=registry).set(0.25)
    # Names that start like a wanted one, and a histogram's many lines, are skipped.
    Gauge("vllm:num_requests_running_max", "m", registry=registry).set(near_miss)
    Counter("vllm:num_requests_waiting_by_reason", "c", registry=registry).inc(3)
    hist = Histogram("vllm:e2e_request_latency_seconds", "h", ["model_name"], registry=registry)
    for v in buckets:
        hist.labels('a "quoted" {name}').observe(abs(v))
    text = generate_latest(registry).decode()
    full = metric_values(text)
    got = sample_values(text, WANTED)
    for name in WANTED:
        expected = [v for _, v in full.get(name, [])]
        assert sorted(got[name]) == sorted(expected), name
    assert got["vllm:num_requests_waiting"] == []


def test_values_and_timestamps_and_malformed_lines() -> None:
    text = (
        "# HELP vllm:num_requests_running r\n"
        '# TYPE vllm:num_requests_running gauge\n'
        'vllm:num_requests_running{a="x } y"} 4 1700000000000\n'
        "vllm:num_requests_running 2\n"
        "vllm:kv_cache_usage_perc NaN\n"
    )  # fmt: skip
    got = sample_values(text, WANTED)
    assert got["vllm:num_requests_running"] == [4.0, 2.0]
    assert math.isnan(got["vllm:kv_cache_usage_perc"][0])
    with pytest.raises(ValueError, match="without a value"):
        sample_values("vllm:num_requests_waiting{}\n", WANTED)
    with pytest.raises(ValueError, match="unterminated"):
        sample_values('vllm:num_requests_waiting{a="}\n', WANTED)
