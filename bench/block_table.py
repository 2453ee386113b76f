"""Block-table benchmark: the node agent's TxAllocate/TxCommit cost.

  python -m bench.block_table [--out bench/results] [--seconds 5] [--prompt-tokens 8192]

Measures, for prompts of ``--prompt-tokens`` tokens (keys of ``--block-size`` tokens):

* in-process ``BlockPool`` operations/s: allocate+commit of a new prompt (cold, the
  pool full so every allocation evicts), allocate+commit of a fully cached prompt
  (warm), allocate+abort; and block-key hashing throughput;
* gRPC round trips to a real agent process on loopback (``kvc agent``): one
  TxAllocate + TxCommit pair per operation, at concurrency 1 and 8; ops/s, p50, p99.

Writes ``block_table.md`` (table), ``block_table.json`` and ``block_table.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from bench.report import markdown_table, summarize_ms, write_results
from kvc.block_keys import KEY_LAYOUT, BlockKey, compute_block_keys
from kvc.processes import free_port
from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from node_agent.blocks.pool import BlockPool
from node_agent.blocks.types import AllocateParams

MODEL = "tiny-llama"


def prompt_keys(index: int, tokens: int, block_size: int) -> list[BlockKey]:
    ids = [(index * 7919 + i) % 2048 for i in range(tokens)]
    return compute_block_keys(ids, tenant=f"bench-{index}", model=MODEL, block_size=block_size)


def timed_loop(seconds: float, op: Callable[[int], None]) -> tuple[int, float]:
    count = 0
    started = time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        op(count)
        count += 1
    return count, elapsed


def bench_pool(seconds: float, tokens: int, block_size: int) -> list[dict[str, Any]]:
    n_keys = tokens // block_size
    prompts = [prompt_keys(i, tokens, block_size) for i in range(64)]
    rows: list[dict[str, Any]] = []

    clock = time.monotonic
    pool = BlockPool(capacity_blocks=n_keys * 8, clock=clock)

    def cold(i: int) -> None:
        keys = prompts[i % 64]
        pool.tx_allocate(AllocateParams(tx_id=f"c{i}", tenant="t", keys=keys, lease_s=30))
        pool.tx_commit(f"c{i}")
        pool.take_events()

    # 64 distinct prompts cycling through a pool that holds 8: every allocation evicts.
    count, elapsed = timed_loop(seconds, cold)
    rows.append({"operation": "allocate+commit, new prompt (evicting)", "ops": count,
                 "ops_per_s": count / elapsed})  # fmt: skip

    warm_pool = BlockPool(capacity_blocks=n_keys * 2, clock=clock)
    warm_keys = prompts[0]
    warm_pool.tx_allocate(AllocateParams(tx_id="w", tenant="t", keys=warm_keys, lease_s=30))
    warm_pool.tx_commit("w")

    def warm(i: int) -> None:
        warm_pool.tx_allocate(AllocateParams(tx_id=f"w{i}", tenant="t", keys=warm_keys, lease_s=30))
        warm_pool.tx_commit(f"w{i}")

    count, elapsed = timed_loop(seconds, warm)
    rows.append({"operation": "allocate+commit, fully cached prompt", "ops": count,
                 "ops_per_s": count / elapsed})  # fmt: skip

    abort_pool = BlockPool(capacity_blocks=n_keys * 2, clock=clock)

    def abort(i: int) -> None:
        abort_pool.tx_allocate(
            AllocateParams(tx_id=f"a{i}", tenant="t", keys=prompts[1], lease_s=30)
        )
        abort_pool.tx_abort(f"a{i}")

    count, elapsed = timed_loop(seconds, abort)
    rows.append({"operation": "allocate+abort, new prompt", "ops": count,
                 "ops_per_s": count / elapsed})  # fmt: skip

    ids = list(range(tokens))

    def hash_keys(i: int) -> None:
        compute_block_keys(ids, tenant="t", model=MODEL, block_size=block_size)

    count, elapsed = timed_loop(seconds, hash_keys)
    rows.append({"operation": f"block keys of a {tokens}-token prompt", "ops": count,
                 "ops_per_s": count / elapsed,
                 "tokens_per_s": count * tokens / elapsed})  # fmt: skip
    return rows


async def wait_serving(address: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.NodeAgentStub(channel)
        while True:
            try:
                await stub.GetInfo(pb.GetInfoRequest(), timeout=1.0)
                return
            except grpc.aio.AioRpcError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)


async def bench_grpc(
    address: str, seconds: float, tokens: int, block_size: int, concurrency: int
) -> dict[str, Any]:
    prompts = [prompt_keys(i, tokens, block_size) for i in range(32)]
    latencies: list[float] = []
    counter = itertools.count()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.NodeAgentStub(channel)
        stop_at = time.perf_counter() + seconds

        async def worker() -> None:
            while time.perf_counter() < stop_at:
                i = next(counter)
                tx_id = f"g{concurrency}-{i}"
                started = time.perf_counter()
                await stub.TxAllocate(
                    pb.TxAllocateRequest(
                        key_layout=KEY_LAYOUT,
                        tx_id=tx_id,
                        tenant="bench",
                        block_keys=prompts[i % 32],
                        lease_s=30,
                    )
                )
                await stub.TxCommit(pb.TxCommitRequest(tx_id=tx_id))
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return {
        "concurrency": concurrency,
        "ops": len(latencies),
        "ops_per_s": len(latencies) / elapsed,
        **summarize_ms(latencies),
        "latencies_ms": [s * 1000 for s in latencies],
    }


def plot(path: Path, grpc_rows: list[dict[str, Any]], tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for row in grpc_rows:
        lat = sorted(row["latencies_ms"])
        ys = [(i + 1) / len(lat) for i in range(len(lat))]
        ax.plot(lat, ys, label=f"concurrency {row['concurrency']} ({row['ops_per_s']:.0f} ops/s)")
    ax.set_xlabel("TxAllocate + TxCommit round trip (ms)")
    ax.set_ylabel("fraction of operations")
    ax.set_title(f"Block table over gRPC, {tokens}-token prompts, loopback")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=32)
    ns = parser.parse_args(argv)

    pool_rows = bench_pool(ns.seconds, ns.prompt_tokens, ns.block_size)
    port = free_port()
    address = f"127.0.0.1:{port}"
    agent = subprocess.Popen(
        [sys.executable, "-m", "kvc_cli", "--log-level", "WARNING", "agent", "--port", str(port),
         "--block-size", str(ns.block_size), "--capacity-blocks", "65536", "--threads", "1"],
    )  # fmt: skip
    try:
        asyncio.run(wait_serving(address, 120.0))
        grpc_rows = [
            asyncio.run(bench_grpc(address, ns.seconds, ns.prompt_tokens, ns.block_size, c))
            for c in (1, 8)
        ]
    finally:
        agent.terminate()
        agent.wait(timeout=30)

    keys = ns.prompt_tokens // ns.block_size
    table = "\n\n".join(
        [
            f"In-process `BlockPool`, {ns.prompt_tokens}-token prompts ({keys} blocks of "
            f"{ns.block_size} tokens):\n\n"
            + markdown_table(
                ["operation", "ops", "ops/s"],
                [[r["operation"], r["ops"], r["ops_per_s"]] for r in pool_rows],
            ),
            "gRPC to a real agent process on loopback, TxAllocate + TxCommit per operation:\n\n"
            + markdown_table(
                ["concurrency", "ops", "ops/s", "p50 ms", "p99 ms"],
                [
                    [r["concurrency"], r["ops"], r["ops_per_s"], r["p50_ms"], r["p99_ms"]]
                    for r in grpc_rows
                ],
            ),
        ]
    )
    md = write_results(
        ns.out,
        "block_table",
        "Block table benchmark",
        table,
        {
            "prompt_tokens": ns.prompt_tokens,
            "block_size": ns.block_size,
            "pool": pool_rows,
            "grpc": [{k: v for k, v in r.items() if k != "latencies_ms"} for r in grpc_rows],
        },
    )
    plot(ns.out / "block_table.png", grpc_rows, ns.prompt_tokens)
    print(md.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
