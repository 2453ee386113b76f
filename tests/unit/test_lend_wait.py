"""What a node's lend waits for, as its agent reports it and a conductor reads it."""

from __future__ import annotations

import pytest

from conductor.dispatch import _lend_wait as conductor_lend_wait
from kvc.models import DEFAULT_MODEL_DIR
from kvc.tokenization import ChatTokenizer
from kvc.v1 import node_agent_pb2 as pb
from node_agent.engines.vllm.adapter import VllmEngineAdapter
from node_agent.engines.vllm.config import VllmConfig
from node_agent.server import _lend_wait as agent_lend_wait
from node_agent.settings import AgentSettings


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"pd_connector": "nixl", "vllm_prefix_pulls": True}, pb.LEND_WAIT_QUEUE),
        (
            {"pd_connector": "nixl", "vllm_prefix_pulls": True, "vllm_prefix_pull_priority": -1},
            pb.LEND_WAIT_RUNNING,
        ),
        ({"pd_connector": "nixl", "vllm_prefix_pulls": False}, pb.LEND_WAIT_NONE),
        ({"pd_connector": "none", "vllm_prefix_pulls": True}, pb.LEND_WAIT_NONE),
    ],
)
def test_a_vllm_agent_says_what_its_lend_waits_for(
    settings: dict[str, object], expected: int
) -> None:
    """A lend is a request to vLLM: behind its queue, or (legs with a priority below 0)
    behind the prefill running; a node that does not lend reports nothing to wait for."""
    base = {"port": 0, "engine": "vllm", "vllm_url": "http://vllm", "calibrate": False}
    agent = AgentSettings.model_validate({**base, **settings})
    engine = VllmEngineAdapter(
        VllmConfig.from_settings(agent), ChatTokenizer.from_dir(DEFAULT_MODEL_DIR)
    )
    assert agent_lend_wait(agent, engine) == expected


def test_a_conductor_reads_the_lend_wait_and_assumes_a_queue_for_unknown_values() -> None:
    read = {v: conductor_lend_wait(pb.NodeInfo(lend_wait=v)) for v in (0, 1, 2)}  # type: ignore[arg-type]
    assert read == {0: "none", 1: "queue", 2: "running"}
    assert conductor_lend_wait(pb.NodeInfo(lend_wait=7)) == "queue"  # type: ignore[arg-type]
