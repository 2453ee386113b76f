"""Which agents a conductor schedules onto: its model, and its block-key layout."""

from __future__ import annotations

import pytest

from conductor.adapters.agents import incompatibility
from kvc.block_keys import KEY_LAYOUT
from kvc.v1 import node_agent_pb2 as pb


def test_an_agent_of_this_model_and_layout_is_compatible() -> None:
    assert incompatibility(pb.NodeInfo(model="m", block_key_layout=KEY_LAYOUT), "m") == ""


def test_another_model_is_not() -> None:
    why = incompatibility(pb.NodeInfo(model="other", block_key_layout=KEY_LAYOUT), "m")
    assert "serves model 'other'" in why


@pytest.mark.parametrize(
    ("layout", "upgrade"),
    [
        (0, "upgrade the agent"),  # an agent from before the field keys in layout 1
        (1, "upgrade the agent"),
        (KEY_LAYOUT + 1, "upgrade the conductor"),
    ],
)
def test_another_block_key_layout_is_not(layout: int, upgrade: str) -> None:
    why = incompatibility(pb.NodeInfo(model="m", block_key_layout=layout), "m")
    assert f"layout {layout or 1}" in why
    assert upgrade in why
