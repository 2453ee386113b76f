"""bench.kv_tiers on the tiny model, CPU, one short prompt: the measurement runs through
the real LowerTiers, every number is positive, every tier gives back the original KV,
and the report files are written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import kv_tiers
from kvc.models import DEFAULT_MODEL_DIR
from node_agent.engines.embedded.kv_tensors import KvCache
from node_agent.engines.embedded.model import EmbeddedModel


@pytest.fixture(scope="module")
def model() -> EmbeddedModel:
    return EmbeddedModel.load(DEFAULT_MODEL_DIR, device="cpu")


def test_measures_every_tier_against_recompute(model: EmbeddedModel, tmp_path: Path) -> None:
    [result] = kv_tiers.measure(model, [64], repeats=1, disk_dir=tmp_path)

    assert result.tokens == 64
    assert result.blocks == 64 // kv_tiers.BLOCK_TOKENS
    assert result.kv_bytes == 64 * model.layout.bytes_per_token
    timings = [
        result.recompute,
        result.l2_put,
        result.l2_load,
        result.l2_prefetch,
        result.l3_put,
        result.l3_load_cached,
    ]
    if result.l3_load_cold is not None:
        timings.append(result.l3_load_cold)
    for timing in timings:
        assert len(timing.samples_ms) == 1
        assert timing.median_ms > 0
        assert timing.ms_per_mib > 0
        assert timing.gb_per_s > 0
    assert result.link is None  # the link's ceiling is a CUDA figure
    if result.cold_resident_fraction is not None:
        assert 0.0 <= result.cold_resident_fraction <= 1.0
    assert list(tmp_path.iterdir()) == []  # the L3 files are cleaned up


def test_verify_fails_loudly_on_a_changed_block() -> None:
    base = torch.arange(2 * 4 * 8, dtype=torch.float32).reshape(1, 2, 4, 8)
    original = KvCache([(base, base + 1)])
    changed = base.clone()
    changed[0, 1, 2, 3] += 1
    device = torch.device("cpu")

    kv_tiers.verify("same", [KvCache([(base.clone(), base + 1)])], [original], device)
    with pytest.raises(RuntimeError, match="layer 0 differs"):
        kv_tiers.verify("changed", [KvCache([(changed, base + 1)])], [original], device)
    with pytest.raises(RuntimeError, match="not loaded"):
        kv_tiers.verify("missing", [None], [original], device)


def test_cli_writes_table_json_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--device", "cpu", "--tokens", "32,64", "--repeats", "1"]
    argv += ["--out", str(out), "--disk-dir", str(tmp_path / "disk")]
    assert kv_tiers.main(argv) == 0

    name = "kv_tiers-tiny-llama-cpu"
    table = (out / f"{name}.md").read_text()
    assert "Command: `python -m bench.kv_tiers --device cpu" in table
    assert "L3 disk load, cold" in table
    data = json.loads((out / f"{name}.json").read_text())
    assert [r["tokens"] for r in data["results"]] == [32, 64]
    assert (out / f"{name}.png").stat().st_size > 0
    assert list((tmp_path / "disk").iterdir()) == []
