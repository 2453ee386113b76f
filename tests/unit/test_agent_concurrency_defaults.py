"""The agent's generation-slot default follows its engine, and a launched vLLM batches
exactly as many requests as the agent admits."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from node_agent.engines.vllm.config import VllmConfig
from node_agent.engines.vllm.process import VllmProcess
from node_agent.settings import AgentSettings


@pytest.mark.parametrize(
    ("given", "expected"),
    [({"engine": "embedded"}, 16), ({"engine": "vllm", "vllm_url": "http://127.0.0.1:1"}, 256)],
)
def test_max_running_defaults_to_the_engines_own(given: dict[str, str], expected: int) -> None:
    settings = AgentSettings.model_validate(given)
    assert settings.max_running == 0
    assert settings.resolved_max_running() == expected
    explicit = AgentSettings.model_validate({**given, "max_running": 7})
    assert explicit.resolved_max_running() == 7


def _command(tmp_path: Path, **overrides: object) -> list[str]:
    config = VllmConfig(
        model_dir=tmp_path, served_model_name="m", block_size=16, capacity_blocks=100,
        python="python", port=1234, **overrides,  # type: ignore[arg-type]
    )  # fmt: skip
    process = VllmProcess(config)
    try:
        return process.command()
    finally:
        asyncio.run(process.stop())  # never started: removes its temp dir


def test_a_launched_vllm_gets_the_agents_slots_as_max_num_seqs(tmp_path: Path) -> None:
    args = _command(tmp_path, max_running=48)
    assert args[args.index("--max-num-seqs") + 1] == "48"


@pytest.mark.parametrize("given", [("--max-num-seqs", "8"), ("--max-num-seqs=8",)])
def test_launch_args_that_set_max_num_seqs_win(tmp_path: Path, given: tuple[str, ...]) -> None:
    args = _command(tmp_path, max_running=48, launch_args=given)
    assert args.count("--max-num-seqs") + sum(a.startswith("--max-num-seqs=") for a in args) == 1
    assert "48" not in args
