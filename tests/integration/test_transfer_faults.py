"""A KV hand-off that breaks fails the request cleanly: nothing half-written on the
decode node, nothing committed on the prefill node, no lock left once leases end."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from kvc.block_keys import KEY_LAYOUT, compute_block_keys
from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from kvc.wire import ERROR_INFO_KEY
from node_agent.kv import KvLayout
from node_agent.server import AgentServer
from tests.conftest import (
    MODEL,
    AgentFactory,
    ConductorFactory,
    DelegatingTransport,
    assert_no_locks,
    chat_body,
)

PROMPT = [(7 * i) % 1900 + 20 for i in range(300)]  # 299 tokens of KV ≈ 600 KB: many chunks
# The faults below are a link's: the senders stream (as between hosts) instead of writing
# into the receiver's same-host shared-memory file (tests/integration/test_kv_shm.py).
STREAMED = {"kv_shm_dir": ""}


class LinkDropsAfter(DelegatingTransport):
    """A KV transport whose sending link drops after ``chunks`` chunks (0: at once)."""

    def __init__(self, chunks: int) -> None:
        super().__init__()
        self._chunks = chunks

    async def send(  # an async generator: the same call shape
        self, data: bytes, *, layout: KvLayout, num_tokens: int, chunk_bytes: int
    ) -> AsyncIterator[pb.KvChunk]:
        sent = 0
        stream = self._real.send(
            data, layout=layout, num_tokens=num_tokens, chunk_bytes=chunk_bytes
        )
        async for chunk in stream:
            if sent == self._chunks:
                raise ConnectionResetError("link dropped")
            sent += 1
            yield chunk


async def stage(prefill: AgentServer, stub: pb_grpc.NodeAgentAsyncStub, rid: str) -> str:
    keys = compute_block_keys(PROMPT[:-1], tenant="t", model=MODEL, block_size=32)
    await stub.TxAllocate(
        pb.TxAllocateRequest(
            key_layout=KEY_LAYOUT, tx_id=f"tx-{rid}", tenant="t", block_keys=keys, lease_s=30
        )
    )
    staged = await stub.Prefill(
        pb.PrefillRequest(request_id=rid, tenant="t", tx_id=f"tx-{rid}", prompt_token_ids=PROMPT)
    )
    return staged.stage_handle


def generate(rid: str, source: str, handle: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        tenant="t",
        prompt_token_ids=PROMPT,
        sampling=pb.SamplingParams(temperature=0, max_tokens=4),
        kv_source=pb.KvSource(
            address=source, request_id=rid, stage_handle=handle, num_tokens=len(PROMPT) - 1
        ),
    )


async def test_prefill_node_gone_before_the_fetch(start_agent: AgentFactory) -> None:
    prefill = await start_agent("prefill")
    decode = await start_agent("decode")
    async with (
        grpc.aio.insecure_channel(prefill.address) as pch,
        grpc.aio.insecure_channel(decode.address) as dch,
    ):
        handle = await stage(prefill, pb_grpc.NodeAgentStub(pch), "r1")
        await prefill.stop(grace_s=0.1)  # the prefill node dies with the KV staged
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await (
                pb_grpc.NodeAgentStub(dch).Generate(generate("r1", prefill.address, handle)).read()
            )
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    info = pb.ErrorInfo.FromString(dict(failed.value.trailing_metadata() or ())[ERROR_INFO_KEY])
    assert info.reason == "transfer"
    assert decode.engine.load().running_requests == 0
    assert_no_locks(decode)


async def test_transfer_cut_mid_stream(start_agent: AgentFactory) -> None:
    prefill = await start_agent(
        "prefill", transport=LinkDropsAfter(chunks=2), transfer_chunk_bytes=4096, **STREAMED
    )
    decode = await start_agent("decode")
    async with (
        grpc.aio.insecure_channel(prefill.address) as pch,
        grpc.aio.insecure_channel(decode.address) as dch,
    ):
        pstub = pb_grpc.NodeAgentStub(pch)
        handle = await stage(prefill, pstub, "r2")
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await (
                pb_grpc.NodeAgentStub(dch).Generate(generate("r2", prefill.address, handle)).read()
            )
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "KV" in (failed.value.details() or "")
        # The conductor's side of the failure: abort the prefill Tx; nothing was committed.
        aborted = await pstub.TxAbort(pb.TxAbortRequest(tx_id="tx-r2"))
        assert aborted.freed_blocks == (len(PROMPT) - 1) // 32
    assert prefill.service.pool.stats().cached_blocks == 0
    assert decode.engine.load().running_requests == 0
    assert_no_locks(prefill, decode)


async def test_conductor_reports_a_broken_handoff_and_leaks_nothing(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    prefill = await start_agent("prefill", transport=LinkDropsAfter(chunks=0), **STREAMED)
    decode = await start_agent("decode")
    async with conductor([prefill, decode]) as c:
        resp = await c.client.post("/v1/chat/completions", json=chat_body("hello " * 80))
        assert resp.status_code == 502
        assert resp.json()["error"]["code"] == "upstream_error"
        # The decode node did nothing wrong: it stays usable for the next request.
        assert c.state.fleet.get(decode.address).usable
    # The prefill committed its Tx once the KV was staged (a fused Prefill): the blocks
    # hold valid KV and stay as cache for a retry; nothing is left locked or open.
    assert prefill.service.pool.stats().cached_blocks > 0
    assert_no_locks(prefill, decode)
