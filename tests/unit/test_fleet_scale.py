"""bench.fleet_scale's arithmetic: fleet shapes, histogram deltas and quantiles from two
scrapes of a real prometheus_client registry, /proc memory, and the report rows."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from bench.fleet_scale import (
    HEADERS,
    ScaleOptions,
    ShapeResult,
    histogram_delta,
    histogram_quantile,
    parse_shapes,
    proc_memory_kib,
    requests_answered,
    table_rows,
    write_report,
)

BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5)


def test_shapes_parse_and_refuse_what_is_not_prefill_plus_decode() -> None:
    assert parse_shapes("8+8, 32+32") == [(8, 8), (32, 32)]
    for bad in ("32", "0+4", "4+", "a+b", "4+4,"):
        with pytest.raises(ValueError, match="--shapes"):
            parse_shapes(bad)


def _scrape(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def test_delta_counts_only_what_was_observed_between_the_scrapes() -> None:
    registry = CollectorRegistry()
    lag = Histogram("lag_seconds", "lag", ("node",), buckets=BUCKETS, registry=registry)
    for _ in range(50):  # before the replay: must not count
        lag.labels("a").observe(3.0)
    before = _scrape(registry)
    for i in range(100):  # two label sets, summed
        lag.labels("a" if i % 2 else "b").observe(0.002 if i < 98 else 0.3)
    after = _scrape(registry)
    cumulative = histogram_delta(before, after, "lag_seconds")
    assert dict(cumulative)[0.001] == 0
    assert dict(cumulative)[0.005] == 98
    assert dict(cumulative)[0.5] == 100
    assert cumulative[-1] == (math.inf, 100.0)
    # 98 of 100 in (0.001, 0.005]: the median interpolates inside it; p99 lands in (0.1, 0.5]
    assert histogram_quantile(0.5, cumulative) == pytest.approx(0.001 + 0.004 * 50 / 98)
    assert histogram_quantile(0.99, cumulative) == pytest.approx(0.1 + 0.4 * 0.5)


def test_quantile_edges() -> None:
    assert histogram_quantile(0.99, []) is None
    assert histogram_quantile(0.99, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    # everything above the last finite bound: that bound, as Prometheus answers
    assert histogram_quantile(0.99, [(0.1, 0.0), (5.0, 0.0), (float("inf"), 4.0)]) == 5.0


def testrequests_answered_sum_every_label_set() -> None:
    registry = CollectorRegistry()
    requests = Counter("conductor_requests", "r", ("endpoint", "outcome"), registry=registry)
    requests.labels("completions", "ok").inc(3)
    before = _scrape(registry)
    requests.labels("completions", "ok").inc(5)
    requests.labels("chat", "rejected").inc(2)
    assert requests_answered(before, _scrape(registry)) == 7


def test_memory_of_this_process_and_of_one_that_is_gone() -> None:
    mine = proc_memory_kib(os.getpid())  # the benchmarks read /proc: Linux only, as CI
    assert mine["VmRSS"] > 1024  # a Python with pytest loaded is over 1 MiB
    assert mine["VmHWM"] >= mine["VmRSS"]
    assert proc_memory_kib(2**22 + 12345) == {}


def test_report_has_a_row_per_shape_and_says_what_failed(tmp_path: Path) -> None:
    ok = ShapeResult(8, 8, startup_s=20.0, replay_wall_s=100.0, requests_answered=500,
                     completed=490, rejected=10, answered_per_s=5.0,
                     conductor_cpu_ms_per_request=12.5,
                     cpu_s={"conductor": 6.25, "agents": 30.0, "engines": 40.0},
                     event_lag_s={"p50": 0.002, "p99": 0.04},
                     conductor_memory_kib={"VmRSS": 200 * 1024, "VmHWM": 250 * 1024},
                     fleet_pss_kib=3 * 1024 * 1024, hit_ratio=0.12,
                     ttft_s={"p50": 0.25, "p90": 4.5})  # fmt: skip
    failed = ShapeResult(32, 32, status="failed: conductor exited (code 1)")
    rows = table_rows([ok, failed])
    assert all(len(row) == len(HEADERS) for row in rows)
    assert rows[0][0] == "8+8 (16)"
    assert rows[0][7] == "12.5"
    assert rows[0][12] == "0.040"
    assert rows[0][14] == "200"
    assert rows[0][16] == "3.00"
    assert rows[0][6] == "490 / 10"
    assert rows[0][-3:] == ["12.0", "0.25", "4.50"]
    assert rows[1][1].startswith("failed")
    assert rows[1][7] == "–"
    opts = ScaleOptions(
        shapes=((8, 8), (32, 32)), trace=tmp_path / "t.jsonl", limit=10, speed=1.0,
        max_tokens=8, time_scale=1.0, policy="kv_centric", profile="llama3-70b-8xa800",
        num_gpu_blocks=64, max_running=8, idle_s=1.0, port=1, base_port=2,
        conductor_args=(), out=tmp_path, startup_timeout_s=1.0, replay_timeout_s=1.0,
    )  # fmt: skip
    md = write_report(opts, [ok, failed], "python -m bench.fleet_scale")
    text = md.read_text()
    assert "| 8+8 (16) | ok |" in text
    assert "failed: conductor exited" in text
    assert (tmp_path / "fleet_scale.json").is_file()
    assert (tmp_path / "fleet_scale.png").is_file()
