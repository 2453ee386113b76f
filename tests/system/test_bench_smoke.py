"""The benchmarks still run end to end (tiny sizes; their figures are not asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import block_table

pytestmark = pytest.mark.system


def test_block_table_bench_writes_table_json_and_plot(tmp_path: Path) -> None:
    code = block_table.main(["--out", str(tmp_path), "--seconds", "0.2", "--prompt-tokens", "512"])
    assert code == 0
    data = json.loads((tmp_path / "block_table.json").read_text())
    assert [row["concurrency"] for row in data["grpc"]] == [1, 8]
    assert all(row["ops"] > 0 for row in data["grpc"])
    assert all(row["ops"] > 0 for row in data["pool"])
    assert "| concurrency |" in (tmp_path / "block_table.md").read_text()
    assert (tmp_path / "block_table.png").stat().st_size > 1000
