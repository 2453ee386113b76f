"""``kvc bench replay`` end to end in a real process: trace file in, summary.json and plots out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvc_sim.trace import write_trace
from kvc_sim.workload import SyntheticSpec, generate

pytestmark = pytest.mark.system

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


def kvc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvc_cli", *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def test_bench_replay_runs_every_policy_of_a_scenario(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, generate(SyntheticSpec(requests=200, rate_per_s=2.0, seed=11)))
    scenario = tmp_path / "small.json"
    scenario.write_text(
        json.dumps(
            {
                "name": "small-overload",
                "description": "2 prefill + 2 decode at 3x with the three admission modes",
                "paper": "-",
                "cluster": {
                    "prefill_instances": 2,
                    "decode_instances": 2,
                    "cache_tokens": 500_000,
                    "decode_refuses": True,
                },
                "speed": 3.0,
                "slo": {"ttft_s": 10.0, "tbt_s": 0.05},
                "baseline": "none",
                "runs": [
                    {"name": "none", "policy": "kv_centric", "admission": "prefill_only"},
                    {"name": "early", "policy": "kv_centric", "admission": "early"},
                    {"name": "predictive", "policy": "kv_centric", "admission": "predictive"},
                ],
            }
        )
    )
    out = tmp_path / "out"
    done = kvc("bench", "replay", "--trace", str(trace), "--scenario", str(scenario),
               "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "200/200 requests" in done.stderr  # the progress bar
    summary = json.loads((out / "summary.json").read_text())
    assert summary["scenario"] == "small-overload"
    assert summary["trace"] == str(trace)
    assert set(summary["policies"]) == {"none", "early", "predictive"}
    for block in summary["policies"].values():
        assert block.keys() >= PER_POLICY_KEYS
        assert block["requests"] == 200
    for name in ("ttft_cdf.png", "hit_ratio.png", "load.png"):
        assert (out / name).stat().st_size > 1000

    one = kvc("bench", "replay", "--trace", str(trace), "--scenario", "ttft-by-policy",
              "--policy", "kv_centric", "--speed", "2", "--limit", "50", "--quiet",
              "--no-plots", "--out", str(tmp_path / "one"))  # fmt: skip
    assert one.returncode == 0, one.stderr
    summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert list(summary["policies"]) == ["kv_centric"]
    assert summary["speed"] == 2.0
    assert summary["policies"]["kv_centric"]["requests"] == 50


def test_bench_replay_reports_bad_input(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, generate(SyntheticSpec(requests=5)))
    bad = kvc("bench", "replay", "--trace", str(trace), "--scenario", "nope",
              "--out", str(tmp_path / "o"))  # fmt: skip
    assert bad.returncode == 2
    assert "no scenario" in bad.stderr
    bad = kvc("bench", "replay", "--trace", str(tmp_path / "missing.jsonl"),
              "--scenario", "capacity", "--out", str(tmp_path / "o"))  # fmt: skip
    assert bad.returncode == 2
