"""What one message costs over ``grpc.aio`` and over the framed stream, side by side.

  python -m bench.stream_cost [--messages 10000] [--calls 2000] [--out bench/results]

The conductor talks to its agents two ways: gRPC (``grpc.aio``: ``WatchEvents``, the
``GetInfo`` poll, ``Prefill``, the Tx calls) and the agent's framed token stream
(``kvc/stream_frames.py``: length-prefixed frames on an asyncio protocol, which carries
``Generate``). Both sides run here in one process on loopback, on uvloop, and the
figure is the process's CPU (user + system) per message or per call, both sides
together:

- **streamed message**: an ``EventBatch`` holding one load update (what an agent's
  ``WatchEvents`` sends twice a second), ``--messages`` of them, one write per event
  loop turn on the framed side (as messages come one by one live);
- **request/response**: ``GetInfo`` answering a calibrated ``NodeInfo`` (the poll every
  agent gets every ``agent_poll_interval_s``), ``--calls`` of them one after the other;
  on the framed side the same two messages as one frame each way.

Writes ``stream_cost.md`` / ``.json`` / ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import grpc
import uvloop

from bench.report import bar_panels, markdown_table, write_results
from kvc.stream_frames import END, MESSAGE, FrameReader, frame
from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from kvc.wire import MAX_MESSAGE_BYTES, SERVICE_NAME


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
        for seq in range(messages):
            yield _batch(seq + 1)

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


class _FramedServer(asyncio.Protocol):
    """Streams ``messages`` batches (one write per loop turn) on a GENERATE frame with
    payload b"stream"; answers any other frame with a NodeInfo frame."""

    def __init__(self, messages: int) -> None:
        self._messages = messages
        self._reader = FrameReader(MAX_MESSAGE_BYTES)
        self._info = _info()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        for _, payload in self._reader.feed(data):
            if payload == b"stream":
                self._send_batch(1)
            else:
                pb.GetInfoRequest.FromString(payload)
                self._write(frame(MESSAGE, self._info.SerializeToString()))

    def _write(self, data: bytes) -> None:
        assert self._transport is not None
        self._transport.write(data)

    def _send_batch(self, seq: int) -> None:
        """Batch ``seq``, and the next one on the loop's next turn (one write per turn,
        as messages come one by one live); END after the last."""
        if seq > self._messages:
            self._write(frame(END))
            return
        self._write(frame(MESSAGE, _batch(seq).SerializeToString()))
        asyncio.get_running_loop().call_soon(self._send_batch, seq + 1)


class _FramedClient(asyncio.Protocol):
    def __init__(self) -> None:
        self._reader = FrameReader(MAX_MESSAGE_BYTES)
        self.streamed = 0
        self.stream_end: asyncio.Future[None] | None = None  # set while streaming
        self.reply: asyncio.Future[None] | None = None  # set while a request waits

    def data_received(self, data: bytes) -> None:
        for kind, payload in self._reader.feed(data):
            if self.stream_end is not None:
                if kind == END:
                    self.stream_end.set_result(None)
                    self.stream_end = None
                else:
                    self.streamed += len(pb.EventBatch.FromString(payload).events)
            elif self.reply is not None:
                pb.NodeInfo.FromString(payload)
                self.reply.set_result(None)
                self.reply = None


async def framed_costs(messages: int, calls: int) -> tuple[float, float]:
    """(CPU s per streamed message, per request/response) over the framed stream."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _FramedServer(messages), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport, client = await loop.create_connection(_FramedClient, "127.0.0.1", port)
    request = frame(MESSAGE, pb.GetInfoRequest().SerializeToString())
    try:

        async def stream() -> int:
            end = client.stream_end = loop.create_future()
            transport.write(frame(MESSAGE, b"stream"))
            await end
            return client.streamed

        async def exchange() -> int:
            for _ in range(calls):
                reply = client.reply = loop.create_future()
                transport.write(request)
                await reply
            return calls

        return await _per_item(stream, messages), await _per_item(exchange, calls)
    finally:
        transport.close()
        server.close()


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
