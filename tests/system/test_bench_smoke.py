"""The benchmarks still run end to end (tiny sizes; their figures are not asserted)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import block_table
from kvc.models import DEFAULT_MODEL_DIR

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


def test_scheduler_decision_bench_writes_table_json_and_plot(tmp_path: Path) -> None:
    from bench import scheduler_decision

    code = scheduler_decision.main(
        ["--out", str(tmp_path), "--repeats", "5", "--keys-per-node", "100",
         "--prompts", "1024", "8192", "--fleets", "8", "64"]
    )  # fmt: skip
    assert code == 0
    data = json.loads((tmp_path / "scheduler_decision.json").read_text())
    assert {(r["prompt_tokens"], r["nodes"]) for r in data["rows"]} == {
        (1024, 8), (1024, 64), (8192, 8), (8192, 64)
    }  # fmt: skip
    assert all(r["p99_ms"] > 0 for r in data["rows"])
    assert all(0 < r["placement_p50_ms"] <= r["p99_ms"] for r in data["rows"])
    assert all(0 < r["keys_p50_ms"] <= r["p99_ms"] for r in data["rows"])
    assert all(0 < r["match_p50_ms"] <= r["p99_ms"] for r in data["rows"])
    assert "Block keys and prefix lookups: " in (tmp_path / "scheduler_decision.md").read_text()
    # More nodes, more work per placement (the prefill nodes' bounds, the decode forecasts).
    calls = {(r["prompt_tokens"], r["nodes"]): r["placement_calls"] for r in data["rows"]}
    assert 0 < calls[(1024, 8)] < calls[(1024, 64)]
    assert (tmp_path / "scheduler_decision.png").stat().st_size > 1000


def test_scheduler_decision_bench_decides_beside_decodes_in_flight(tmp_path: Path) -> None:
    """A row per in-flight count; 40 per decode node runs the column forecasts."""
    from bench import scheduler_decision

    code = scheduler_decision.main(
        ["--out", str(tmp_path), "--repeats", "5", "--keys-per-node", "100",
         "--prompts", "8192", "--fleets", "8", "--decodes-in-flight", "0", "40"]
    )  # fmt: skip
    assert code == 0
    rows = json.loads((tmp_path / "scheduler_decision.json").read_text())["rows"]
    assert sorted(r["decodes_in_flight"] for r in rows) == [0, 40]
    assert all(r["placed_share"] == 1.0 for r in rows)
    assert all(r["p99_ms"] > 0 for r in rows)


def test_fleet_view_bench_writes_table_json_and_plot(tmp_path: Path) -> None:
    from bench import fleet_view

    code = fleet_view.main(["--out", str(tmp_path), "--repeats", "20", "--fleets", "2", "16"])
    assert code == 0
    data = json.loads((tmp_path / "fleet_view.json").read_text())
    assert [r["nodes"] for r in data["rows"]] == [2, 16]
    assert all(r["steady"]["p50_ms"] > 0 and r["all_reported"]["p50_ms"] > 0 for r in data["rows"])
    assert "| agents |" in (tmp_path / "fleet_view.md").read_text()
    assert (tmp_path / "fleet_view.png").stat().st_size > 1000


def test_stream_cost_bench_writes_table_json_and_plot(tmp_path: Path) -> None:
    from bench import stream_cost

    code = stream_cost.main(["--out", str(tmp_path), "--messages", "200", "--calls", "50"])
    assert code == 0
    data = json.loads((tmp_path / "stream_cost.json").read_text())
    assert set(data["results"]) == {"grpc.aio", "framed"}
    assert all(r["stream_us"] > 0 and r["request_us"] > 0 for r in data["results"].values())
    assert "| transport |" in (tmp_path / "stream_cost.md").read_text()
    assert (tmp_path / "stream_cost.png").stat().st_size > 1000


def test_chat_tokenize_bench_writes_table_json_and_plot(tmp_path: Path) -> None:
    from bench import chat_tokenize

    code = chat_tokenize.main(
        ["--out", str(tmp_path), "--turns", "1", "4", "--words", "20", "--repeats", "2"]
    )
    assert code == 0
    data = json.loads((tmp_path / "chat_tokenize.json").read_text())
    assert [r["turns"] for r in data["rows"]] == [1, 4]
    assert data["rows"][1]["prompt_tokens"] > data["rows"][0]["prompt_tokens"]
    assert all(r["whole_p50_ms"] > 0 and r["pieces_p50_ms"] > 0 for r in data["rows"])
    assert (tmp_path / "chat_tokenize.png").stat().st_size > 1000
    with pytest.raises(SystemExit):
        chat_tokenize.main(["--out", str(tmp_path), "--turns", "0"])


def test_kv_transfer_bench_writes_table_json_and_plot(tmp_path: Path) -> None:
    from bench import kv_transfer

    code = kv_transfer.main(
        ["--out", str(tmp_path), "--repeats", "2", "--transfer-tokens", "64",
         "--ttft-tokens", "200"]
    )  # fmt: skip
    assert code == 0
    data = json.loads((tmp_path / "kv_transfer.json").read_text())
    assert data["transfers"][0]["bytes"] == 64 * 2048  # 2 blocks of 32 tokens, 2 KiB/token
    assert data["transfers"][0]["gbps_median"] > 0
    assert data["raw_tcp_gbps"] > 0
    assert data["ttft"]["warm"]["p50_ms"] > 0
    assert (tmp_path / "kv_transfer.png").stat().st_size > 1000


def test_vllm_client_bench_sees_every_request_served_or_refused_before_prefill(
    tmp_path: Path,
) -> None:
    from bench import vllm_client

    vllm_python = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
    if not vllm_python.exists():
        pytest.fail(f"{vllm_python} missing: `make test` builds it (make vllm-env)")
    code = vllm_client.main(
        ["--out", str(tmp_path), "--runs", "2", "--num-prompts", "6", "--input-len", "200",
         "--output-len", "8", "--vllm-python", str(vllm_python)]
    )  # fmt: skip
    assert code == 0
    rows = json.loads((tmp_path / "vllm_client.json").read_text())["rows"]
    assert [r["step"] for r in rows] == ["run 1", "run 2", "'Hi', max_tokens 8"]
    for r in rows[:2]:
        assert r["client_completed"] + r["client_failed"] == 6
        assert r["served"] + r["refused"] == 6
        assert r["prefills"] == r["served"]  # a refusal never follows a prefill
        assert r["tx_abort"] == 0
    assert rows[2]["served"] == 1
    assert (tmp_path / "vllm_client.png").stat().st_size > 1000


def test_soak_bench_accounts_for_every_request(tmp_path: Path) -> None:
    from bench import soak

    code = soak.main(["--out", str(tmp_path), "--duration-s", "15", "--sample-s", "3",
                      "--concurrency", "4"])  # fmt: skip
    data = json.loads((tmp_path / "soak.json").read_text())
    assert code == 0, (tmp_path / "soak.md").read_text()
    assert data["status"] == "ok"
    assert data["sent"] > 20
    assert set(data["rss_mib"]) == {"prefill", "decode", "conductor"}
    assert (tmp_path / "soak.png").stat().st_size > 1000


def test_pd_ttft_bench_moves_each_prompt_once_and_decodes_the_same(tmp_path: Path) -> None:
    from bench import pd_ttft

    argv = ["--out", str(tmp_path), "--tokens", "64", "--repeats", "1", "--max-tokens", "3"]
    assert pd_ttft.main(argv) == 0
    data = json.loads((tmp_path / "pd_ttft-tiny-llama-cpu.json").read_text())
    by_mode = {s["mode"]: s for s in data["samples"]}
    assert list(by_mode) == ["aggregated", "P/D streamed", "P/D shared memory"]
    # The bench raises unless each P/D request had exactly one handoff, through shared
    # memory in that deployment only.
    assert by_mode["aggregated"]["handoff_bytes"] == 0
    for mode in ("P/D streamed", "P/D shared memory"):
        # The KV of prompt[:-1] moves (the decode agent runs the last token as its first
        # step); tiny-llama holds 2 KiB of KV per token.
        assert by_mode[mode]["handoff_bytes"] == 63 * 2048
        assert by_mode[mode]["handoff_ms"] > 0
    table = (tmp_path / "pd_ttft-tiny-llama-cpu.md").read_text()
    assert "| 64 | 0.125 | P/D streamed |" in table
    assert table.count("| 1/1 |") == 2  # both P/D outputs equal the aggregated one
    assert (tmp_path / "pd_ttft-tiny-llama-cpu.png").stat().st_size > 0


def test_decode_determinism_is_exact_on_cpu(tmp_path: Path) -> None:
    """On the CPU in float32 every path of the check decodes the reference's tokens."""
    from bench import decode_determinism

    argv = ["--out", str(tmp_path), "--tokens", "64", "--steps", "4"]
    assert decode_determinism.main(argv) == 0
    data = json.loads((tmp_path / "decode_determinism-tiny-llama-cpu.json").read_text())
    [result] = data["results"]
    assert result["prefill_bit_equal"]
    assert result["handoff_bit_equal"]
    assert result["weights_equal_across_processes"]
    assert result["first_logits_max_diff"] == 0.0
    steps = (result["rerun_same_kv"], result["from_recomputed_kv"], result["after_handoff"])
    assert steps == (4, 4, 4)
    assert result["other_process"] == 4


