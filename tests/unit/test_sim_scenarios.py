"""Scenario files and the replay runner (summary.json, CSVs, plots) on small workloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvc_sim.profile import SimConfigError
from kvc_sim.replay import ProgressLine, ReplayOptions, run_scenario
from kvc_sim.scenario import Scenario, bundled_scenarios, load_scenario
from kvc_sim.workload import SyntheticSpec, generate

PER_POLICY_KEYS = {
    "hit_ratio",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "tbt_p90_s",
    "rejected",
    "wasted_prefill_s",
    "prefill_gpu_s",
    "effective_capacity_ratio",
}


def test_the_four_issue_scenarios_are_bundled_and_valid() -> None:
    names = set(bundled_scenarios())
    assert {"cache-global-vs-local", "ttft-by-policy", "overload", "capacity"} <= names
    for name in names:
        scenario = load_scenario(name)
        assert scenario.name == name
        profile = scenario.load_profile()
        for run in scenario.runs:
            scenario.scheduler_for(run, profile)
            scenario.cluster_for(run)
    ttft = load_scenario("ttft-by-policy")
    assert {r.policy for r in ttft.runs} >= {
        "round_robin", "least_loaded", "local_prefix", "kv_centric"
    }  # fmt: skip
    overload = load_scenario("overload")
    assert (overload.cluster.prefill_instances, overload.cluster.decode_instances) == (8, 8)
    assert overload.speed == 2.0
    assert {r.admission for r in overload.runs} == {"prefill_only", "early", "predictive"}
    cache = load_scenario("cache-global-vs-local")
    assert cache.cluster.prefill_instances == 10
    assert cache.cluster.cache_tokens == 3_000_000
    assert cache.cluster.output_tokens == 1


def small(tmp_path: Path, **extra: object) -> Scenario:
    data: dict[str, object] = {
        "name": "tiny",
        "description": "two prefill, two decode",
        "paper": "-",
        "cluster": {"prefill_instances": 2, "decode_instances": 2, "cache_tokens": 400_000},
        "speed": 1.0,
        "baseline": "kv_centric",
        "runs": [
            {"name": "round_robin", "policy": "round_robin"},
            {"name": "kv_centric", "policy": "kv_centric"},
        ],
    }
    data.update(extra)
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(data))
    return load_scenario(str(path))


def test_replay_writes_summary_csv_and_plots(tmp_path: Path) -> None:
    scenario = small(tmp_path, speeds=[0.5, 2.0])
    reqs = generate(SyntheticSpec(requests=150, rate_per_s=1.0, seed=5))
    out = tmp_path / "out"
    summary = run_scenario(scenario, reqs, out, ReplayOptions(trace_name="synthetic"))
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == summary
    assert on_disk["scenario"] == "tiny"
    assert on_disk["trace"] == "synthetic"
    assert set(on_disk["policies"]) == {"round_robin", "kv_centric"}
    for block in on_disk["policies"].values():
        assert block.keys() >= PER_POLICY_KEYS
        assert [row["speed"] for row in block["sweep"]] == [0.5, 1.0, 2.0]
    assert on_disk["versus_baseline"]["kv_centric"]["prefill_gpu_change"] == 0.0
    kv, rr = on_disk["policies"]["kv_centric"], on_disk["policies"]["round_robin"]
    assert kv["hit_ratio"] > rr["hit_ratio"]
    for name in ("ttft_cdf.png", "hit_ratio.png", "load.png", "capacity.png"):
        assert (out / name).stat().st_size > 1000
    lines = (out / "requests_kv_centric.csv").read_text().splitlines()
    assert len(lines) == 151
    assert lines[0].startswith("request_id,arrival_s")


def test_one_policy_one_speed_and_progress(tmp_path: Path) -> None:
    scenario = small(tmp_path, speeds=[0.5, 2.0])
    reqs = generate(SyntheticSpec(requests=60, rate_per_s=1.0, seed=6))
    lines: list[str] = []

    class Sink:
        def write(self, text: str) -> int:
            lines.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    progress = ProgressLine(Sink(), every_s=0.0)  # type: ignore[arg-type]
    options = ReplayOptions(trace_name="t", policy="kv_centric", speed=3.0, plots=False)
    options = ReplayOptions(
        trace_name=options.trace_name, policy="kv_centric", speed=3.0, plots=False,
        progress=progress,
    )  # fmt: skip
    summary = run_scenario(scenario, reqs, tmp_path / "o", options)
    assert list(summary["policies"]) == ["kv_centric"]
    assert summary["speed"] == 3.0
    assert "sweep" not in summary["policies"]["kv_centric"]
    assert not (tmp_path / "o" / "ttft_cdf.png").exists()
    assert any("60/60 requests" in line for line in lines)


def test_scenario_errors(tmp_path: Path) -> None:
    with pytest.raises(SimConfigError, match="no scenario"):
        load_scenario("no-such-scenario")
    with pytest.raises(SimConfigError, match="baseline"):
        small(tmp_path, baseline="nope")
    with pytest.raises(SimConfigError, match=r"(?i)unexpected"):
        small(tmp_path, unknown_knob=1)
    with pytest.raises(SimConfigError):
        small(tmp_path, runs=[{"name": "x", "policy": "not_a_policy"}], baseline="x")
    with pytest.raises(SimConfigError, match="no run"):
        small(tmp_path).select("least_loaded")
