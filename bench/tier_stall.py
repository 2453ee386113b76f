"""How long an eviction that demotes many blocks blocks the agent's event loop: the tier
copies and writes done inline (on the loop) vs on the agent's I/O thread.

  python -m bench.tier_stall [--device cpu|cuda] [--mib 256,1024] [--repeats 3]
      [--out bench/results] [--disk-dir DIR]

A ``BlockPool`` of N blocks (Llama-3-8B's KV layout: 32 layers, 8 KV heads x 128, bf16,
32-token blocks of 4 MiB) is filled with N blocks of random KV on the device; then one
transaction allocates N new blocks, which evicts all N into the lower tier under test
(L2 host memory, or L3 disk with L2 off) through the agent's real ``LowerTiers``.
Meanwhile a ticker task on the same event loop wakes every millisecond; its largest gap
is how long the loop — every other request's token stream on that agent — was blocked.
``inline``: ``InlineRunner`` (copies and writes inside the allocation, as first built);
``thread``: the agent's ``ThreadRunner`` (one I/O thread, completions on the loop).
``drained`` is when the last copy or write finished (throughput is unchanged or better).

Writes ``tier_stall-<device>.md`` / ``.json`` / ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.report import markdown_table, write_results
from kvc.block_keys import BlockKey
from node_agent.blocks.pool import BlockPool
from node_agent.blocks.tiers import InlineRunner, LowerTiers, Runner
from node_agent.blocks.types import AllocateParams
from node_agent.engines.embedded.kv_tensors import KvCache, TensorKvCodec
from node_agent.tier_runner import ThreadRunner

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 32, 8, 128, 32
BLOCK_BYTES = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2 * BLOCK_TOKENS  # bf16: 4 MiB
MIB = 1 << 20


@dataclass(frozen=True)
class StallResult:
    tier: str
    mib: int
    runner: str
    blocked_max_ms: float  # largest ticker gap: the loop could not run anything else
    allocate_ms: float  # the eviction call itself
    drained_ms: float  # until the last copy/write finished


def _block(device: torch.device, seed: int) -> KvCache:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape = (1, KV_HEADS, BLOCK_TOKENS, HEAD_DIM)
    layers = []
    for _ in range(LAYERS):
        key = torch.randn(shape, generator=gen, dtype=torch.float32).to(device, torch.bfloat16)
        value = torch.randn(shape, generator=gen, dtype=torch.float32).to(device, torch.bfloat16)
        layers.append((key, value))
    return KvCache(layers)


async def _drain(runner: Runner) -> None:
    """Wait until everything submitted before now has finished (FIFO runners)."""
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    runner.submit(lambda: None, lambda _r, _e: done.set_result(None))
    await done


async def stall_once(
    tier: str, blocks: int, runner_name: str, device: torch.device, disk_dir: Path
) -> StallResult:
    codec = TensorKvCodec(device)
    loop = asyncio.get_running_loop()
    thread_runner = ThreadRunner(loop) if runner_name == "thread" else None
    runner: Runner = thread_runner if thread_runner is not None else InlineRunner()
    size = blocks * BLOCK_BYTES
    lower = LowerTiers(
        codec,
        host_bytes=size if tier == "L2 host" else 0,
        disk_dir=disk_dir if tier == "L3 disk" else None,
        disk_bytes=size if tier == "L3 disk" else 0,
        runner=runner,
    )
    pool = BlockPool(blocks, time.monotonic, lower=lower)
    template = _block(device, 0)
    old = [BlockKey(i + 1) for i in range(blocks)]
    pool.tx_allocate(AllocateParams("fill", "t", old, 600.0))
    for h in pool.get_tx("fill").handles:
        # A compact copy per block, as the pool holds them (slices of one prefill).
        pool.set_payload(h, template.slice(0, BLOCK_TOKENS))
    pool.tx_commit("fill")
    if device.type == "cuda":
        torch.cuda.synchronize()

    gaps: list[float] = []
    stop = asyncio.Event()
    ticking = asyncio.Event()

    async def ticker() -> None:
        """Wakes every millisecond (the instrument): its gaps are the loop's stalls."""
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            ticking.set()

    tick = asyncio.create_task(ticker())
    await ticking.wait()
    started = time.perf_counter()
    new = [BlockKey(blocks + i + 1) for i in range(blocks)]
    pool.tx_allocate(AllocateParams("evict", "t", new, 600.0))  # demotes every old block
    allocate_s = time.perf_counter() - started
    ticking.clear()
    await ticking.wait()  # the ticker woke after the eviction: its gap spans it
    await _drain(runner)
    if device.type == "cuda":
        torch.cuda.synchronize()
    drained_s = time.perf_counter() - started
    stop.set()
    await tick
    pool.tx_abort("evict")
    lower.clear()
    await _drain(runner)
    if thread_runner is not None:
        thread_runner.close()
    return StallResult(
        tier=tier,
        mib=blocks * BLOCK_BYTES // MIB,
        runner=runner_name,
        blocked_max_ms=max(gaps) * 1000,
        allocate_ms=allocate_s * 1000,
        drained_ms=drained_s * 1000,
    )


