"""``kvc bench live`` usage errors (exit 2, nothing sent) and ``kvc bench compare``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvc_cli.cli import main
from kvc_sim.live.compare import CompareError, load_rows, markdown_table
from kvc_sim.trace import write_trace
from kvc_sim.workload import SyntheticSpec, generate


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    write_trace(path, generate(SyntheticSpec(requests=3, system_prompt_tokens=512)))
    return path


def live(trace: Path, out: Path, *extra: str) -> int:
    return main(["bench", "live", "--trace", str(trace), "--out", str(out), "--quiet", *extra])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--url", "localhost:8000"], "not an http(s) URL"),
        (["--url", "ftp://h/v1"], "not an http(s) URL"),
        (["--url", "http://h", "--header", "X-Kvc-Slo-Ttft-Ms"], "NAME=VALUE"),
        (["--url", "http://h", "--time-scale", "0"], "must be > 0"),
        (["--url", "http://h", "--max-in-flight", "0"], "max_in_flight"),
        (["--url", "http://h", "--limit", "0"], "--limit"),
        (["--url", "http://h", "--scenario", "no-such-scenario"], "no-such-scenario"),
        (["--url", "http://h", "--name", "a/b"], "run_name"),
    ],
)
def test_usage_errors_exit_2_with_a_message(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert live(trace, tmp_path / "out", *args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_missing_or_malformed_trace_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert live(tmp_path / "none.jsonl", tmp_path / "out", "--url", "http://h") == 2
    assert "none.jsonl" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert live(bad, tmp_path / "out", "--url", "http://h") == 2
    assert "line 1" in capsys.readouterr().err


def test_a_trace_with_too_few_hash_ids_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    short = tmp_path / "short.jsonl"
    short.write_text(
        json.dumps({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]})
    )
    assert live(short, tmp_path / "out", "--url", "http://127.0.0.1:9") == 2
    assert "need 2 hash ids" in capsys.readouterr().err


def test_an_unreachable_server_exits_1(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert live(trace, tmp_path / "out", "--url", "http://127.0.0.1:9") == 1
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err


def summary(mode: str | None, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"scenario": "x", "policies": runs}
    if mode:
        out["mode"] = mode
    return out


def block(hit: float | None, p50: float, completed: int, rejected: int) -> dict[str, Any]:
    return {
        "requests": completed + rejected, "completed": completed, "rejected": rejected,
        "hit_ratio": hit, "ttft_p50_s": p50, "ttft_p90_s": 2 * p50, "ttft_p99_s": 3 * p50,
        "tbt_p90_s": 0.05, "effective_capacity_ratio": 0.75,
    }  # fmt: skip


def test_compare_prints_one_row_per_run_and_writes_the_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sim = tmp_path / "sim"
    sim.mkdir()
    runs = {"kv_centric": block(0.5, 1.0, 9, 1), "round_robin": block(0.25, 2.0, 8, 2)}
    (sim / "summary.json").write_text(json.dumps(summary(None, runs)))
    live_file = tmp_path / "live.json"
    live_file.write_text(json.dumps(summary("live", {"conductor": block(None, 0.5, 10, 0)})))
    png = tmp_path / "cmp" / "compare.png"
    assert main(["bench", "compare", str(sim), str(live_file), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(lines) == 4  # the header and three runs
    assert (
        f"| {sim}:kv_centric | simulated | 50.0% | 1.000 | 2.000 | 3.000 | 0.050 | 75.0% | 9 | 1 |"
        in lines
    )
    assert f"| {live_file}:conductor | live | - | 0.500 |" in lines[3]
    assert png.stat().st_size > 0

    rows = load_rows([sim / "summary.json"])
    assert [r.label for r in rows] == [f"{sim}:kv_centric", f"{sim}:round_robin"]
    assert markdown_table(rows).count("\n") == 4


def test_compare_refuses_what_is_not_a_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "compare", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err
    (tmp_path / "other.json").write_text('{"a": 1}')
    with pytest.raises(CompareError, match="not a kvc bench summary"):
        load_rows([tmp_path / "other.json"])
