"""The staging area of prefilled KV: busy while full, a clear refusal for a prompt whose
KV could never fit, and a default sized from the model."""

from __future__ import annotations

import pytest

from node_agent.errors import EngineBusy, PromptRejected
from node_agent.settings import AgentSettings
from node_agent.transfer.staging import StagedKv, StagingArea

MIB = 1024 * 1024


def test_full_area_is_busy_and_frees_on_claim() -> None:
    area = StagingArea(100)
    handle = area.stage(StagedKv(kv=None, num_tokens=6, nbytes=60, expires_at=10.0, tenant="t"))
    area.check_room(40)  # fits beside it
    with pytest.raises(EngineBusy):
        area.check_room(41)
    assert area.claim(handle, "t") is not None
    area.check_room(100)  # the whole area again


def test_a_prompt_larger_than_the_whole_area_is_rejected_not_busy() -> None:
    area = StagingArea(100)
    with pytest.raises(PromptRejected, match="larger than this prefill node's staging area"):
        area.check_room(101)


def test_default_holds_the_longest_prompt_the_pool_takes_and_at_least_512_mib() -> None:
    settings = AgentSettings(capacity_blocks=1024, block_size=32)  # a 32k-token pool
    assert settings.max_staged_bytes == 0
    # Llama-3-8B's layout (128 KiB per token) with a 16k context: one prompt, 2 GiB.
    assert settings.resolved_max_staged_bytes(128 * 1024, 16384) == 2048 * MIB
    # A 128k context is bounded by the pool: 32k tokens, 4 GiB.
    assert settings.resolved_max_staged_bytes(128 * 1024, 131072) == 4096 * MIB
    # A tiny model (2 KiB per token, 4k context) keeps the 512 MiB floor.
    assert settings.resolved_max_staged_bytes(2048, 4096) == 512 * MIB
    explicit = AgentSettings(max_staged_bytes=MIB)
    assert explicit.resolved_max_staged_bytes(128 * 1024, 16384) == MIB
