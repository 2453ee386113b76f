"""The conductor's fleet view per request: ``Dispatcher.node_states`` over N agents.

  python -m bench.fleet_view [--fleets 2 64 256 1024] [--repeats 2000] [--out bench/results]

Every request's decision starts from the dispatcher's view of the fleet: one
``NodeState`` per agent, from its last ``NodeInfo`` (calibrated priors included), its
last load report and this conductor's own work on it. Agent handles here are the real
``AgentFleet``'s (channels opened, never called), filled as a poll and a report fill
them. Two cases per fleet size, ``--repeats`` calls each, p50/p99:

- **steady**: between two calls one agent's in-flight count changes (a request placed
  or ended), as between two requests of a live conductor;
- **every agent reported**: every agent got a new load report since the last call (the
  most a call can have to rebuild; before the view was remembered per agent, every
  call cost this).

Writes ``fleet_view.md`` / ``.json`` / ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.report import bar_panels, markdown_table, summarize_ms, write_results
from conductor.adapters.agents import AgentFleet, AgentHandle
from conductor.core.prefix_index import PrefixIndex
from conductor.core.scheduler import Scheduler, SchedulerConfig
from conductor.dispatch import Dispatcher
from kvc.v1 import node_agent_pb2 as pb

MODEL = "bench-model"


def _info(address: str) -> pb.NodeInfo:
    info = pb.NodeInfo(
        node_id=address,
        model=MODEL,
        block_size=32,
        capacity_blocks=5_860,
        role=pb.NODE_ROLE_BOTH,
        engine="vllm",
        max_running_requests=256,
    )
    cal = info.calibration
    cal.prefill_fixed_s, cal.prefill_per_token_s = 0.02, 1.5e-4
    cal.decode_fixed_s, cal.decode_per_request_s = 0.015, 2e-4
    info.kv_layout.bytes_per_token = 131_072
    return info


def _load(i: int) -> pb.LoadUpdate:
    load = pb.LoadUpdate(
        free_blocks=3_000 + i % 500,
        allocatable_blocks=4_000,
        running_requests=i % 7,
        queued_prefill_tokens=(i * 97) % 5_000,
    )
    load.tiers.add(medium=pb.KV_MEDIUM_HOST, read_bytes_per_s=1.2e10)
    return load


def _time(call: Callable[[], object], before: Callable[[int], None], repeats: int) -> list[float]:
    samples = []
    for r in range(repeats):
        before(r)
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return samples


async def measure(nodes: int, repeats: int) -> dict[str, Any]:
    addresses = [f"127.0.0.1:{20_000 + i}" for i in range(nodes)]
    fleet = AgentFleet(addresses, model=MODEL, rpc_timeout_s=1.0)
    try:
        handles: list[AgentHandle] = []
        for i, address in enumerate(addresses):
            handle = fleet.add(address)
            handle.info = _info(address)
            handle.reachable = handle.compatible = True
            handle.set_load(_load(i))
            handles.append(handle)
        dispatcher = Dispatcher(
            fleet,
            PrefixIndex(),
            Scheduler(SchedulerConfig()),
            model=MODEL,
            lease_s=30.0,
            rpc_timeout_s=1.0,
            request_timeout_s=60.0,
        )
        dispatcher.node_states()  # the first call builds every state

        def one_placed(r: int) -> None:
            handles[r % nodes].inflight = r % 3

        def all_reported(r: int) -> None:
            for i, handle in enumerate(handles):
                handle.set_load(_load(i + r))

        steady = _time(dispatcher.node_states, one_placed, repeats)
        reported = _time(dispatcher.node_states, all_reported, max(1, repeats // 10))
        return {
            "nodes": nodes,
            "steady": summarize_ms(steady),
            "all_reported": summarize_ms(reported),
        }
    finally:
        await fleet.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fleets", type=int, nargs="+", default=[2, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    ns = parser.parse_args(argv)
    rows = []
    for nodes in ns.fleets:
        rows.append(asyncio.run(measure(nodes, ns.repeats)))
        print(rows[-1], flush=True)
    table = markdown_table(
        [
            "agents",
            "steady p50 / p99 µs",
            "per agent, steady, µs",
            "every agent reported p50 / p99 µs",
            "per agent, all reported, µs",
        ],
        [
            [
                r["nodes"],
                f"{r['steady']['p50_ms'] * 1e3:.1f} / {r['steady']['p99_ms'] * 1e3:.1f}",
                f"{r['steady']['p50_ms'] * 1e3 / r['nodes']:.2f}",
                f"{r['all_reported']['p50_ms'] * 1e3:.1f} / "
                f"{r['all_reported']['p99_ms'] * 1e3:.1f}",
                f"{r['all_reported']['p50_ms'] * 1e3 / r['nodes']:.2f}",
            ]
            for r in rows
        ],
    )
    command = "python -m bench.fleet_view " + " ".join(sys.argv[1:] if argv is None else argv)
    md = write_results(
        ns.out,
        "fleet_view",
        "The conductor's fleet view per request (Dispatcher.node_states)",
        f"Command: `{command.strip()}`\n\n{ns.repeats} steady calls and "
        f"{max(1, ns.repeats // 10)} after every agent reported, per fleet.\n\n{table}",
        {"rows": rows},
    )
    bar_panels(
        ns.out / "fleet_view.png",
        "Dispatcher.node_states per request, by fleet size",
        [str(r["nodes"]) for r in rows],
        [
            ("steady p50 µs (one agent changed)", [r["steady"]["p50_ms"] * 1e3 for r in rows]),
            (
                "every agent reported p50 µs",
                [r["all_reported"]["p50_ms"] * 1e3 for r in rows],
            ),
        ],
    )
    print(md.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
