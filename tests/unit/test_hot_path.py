"""bench.hot_path's pure parts: prompts, target names, the table and the ratios."""

from __future__ import annotations

import pytest

from bench.hot_path import (
    HEADERS,
    HotPathResult,
    parse_target_names,
    prompt,
    ratio_lines,
    table_rows,
)


def test_prompts_are_unique_per_request_and_sized() -> None:
    a, b = prompt(1, 200), prompt(2, 200)
    assert a != b
    assert a.split(":")[0] != b.split(":")[0]  # they differ from the first words on
    assert len(a.split()) == 202  # "request N:" + 200 words


def test_target_names() -> None:
    assert parse_target_names("direct, smg:cache_aware,conductor:kv_centric") == (
        "direct",
        "smg:cache_aware",
        "conductor:kv_centric",
    )
    with pytest.raises(ValueError, match="nginx"):
        parse_target_names("direct,nginx")
    with pytest.raises(ValueError, match="at least one"):
        parse_target_names(" , ")


def _results() -> list[HotPathResult]:
    direct = HotPathResult("direct", latency_p50_s=0.010, latency_p99_s=0.02, rps=500.0,
                           served=100, cpu_s={"engines": 1.0})  # fmt: skip
    peer = HotPathResult("smg:cache_aware", latency_p50_s=0.011, latency_p99_s=0.03,
                         rps=400.0, served=100, cpu_s={"router": 0.05, "engines": 1.0})  # fmt: skip
    ours = HotPathResult("conductor:kv_centric", latency_p50_s=0.030, latency_p99_s=0.05,
                         rps=100.0, served=100,
                         cpu_s={"conductor": 0.5, "agents": 0.5, "engines": 1.0})  # fmt: skip
    failed = HotPathResult("round_robin", status="skipped: no network")
    return [direct, peer, ours, failed]


def test_rows_measure_added_latency_from_direct_and_sum_the_conductors_path() -> None:
    rows = table_rows(_results())
    assert all(len(r) == len(HEADERS) for r in rows)
    direct, peer, ours, failed = rows
    assert direct[3] == "–"  # no added latency for the baseline itself
    assert peer[3] == "1.00"
    assert ours[3] == "20.00"
    assert peer[6] == "0.50"  # router 0.05 s / 100 requests
    assert ours[6] == "10.00"  # conductor + agents
    assert ours[7] == "5.00"
    assert failed[1].startswith("skipped")
    assert failed[5] == "–"


def test_ratios_are_conductor_over_each_peer() -> None:
    (line,) = ratio_lines(_results())
    assert line.startswith("- conductor:kv_centric / smg:cache_aware:")
    assert "CPU per request 20.0×" in line
    assert "added latency p50 20.0×" in line
    assert "req/s at concurrency 0.25×" in line