def median_result(samples: list[StallResult]) -> StallResult:
    first = samples[0]
    return StallResult(
        tier=first.tier,
        mib=first.mib,
        runner=first.runner,
        blocked_max_ms=statistics.median(s.blocked_max_ms for s in samples),
        allocate_ms=statistics.median(s.allocate_ms for s in samples),
        drained_ms=statistics.median(s.drained_ms for s in samples),
    )


async def measure(
    device: torch.device, mibs: list[int], repeats: int, disk_dir: Path
) -> list[StallResult]:
    out = []
    for tier in ("L2 host", "L3 disk"):
        for mib in mibs:
            blocks = max(1, mib * MIB // BLOCK_BYTES)
            for runner in ("inline", "thread"):
                samples = [
                    await stall_once(tier, blocks, runner, device, disk_dir) for _ in range(repeats)
                ]
                out.append(median_result(samples))
    return out


def plot(path: Path, title: str, results: list[StallResult]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({(r.tier, r.mib) for r in results})
    x = range(len(labels))
    fig, ax = plt.subplots(figsize=(9, 4))
    for offset, runner in ((-0.2, "inline"), (0.2, "thread")):
        values = [
            next(r.blocked_max_ms for r in results if (r.tier, r.mib, r.runner) == (*lab, runner))
            for lab in labels
        ]
        ax.bar([i + offset for i in x], values, width=0.4, label=f"{runner}")
    ax.set_xticks(list(x), [f"{tier}\n{mib} MiB" for tier, mib in labels])
    ax.set_yscale("log")
    ax.set_ylabel("event loop blocked, max gap (ms)")
    ax.set_title(title)
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--mib", type=lambda t: [int(v) for v in t.split(",")], default=[256, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--disk-dir", type=Path, default=None)
    ns = parser.parse_args(args)
    device = torch.device(ns.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with tempfile.TemporaryDirectory(prefix="tier_stall-", dir=ns.disk_dir) as tmp:
        results = asyncio.run(measure(device, ns.mib, ns.repeats, Path(tmp)))
    rows: list[list[Any]] = [
        [r.tier, r.mib, r.runner, r.blocked_max_ms, r.allocate_ms, r.drained_ms] for r in results
    ]
    table = markdown_table(
        ["tier", "MiB demoted", "runner", "loop blocked (max gap) ms", "eviction call ms",
         "all copies done ms"],
        rows,
    )  # fmt: skip
    name = f"tier_stall-{device.type}"
    gpu = f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    command = "python -m bench.tier_stall" + ("" if not args else " " + shlex.join(args))
    title = f"Event-loop stall of a demoting eviction ({device.type}{gpu})"
    md = write_results(
        ns.out,
        name,
        title,
        f"Command: `{command}`; median of {ns.repeats}.\n\n{table}",
        {"command": command, "device": str(device), "results": [asdict(r) for r in results]},
    )
    plot(ns.out / f"{name}.png", title, results)
    print(md.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
