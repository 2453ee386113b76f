"""bench.pd_path's pure parts: its flags, the SSE lines it counts as text, and the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.pd_path import (
    HEADERS,
    LengthResult,
    PathOptions,
    RunResult,
    _has_text,
    _ints,
    main,
    table_rows,
    write_report,
)


def test_lengths_and_block_sizes_parse_and_refuse_what_is_not_positive() -> None:
    assert _ints("4096, 16384", "--tokens") == (4096, 16384)
    for bad in ("", "0", "4k", "16,-1"):
        with pytest.raises(ValueError, match="--tokens"):
            _ints(bad, "--tokens")


def test_bad_flags_exit_before_any_process_starts(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--tokens", "0"], ["--repeats", "0"], ["--max-tokens", "1"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    assert "--max-tokens" in capsys.readouterr().err


def test_only_a_data_line_whose_choice_has_text_counts() -> None:
    chunk = {"choices": [{"index": 0, "text": " a", "finish_reason": None}]}
    assert _has_text("data: " + json.dumps(chunk))
    assert not _has_text("data: " + json.dumps({"choices": [{"index": 0, "text": ""}]}))
    assert not _has_text("data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 3}}))
    assert not _has_text("data: [DONE]")
    assert not _has_text(": keep-alive")


def test_the_report_gives_medians_their_difference_and_cpu(tmp_path: Path) -> None:
    ok = RunResult(16)
    cell = LengthResult(4096, [40.0, 44.0, 50.0], [30.0, 31.0, 90.0])
    cell.cpu_ms_per_request = {
        "conductor": 9.0, "agent prefill": 6.5, "agent decode": 5.0,
        "engine prefill": 4.0, "engine decode": 3.0,
    }  # fmt: skip
    ok.lengths.append(cell)
    failed = RunResult(512, status="failed: ports in use: [8400]")
    rows = table_rows([ok, failed])
    assert len(rows[0]) == len(HEADERS)
    assert rows[0] == ["16", "4,096", "44.0", "31.0", "13.0", "9.0 / 6.5 / 5.0", "4.0 / 3.0"]
    assert rows[1][2] == "failed: ports in use: [8400]"

    opts = PathOptions(
        tokens=(4096,), block_sizes=(16, 512), repeats=3, warmup=0, max_tokens=4, gap_s=0.0,
        idle_s=1.0, time_scale=1e-6, port=8400, base_port=21500, out=tmp_path,
        startup_timeout_s=10.0,
    )  # fmt: skip
    md = write_report(opts, [ok, failed], "python -m bench.pd_path")
    text = md.read_text()
    assert "| 16 | 4,096 | 44.0 | 31.0 | 13.0 |" in text
    assert json.loads((tmp_path / "pd_path.json").read_text())["results"][0]["block_size"] == 16
    assert (tmp_path / "pd_path.png").stat().st_size > 1000
