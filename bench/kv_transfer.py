"""KV movement benchmark: agent-to-agent KV transfer vs raw loopback sockets, and TTFT
with a 90%-cached prefix vs cold, on the embedded engine.

  python -m bench.kv_transfer [--out bench/results] [--repeats 20]

1. Transfer: two real agent processes (``kvc agent``). A source agent caches a prompt's
   KV (TxAllocate + Prefill + TxCommit); for each repeat the destination allocates the
   same blocks, the source locks them (LOCK_ONLY) and the destination ``PullBlocks`` them
   — the real hot-spot path: gRPC stream, CRC32 per chunk, verification, per-block
   slicing into the pool. GB/s = bytes / the destination's measured transfer time.
   In the same run, a plain TCP stream on loopback moves the same number of bytes
   between two processes (the ceiling for any transfer on this machine).
2. TTFT: a conductor and one agent (role both) as real processes; time to the first
   streamed chunk for prompts whose first 90% is already cached on the node vs prompts
   never seen (a new prefix each time), same length, same engine.

Writes ``kv_transfer.md`` / ``.json`` and ``kv_transfer.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import httpx

from bench.block_table import wait_serving
from bench.report import markdown_table, summarize_ms, write_results
from kvc.block_keys import KEY_LAYOUT, compute_block_keys
from kvc.models import DEFAULT_MODEL_DIR
from kvc.processes import free_port
from kvc.tokenization import ChatTokenizer
from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc

MODEL = "tiny-llama"
BLOCK = 32


def spawn(args: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvc_cli", "--log-level", "WARNING", *args],
        stdout=subprocess.DEVNULL,
    )


async def transfer_gbps(prompt_tokens: int, repeats: int) -> dict[str, Any]:
    src_port, dst_port = free_port(), free_port()
    common = ["--capacity-blocks", "2048", "--threads", "1"]
    procs = [
        spawn(["agent", "--role", "both", "--port", str(src_port), *common]),
        spawn(["agent", "--role", "both", "--port", str(dst_port), *common]),
    ]
    try:
        src_addr, dst_addr = f"127.0.0.1:{src_port}", f"127.0.0.1:{dst_port}"
        await wait_serving(src_addr, 120)
        await wait_serving(dst_addr, 120)
        prompt = [(13 * i) % 1900 + 20 for i in range(prompt_tokens + 1)]
        keys = compute_block_keys(prompt[:-1], tenant="bench", model=MODEL, block_size=BLOCK)
        async with (
            grpc.aio.insecure_channel(src_addr) as sch,
            grpc.aio.insecure_channel(dst_addr) as dch,
        ):
            src, dst = pb_grpc.NodeAgentStub(sch), pb_grpc.NodeAgentStub(dch)
            await src.TxAllocate(
                pb.TxAllocateRequest(
                    key_layout=KEY_LAYOUT, tx_id="seed", tenant="bench", block_keys=keys, lease_s=60
                )
            )
            await src.Prefill(
                pb.PrefillRequest(
                    request_id="seed", tenant="bench", tx_id="seed", prompt_token_ids=prompt
                )
            )
            await src.TxCommit(pb.TxCommitRequest(tx_id="seed"))
            rates, nbytes = [], 0
            for i in range(repeats):
                await dst.TxAllocate(
                    pb.TxAllocateRequest(
                        key_layout=KEY_LAYOUT,
                        tx_id=f"d{i}",
                        tenant="bench",
                        block_keys=keys,
                        lease_s=60,
                    )
                )
                lock = await src.TxAllocate(
                    pb.TxAllocateRequest(key_layout=KEY_LAYOUT,
                        tx_id=f"s{i}", tenant="bench", block_keys=keys, lease_s=60,
                        mode=pb.TX_MODE_LOCK_ONLY,
                    )
                )  # fmt: skip
                pulled = await dst.PullBlocks(
                    pb.PullBlocksRequest(
                        tx_id=f"d{i}", source_address=src_addr, source_tx_id=f"s{i}",
                        source_read_token=lock.read_token, num_blocks=len(keys),
                    )
                )  # fmt: skip
                await src.TxCommit(pb.TxCommitRequest(tx_id=f"s{i}"))
                await dst.TxAbort(pb.TxAbortRequest(tx_id=f"d{i}"))  # the next pull starts cold
                nbytes = pulled.bytes
                rates.append(pulled.bytes / pulled.transfer_s / 1e9)
        return {
            "prompt_tokens": prompt_tokens,
            "bytes": nbytes,
            "gbps_median": statistics.median(rates),
            "gbps_max": max(rates),
        }
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)


def _sink(port: int, total: int) -> None:
    with socket.create_server(("127.0.0.1", port)) as server:
        conn, _ = server.accept()
        with conn:
            got = 0
            while got < total:
                chunk = conn.recv(1 << 20)
                if not chunk:
                    break
                got += len(chunk)
            conn.sendall(b"k")


def raw_socket_gbps(nbytes: int, repeats: int) -> float:
    """Bytes/s of a plain TCP stream between two processes on loopback (1 MiB writes)."""
    payload = b"\0" * (1 << 20)
    rates = []
    for _ in range(repeats):
        port = free_port()
        sink = multiprocessing.Process(target=_sink, args=(port, nbytes))
        sink.start()
        deadline = time.monotonic() + 10
        while True:
            try:
                client = socket.create_connection(("127.0.0.1", port))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        with client:
            started = time.perf_counter()
            sent = 0
            while sent < nbytes:
                n = min(len(payload), nbytes - sent)
                client.sendall(payload[:n])
                sent += n
            client.recv(1)
            rates.append(nbytes / (time.perf_counter() - started) / 1e9)
        sink.join()
    return statistics.median(rates)


def ttft_cached_vs_cold(prompt_tokens: int, repeats: int) -> dict[str, Any]:
    agent_port, http_port = free_port(), free_port()
    procs = [
        spawn(["agent", "--role", "both", "--port", str(agent_port), "--threads", "2"]),
        spawn(["conductor", "--port", str(http_port), "--agents", f"127.0.0.1:{agent_port}",
               "--drain-delay-s", "0"]),
    ]  # fmt: skip
    base = f"http://127.0.0.1:{http_port}"
    tokenizer = ChatTokenizer.from_dir(DEFAULT_MODEL_DIR)
    words = (DEFAULT_MODEL_DIR.parent / "corpus.txt").read_text().split()

    def text_of(n_tokens: int, seed: int) -> str:
        out: list[str] = []
        i = seed * 997
        while len(tokenizer.encode(" ".join(out))) < n_tokens:
            out.append(words[i % len(words)])
            i += 7
        return " ".join(out)

    def ttft(system: str, question: str) -> float:
        body = {"model": MODEL, "max_tokens": 1, "stream": True, "temperature": 0,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": question}]}  # fmt: skip
        started = time.perf_counter()
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if '"content"' in line and '"role"' not in line:
                    return time.perf_counter() - started
        return time.perf_counter() - started

    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "system not ready"
            time.sleep(0.2)
        prefix_tokens = int(prompt_tokens * 0.9)
        suffix_tokens = prompt_tokens - prefix_tokens
        shared = text_of(prefix_tokens, 1)
        ttft(shared, "warm up")  # caches the shared prefix on the only node
        warm, cold = [], []
        for i in range(repeats):
            question = text_of(suffix_tokens, 1000 + i)
            warm.append(ttft(shared, question))
            cold.append(ttft(text_of(prefix_tokens, 100 + i) + f" {uuid.uuid4().hex}", question))
        return {
            "prompt_tokens": prompt_tokens,
            "cached_fraction": 0.9,
            "warm": summarize_ms(warm),
            "cold": summarize_ms(cold),
        }
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)


def plot(
    path: Path, transfers: list[dict[str, Any]], raw_gbps: float, ttft: dict[str, Any]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    labels = [f"{t['prompt_tokens']} tok\n{t['bytes'] / 1e6:.1f} MB" for t in transfers]
    left.bar(labels, [t["gbps_median"] for t in transfers], label="agent → agent PullBlocks")
    left.axhline(
        raw_gbps, color="grey", linestyle="--", label=f"raw TCP loopback {raw_gbps:.2f} GB/s"
    )
    left.set_ylabel("GB/s (median)")
    left.set_title("KV transfer between agents on loopback")
    left.legend()
    right.bar(["cold", "90% cached"], [ttft["cold"]["p50_ms"], ttft["warm"]["p50_ms"]],
              color=["tab:red", "tab:green"])  # fmt: skip
    right.set_ylabel("TTFT p50 (ms)")
    right.set_title(f"Embedded engine, {ttft['prompt_tokens']}-token prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--transfer-tokens", type=int, nargs="*", default=[1024, 4000])
    parser.add_argument("--ttft-tokens", type=int, default=3000)
    ns = parser.parse_args(argv)
    transfers = [asyncio.run(transfer_gbps(n, ns.repeats)) for n in ns.transfer_tokens]
    raw = raw_socket_gbps(max(t["bytes"] for t in transfers), max(3, ns.repeats // 4))
    ttft = ttft_cached_vs_cold(ns.ttft_tokens, ns.repeats)
    table = "\n\n".join(
        [
            "Agent-to-agent `PullBlocks` (gRPC stream, CRC32, verify, slice into the pool) "
            "vs a raw TCP stream on loopback, same run:\n\n"
            + markdown_table(
                ["prompt tokens", "bytes", "GB/s median", "GB/s max", "raw TCP GB/s"],
                [
                    [t["prompt_tokens"], t["bytes"], t["gbps_median"], t["gbps_max"], raw]
                    for t in transfers
                ],
            ),
            f"TTFT through the conductor, {ttft['prompt_tokens']}-token prompts, embedded "
            "engine, one agent:\n\n"
            + markdown_table(
                ["prompt", "p50 ms", "p99 ms", "mean ms"],
                [
                    [
                        "cold (new prefix)",
                        ttft["cold"]["p50_ms"],
                        ttft["cold"]["p99_ms"],
                        ttft["cold"]["mean_ms"],
                    ],
                    [
                        "90% cached prefix",
                        ttft["warm"]["p50_ms"],
                        ttft["warm"]["p99_ms"],
                        ttft["warm"]["mean_ms"],
                    ],
                ],
            ),
        ]
    )
    md = write_results(
        ns.out, "kv_transfer", "KV transfer and cached-prefix TTFT", table,
        {"transfers": transfers, "raw_tcp_gbps": raw, "ttft": ttft},
    )  # fmt: skip
    plot(ns.out / "kv_transfer.png", transfers, raw, ttft)
    print(md.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