def test_tier_ttft_bench_serves_each_step_from_its_tier(tmp_path: Path) -> None:
    from bench import tier_ttft

    # A model folder of another name: the conductor must be pointed at it as the agent is.
    model = tmp_path / "tiny-copy"
    shutil.copytree(DEFAULT_MODEL_DIR, model)
    argv = ["--out", str(tmp_path), "--model", str(model), "--tokens", "64", "--repeats", "1"]
    assert tier_ttft.main(argv) == 0
    data = json.loads((tmp_path / "tier_ttft-tiny-copy-cpu.json").read_text())
    [result] = data["results"]
    # The bench raises unless each step was served as named; here the record says so too.
    steps = {s["step"]: s for s in result["samples"]}
    assert list(steps) == ["cold", "L1", "L2", "L3"]
    assert steps["cold"]["cached_tokens"] == 0
    assert (steps["L2"]["promoted_host"], steps["L3"]["promoted_disk"]) == (2, 2)
    assert all(s["ttft_ms"] > 0 and s["same_as_cold"] for s in result["samples"])  # float32
    assert (tmp_path / "tier_ttft-tiny-copy-cpu.png").stat().st_size > 0


def test_pd_path_bench_measures_both_paths_on_a_live_fleet(tmp_path: Path) -> None:
    from bench import pd_path
    from kvc.processes import free_port, free_ports

    code = pd_path.main(
        ["--out", str(tmp_path), "--tokens", "1024", "--block-sizes", "512", "--repeats", "2",
         "--warmup", "1", "--idle-s", "0.5", "--gap-s", "0", "--port", str(free_port()),
         "--base-port", str(free_ports(8, consecutive=True)[0])]
    )  # fmt: skip
    assert code == 0
    (run,) = json.loads((tmp_path / "pd_path.json").read_text())["results"]
    (cell,) = run["lengths"]
    assert len(cell["conductor_ttft_ms"]) == len(cell["engines_ttft_ms"]) == 2
    assert all(ms > 0 for ms in cell["conductor_ttft_ms"] + cell["engines_ttft_ms"])
    assert set(cell["cpu_ms_per_request"]) == {
        "conductor", "agent prefill", "agent decode", "engine prefill", "engine decode"
    }  # fmt: skip
    assert (tmp_path / "pd_path.png").stat().st_size > 1000
