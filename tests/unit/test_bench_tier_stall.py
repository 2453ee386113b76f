"""bench.tier_stall measures what it says: a demoting eviction, inline vs on the I/O
thread, with every copy finished before it reports (tiny sizes, CPU)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from bench.tier_stall import BLOCK_BYTES, MIB, stall_once


def test_stall_once_demotes_every_block_and_reports_positive_times(tmp_path: Path) -> None:
    async def run() -> None:
        for tier in ("L2 host", "L3 disk"):
            for runner in ("inline", "thread"):
                result = await stall_once(tier, 2, runner, torch.device("cpu"), tmp_path)
                assert result.mib == 2 * BLOCK_BYTES // MIB
                assert 0 < result.allocate_ms <= result.drained_ms
                assert result.blocked_max_ms > 0

    asyncio.run(run())
    assert not list(tmp_path.glob("*.kvblock*"))  # cleared, every removal done
