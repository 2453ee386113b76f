"""System tier: KV tiers on a real agent process (embedded engine) behind a real conductor.

A prompt's blocks are pushed out of the engine's pool by other traffic into host memory
(L2) and served from there, then pushed further onto disk (L3) and served from there —
each time reported as cached tokens, with greedy output equal to the first, fully
computed answer; then its files are truncated on disk and the prompt is a miss, not a
crash. Sizes (block 16 tokens = 32 KiB of tiny-llama KV; pool 8 blocks, host 16, disk 64;
prompts of 6 blocks) are chosen so each step's placement is certain: the same schedule
replayed on the real ``BlockPool`` in ``tests/unit/test_kv_tiers.py``'s terms.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvc.block_keys import compute_block_keys
from kvc.processes import free_port
from tests.system.test_processes import spawn, stop, wait_ready

pytestmark = pytest.mark.system

MODEL = "tiny-llama"
BLOCK = 16
BLOCK_BYTES = BLOCK * 2048  # tiny-llama: 2 layers x 2 KV heads x 64 x float32 x (K, V)
PROMPT_TOKENS = 6 * BLOCK + 4  # six full blocks before the last token


class TieredSystem:
    def __init__(self, tmp: Path) -> None:
        self.disk = tmp / "l3"
        http_port, agent_port, metrics_port = free_port(), free_port(), free_port()
        self.base = f"http://127.0.0.1:{http_port}"
        self.metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        self.logs = [tmp / "agent.log", tmp / "conductor.log"]
        agent = [
            "agent", "--host", "127.0.0.1", "--port", str(agent_port), "--threads", "1",
            "--metrics-port", str(metrics_port), "--role", "both", "--no-calibrate",
            "--block-size", str(BLOCK), "--capacity-blocks", "8",
            "--host-tier-bytes", str(16 * BLOCK_BYTES),
            "--disk-tier-dir", str(self.disk), "--disk-tier-bytes", str(64 * BLOCK_BYTES),
        ]  # fmt: skip
        conductor = ["conductor", "--port", str(http_port), "--agents", f"127.0.0.1:{agent_port}"]
        self.procs = [spawn(agent, self.logs[0]), spawn(conductor, self.logs[1])]

    def complete(self, prompt: list[int]) -> tuple[str, int]:
        """Greedy completion of a token-id prompt: (its text, cached tokens)."""
        r = httpx.post(
            f"{self.base}/v1/completions",
            json={
                "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True,
            },
            timeout=60,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] == len(prompt)
        return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]

    def metric(self, name: str, medium: str) -> float:
        text = httpx.get(self.metrics, timeout=10).text
        found = re.search(rf'^{name}{{medium="{medium}"}} (\S+)$', text, re.MULTILINE)
        assert found is not None, name
        return float(found.group(1))

    def files_of(self, prompt: list[int]) -> list[bool]:
        keys = compute_block_keys(prompt[:-1], tenant="default", model=MODEL, block_size=BLOCK)
        return [(self.disk / f"{key:016x}.kvblock").exists() for key in keys]


@pytest.fixture(scope="module")
def tiered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TieredSystem]:
    sysm = TieredSystem(tmp_path_factory.mktemp("tiers"))
    try:
        wait_ready(sysm.base, sysm.procs, sysm.logs)
        yield sysm
    finally:
        codes = stop(sysm.procs)
        assert codes == [0, 0], [log.read_text()[-2000:] for log in sysm.logs]


def prompt_of(seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 500 + 10 for i in range(PROMPT_TOKENS)]


def test_blocks_are_served_from_host_then_disk_and_a_torn_file_is_a_miss(
    tiered: TieredSystem,
) -> None:
    prompt = prompt_of(1)
    fillers = iter(range(100, 200))
    first, cached = tiered.complete(prompt)
    assert cached == 0
    # Two other prompts push all six blocks out of the pool, into host memory.
    for _ in range(2):
        tiered.complete(prompt_of(next(fillers)))
    assert tiered.files_of(prompt) == [False] * 6
    assert tiered.metric("node_agent_tier_blocks", "host") >= 6
    again, cached = tiered.complete(prompt)
    assert (again, cached) == (first, 6 * BLOCK)
    assert tiered.metric("node_agent_tier_promoted_blocks_total", "host") == 6
    assert tiered.metric("node_agent_tier_promoted_blocks_total", "disk") == 0

    # Five more push them through host memory onto disk.
    for _ in range(5):
        tiered.complete(prompt_of(next(fillers)))
    assert tiered.files_of(prompt) == [True] * 6
    again, cached = tiered.complete(prompt)
    assert (again, cached) == (first, 6 * BLOCK)
    assert tiered.metric("node_agent_tier_promoted_blocks_total", "disk") == 6
    assert tiered.files_of(prompt) == [False] * 6  # promoted: a key lives in one place

    # Onto disk once more; then every file loses its tail, as after a crash mid-write.
    for _ in range(5):
        tiered.complete(prompt_of(next(fillers)))
    assert tiered.files_of(prompt) == [True] * 6
    for path in tiered.disk.glob("*.kvblock"):
        path.write_bytes(path.read_bytes()[:-100])
    again, cached = tiered.complete(prompt)
    assert (again, cached) == (first, 0)  # recomputed, same greedy answer
    assert tiered.metric("node_agent_tier_promoted_blocks_total", "disk") == 6
    text = httpx.get(tiered.metrics, timeout=10).text
    torn = re.search(r"^node_agent_tier_torn_files_total (\S+)$", text, re.MULTILINE)
    assert torn is not None
    assert float(torn.group(1)) >= 1
