"""The transport port of KV transfer: how KV bytes travel between two agents.

Both directions of every transfer (a prefill's hand-off, ``FetchKv``; a prefix
migration, ``ReadBlocks``) go through one ``KvTransport``:

* sending: ``send`` frames the bytes into ``KvChunk`` messages, the layout and the
  announced size in the first, a CRC32 in each, at least one chunk (an empty one for
  zero tokens) so the receiver always learns the layout;
* receiving: ``receive`` opens a peer's ``FetchKv``/``ReadBlocks`` stream and yields its
  chunks as they come; any failure of the peer or the link is a ``TransferError``;
* lending: ``lend`` asks a peer whose engine owns its KV (vLLM) to hold a prefix for
  one pull by this node's engine (``LendBlocks``); the bytes then travel engine to
  engine, outside this transport.

What the chunks must satisfy (layout, size, order, checksums) is checked by the
receiver (``node_agent.transfer.receiver``), never by the transport, so a transport
that cuts, delays or corrupts a stream (tests do) exercises the real checks.
``GrpcKvTransport`` is the one implementation: gRPC with one channel per peer, kept
until ``aclose``.
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol

import grpc

from kvc.tls import PlaintextPolicy, TlsFiles, client_channel
from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from kvc.wire import MAX_MESSAGE_BYTES
from node_agent.errors import TransferError
from node_agent.kv import KvLayout

__all__ = ["GrpcKvTransport", "KvRequest", "KvTransport", "layout_to_pb"]

KvRequest = pb.FetchKvRequest | pb.ReadBlocksRequest


def layout_to_pb(layout: KvLayout) -> pb.KvLayout:
    return pb.KvLayout(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        bytes_per_token=layout.bytes_per_token,
    )


class KvTransport(Protocol):
    def send(
        self, data: bytes, *, layout: KvLayout, num_tokens: int, chunk_bytes: int
    ) -> AsyncIterator[pb.KvChunk]:
        """Chunks carrying ``data``, the KV of ``num_tokens`` tokens of ``layout``."""
        ...

    def receive(
        self, address: str, request: KvRequest, *, timeout_s: float | None = None
    ) -> AsyncGenerator[pb.KvChunk, None]:
        """The chunks the agent at ``address`` answers ``request`` with."""
        ...

    async def lend(
        self, address: str, request: pb.LendBlocksRequest, *, timeout_s: float | None = None
    ) -> pb.LendBlocksResponse:
        """The peer's engine transfer parameters for a prefix it holds."""
        ...

    async def aclose(self) -> None: ...


class GrpcKvTransport:
    """KV chunks over gRPC streams; one channel per peer address (the peer pool)."""

    def __init__(
        self, tls: TlsFiles | None = None, plaintext: PlaintextPolicy = "loopback"
    ) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tls = tls  # this agent's certificate: peers serve agents KV
        self._plaintext = plaintext

    async def send(
        self, data: bytes, *, layout: KvLayout, num_tokens: int, chunk_bytes: int
    ) -> AsyncIterator[pb.KvChunk]:
        view = memoryview(data)
        offset = 0
        while True:
            piece = bytes(view[offset : offset + chunk_bytes])
            msg = pb.KvChunk(
                num_tokens=num_tokens,
                total_bytes=len(data),
                offset=offset,
                data=piece,
                crc32=zlib.crc32(piece),
            )
            if offset == 0:
                msg.layout.CopyFrom(layout_to_pb(layout))
            yield msg
            offset += len(piece)
            if offset >= len(data):
                return

    async def receive(
        self, address: str, request: KvRequest, *, timeout_s: float | None = None
    ) -> AsyncGenerator[pb.KvChunk, None]:
        stub = self.stub(address)
        call: grpc.aio.UnaryStreamCall[Any, pb.KvChunk]
        if isinstance(request, pb.FetchKvRequest):
            call = stub.FetchKv(request, timeout=timeout_s)
        else:
            call = stub.ReadBlocks(request, timeout=timeout_s)
        try:
            async for chunk in call:
                yield chunk
        except grpc.aio.AioRpcError as exc:
            raise TransferError(
                f"KV transfer from {address} failed: {exc.code().name}: {exc.details()}"
            ) from exc
        finally:
            call.cancel()  # no-op when complete; stops the peer when we gave up early

    async def lend(
        self, address: str, request: pb.LendBlocksRequest, *, timeout_s: float | None = None
    ) -> pb.LendBlocksResponse:
        stub = self.stub(address)
        try:
            response: pb.LendBlocksResponse = await stub.LendBlocks(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise TransferError(
                f"prefix lend by {address} failed: {exc.code().name}: {exc.details()}"
            ) from exc
        return response

    def stub(self, address: str) -> pb_grpc.NodeAgentAsyncStub:
        """A stub on this transport's channel to ``address`` (opened on first use)."""
        channel = self._channels.get(address)
        if channel is None:
            try:
                channel = client_channel(
                    address,
                    self._tls,
                    self._plaintext,
                    options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
                )
            except ValueError as exc:  # plaintext beyond loopback, or unreadable TLS files
                raise TransferError(f"KV transfer from {address} refused: {exc}") from exc
            self._channels[address] = channel
        return pb_grpc.NodeAgentStub(channel)

    async def aclose(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
