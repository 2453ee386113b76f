"""What one message costs over ``grpc.aio`` and over the framed stream, side by side.

  python -m bench.stream_cost [--messages 10000] [--calls 2000] [--out bench/results]

The conductor talks to its agents two ways: gRPC (``grpc.aio``: ``Prefill``, the Tx
calls, and everything with agents that have no token stream) and the agent's framed
token stream (``kvc/stream_frames.py``: length-prefixed frames on an asyncio protocol,
which carries ``Generate``, ``GetInfo``, ``Snapshot`` and ``WatchEvents``). Both sides
run here in one process on loopback, on uvloop, and the figure is the process's CPU
(user + system) per message or per call, both sides together. The framed side is the
agent's listener and the conductor's client themselves:

- **streamed message**: an ``EventBatch`` holding one load update (what an agent's
  ``WatchEvents`` sends twice a second), ``--messages`` of them, each on its own event
  loop turn on both transports (as messages come one by one live);
- **request/response**: ``GetInfo`` answering a calibrated ``NodeInfo`` (the poll every
  agent gets every ``agent_poll_interval_s``), ``--calls`` of them one after the other.

Writes ``stream_cost.md`` / ``.json`` / ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import uvloop

from bench.report import bar_panels, markdown_table, write_results
from conductor.adapters.token_stream import TokenStreamClient
from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from kvc.wire import SERVICE_NAME
from node_agent.token_stream import StreamMethod, TokenStreamServer


def _batch(seq: int) -> pb.EventBatch:
    load = pb.LoadUpdate(
        queued_prefill_tokens=4_096, running_requests=12, free_blocks=3_000,
        kv_usage_ratio=0.4, allocatable_blocks=4_000,
    )  # fmt: skip
    return pb.EventBatch(epoch="epoch", events=[pb.Event(seq=seq, time_s=1.0, load=load)])


def _info() -> pb.NodeInfo:
    info = pb.NodeInfo(
        node_id="node-0", epoch="epoch", role=pb.NODE_ROLE_BOTH, model="bench-model",
        engine="vllm", block_size=16, capacity_blocks=5_860, max_model_len=32_768,
        advertise_address="127.0.0.1:1", stream_address="127.0.0.1:2", fused_tx=True,
        max_running_requests=256,
    )  # fmt: skip
    cal = info.calibration
    cal.prefill_fixed_s, cal.prefill_per_token_s = 0.02, 1.5e-4
    cal.decode_fixed_s, cal.decode_per_request_s = 0.015, 2e-4
    return info


async def _batches(messages: int) -> AsyncIterator[pb.EventBatch]:
    """``messages`` batches, each on its own event loop turn (as they come live, one
    load update or block event at a time), on either transport."""
    loop = asyncio.get_running_loop()
    for seq in range(messages):
        turn = loop.create_future()
        loop.call_soon(turn.set_result, None)
        await turn
        yield _batch(seq + 1)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _per_item(run: Callable[[], Awaitable[int]], expected: int) -> float:
    """CPU seconds per item of ``run`` (which returns how many items it handled, and
    must have handled ``expected``)."""
    started = _cpu_s()
    items = await run()
    spent = _cpu_s() - started
    if items != expected:
        raise RuntimeError(f"{run.__name__} handled {items} items, not {expected}")
    return spent / items


def _handlers(messages: int) -> grpc.GenericRpcHandler:
    """The agent's ``WatchEvents`` and ``GetInfo``, answering as above."""
    info = _info()

    async def watch_events(request: pb.WatchEventsRequest, context: Any) -> AsyncIterator[Any]:
        async for batch in _batches(messages):
            yield batch

    async def get_info(request: pb.GetInfoRequest, context: Any) -> pb.NodeInfo:
        return info

    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "WatchEvents": grpc.unary_stream_rpc_method_handler(
                watch_events,
                request_deserializer=pb.WatchEventsRequest.FromString,
                response_serializer=pb.EventBatch.SerializeToString,
            ),
            "GetInfo": grpc.unary_unary_rpc_method_handler(
                get_info,
                request_deserializer=pb.GetInfoRequest.FromString,
                response_serializer=pb.NodeInfo.SerializeToString,
            ),
        },
    )


