"""System tier: bench.hot_path end to end on one simulated engine — the engine direct
and the conductor with its agent in front of it, real processes on loopback (the peers are
benchmark-only and not installed by the tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.system


def test_hot_path_measures_direct_and_the_conductor(tmp_path: Path) -> None:
    argv = [
        sys.executable, "-m", "bench.hot_path", "--targets", "direct,conductor:kv_centric",
        "--engines", "1", "--warmup", "2", "--requests", "10", "--throughput-requests", "40",
        "--concurrency", "4", "--prompt-words", "50", "--out", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    direct, ours = json.loads((tmp_path / "hot_path.json").read_text())["results"]
    assert (direct["status"], ours["status"]) == ("ok", "ok")
    for r in (direct, ours):
        assert r["served"] == 40, r["errors"]
        assert r["errors"] == {}
        assert 0 < r["latency_p50_s"] <= r["latency_p99_s"]
        assert r["rps"] > 0
        assert r["cpu_s"]["engines"] > 0
    assert ours["cpu_s"]["conductor"] > 0
    assert ours["cpu_s"]["agents"] > 0
    assert ours["peak_rss_kib"] > 10 * 1024
    assert ours["latency_p50_s"] > direct["latency_p50_s"]  # the conductor's path adds time
    text = (tmp_path / "hot_path.md").read_text()
    assert "| conductor:kv_centric | ok |" in text
    assert (tmp_path / "hot_path.png").is_file()