async def grpc_costs(messages: int, calls: int) -> tuple[float, float]:
    """(CPU s per streamed message, per unary call) over ``grpc.aio``."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_handlers(messages),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.NodeAgentStub(channel)
    try:
        await stub.GetInfo(pb.GetInfoRequest(), timeout=10)  # connected, warm

        async def stream() -> int:
            count = 0
            async for batch in stub.WatchEvents(pb.WatchEventsRequest()):
                count += len(batch.events)
            return count

        async def unary() -> int:
            for _ in range(calls):
                await stub.GetInfo(pb.GetInfoRequest(), timeout=10)
            return calls

        return await _per_item(stream, messages), await _per_item(unary, calls)
    finally:
        await channel.close()
        await server.stop(0)


async def framed_costs(messages: int, calls: int) -> tuple[float, float]:
    """(CPU s per streamed message, per request/response) over the framed stream: the
    agent's own listener (``node_agent/token_stream.py``) and the conductor's client
    (``conductor/adapters/token_stream.py``), serving the same two methods."""
    info = _info()

    async def get_info(request: pb.GetInfoRequest, context: Any) -> pb.NodeInfo:
        return info

    async def watch_events(request: pb.WatchEventsRequest, context: Any) -> AsyncIterator[Any]:
        async for batch in _batches(messages):
            yield batch

    def generate(request: pb.GenerateRequest, context: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("Generate is not measured here")

    server = TokenStreamServer(
        generate,
        (
            StreamMethod("GetInfo", pb.GetInfoRequest.FromString, unary=get_info),
            StreamMethod("WatchEvents", pb.WatchEventsRequest.FromString, streaming=watch_events),
        ),
    )
    port = await server.start("127.0.0.1", 0, None)
    client = TokenStreamClient(f"127.0.0.1:{port}", None, "loopback")
    request = pb.GetInfoRequest()
    try:
        await client.unary("GetInfo", request, pb.NodeInfo.FromString, deadline_s=10)  # warm

        async def stream() -> int:
            count = 0
            call = client.stream("WatchEvents", pb.WatchEventsRequest(), pb.EventBatch.FromString)
            while (batch := await call.read()) is not grpc.aio.EOF:
                count += len(batch.events)
            return count

        async def exchange() -> int:
            for _ in range(calls):
                await client.unary("GetInfo", request, pb.NodeInfo.FromString, deadline_s=10)
            return calls

        return await _per_item(stream, messages), await _per_item(exchange, calls)
    finally:
        client.close()
        await server.stop(0)


async def _measure(messages: int, calls: int) -> dict[str, dict[str, float]]:
    g_stream, g_unary = await grpc_costs(messages, calls)
    f_stream, f_unary = await framed_costs(messages, calls)
    return {
        "grpc.aio": {"stream_us": g_stream * 1e6, "request_us": g_unary * 1e6},
        "framed": {"stream_us": f_stream * 1e6, "request_us": f_unary * 1e6},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--calls", type=int, default=2_000)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    results = uvloop.run(_measure(args.messages, args.calls))
    rows = [
        [name, f"{r['stream_us']:.1f}", f"{r['request_us']:.1f}"] for name, r in results.items()
    ]
    g, f = results["grpc.aio"], results["framed"]
    rows.append(
        [
            "ratio",
            f"{g['stream_us'] / f['stream_us']:.1f}x",
            f"{g['request_us'] / f['request_us']:.1f}x",
        ]
    )
    table = markdown_table(
        ["transport", "streamed message, us CPU", "request/response, us CPU"], rows
    )
    command = "python -m bench.stream_cost " + " ".join(sys.argv[1:] if argv is None else argv)
    md = write_results(
        args.out,
        "stream_cost",
        "One message over grpc.aio and over the framed stream (both sides, one process)",
        f"Command: `{command.strip()}`\n\n{table}",
        {"messages": args.messages, "calls": args.calls, "results": results},
    )
    bar_panels(
        args.out / "stream_cost.png",
        "CPU per message, client and server together (µs)",
        list(results),
        [
            ("streamed message", [r["stream_us"] for r in results.values()]),
            ("request/response", [r["request_us"] for r in results.values()]),
        ],
    )
    print(md.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
