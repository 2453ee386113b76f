"""Same-host KV transfer: a handoff and a prefix pull between two real agents on this
machine go through a shared-memory file instead of the gRPC stream, decode exactly as
the streamed ones, and leave no file behind; agents that cannot see each other's file
stream as before."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from pathlib import Path

import grpc
import pytest
import torch

from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from node_agent.engines.embedded.kv_tensors import KvCache
from node_agent.server import AgentServer
from node_agent.transfer.transport import KvRequest
from tests.conftest import AgentFactory, DelegatingTransport, assert_no_locks
from tests.integration.test_block_migration import S_PROMPT, alloc, cache_prompt, keys_of
from tests.integration.test_transfer_faults import PROMPT, generate, stage


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def shared_transfers(agent: AgentServer) -> float:
    registry = agent.service.metrics.registry
    return registry.get_sample_value("node_agent_kv_shared_memory_transfers_total") or 0.0


def handoff_bytes(agent: AgentServer, direction: str) -> float:
    labels = {"direction": direction, "kind": "handoff"}
    registry = agent.service.metrics.registry
    return registry.get_sample_value("node_agent_kv_transfer_bytes_total", labels) or 0.0


async def handoff_tokens(prefill: AgentServer, decode: AgentServer, rid: str) -> list[int]:
    async with (
        grpc.aio.insecure_channel(prefill.address) as pch,
        grpc.aio.insecure_channel(decode.address) as dch,
    ):
        handle = await stage(prefill, pb_grpc.NodeAgentStub(pch), rid)
        await pb_grpc.NodeAgentStub(pch).TxCommit(pb.TxCommitRequest(tx_id=f"tx-{rid}"))
        request = generate(rid, prefill.address, handle)
        request.sampling.CopyFrom(pb.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        return [t async for m in pb_grpc.NodeAgentStub(dch).Generate(request) for t in m.token_ids]


async def test_a_same_host_handoff_goes_through_shared_memory_and_decodes_the_same(
    start_agent: AgentFactory, tmp_path: Path
) -> None:
    shm = {"kv_shm_dir": str(tmp_path)}
    prefill = await start_agent("prefill", **shm)
    decode = await start_agent("decode", **shm)
    streamed_decode = await start_agent("decode", kv_shm_dir="")  # offers nothing

    shared = await handoff_tokens(prefill, decode, "r1")
    streamed = await handoff_tokens(prefill, streamed_decode, "r2")

    assert shared == streamed
    assert len(shared) == 6
    assert (shared_transfers(decode), shared_transfers(streamed_decode)) == (1.0, 0.0)
    kv_bytes = (len(PROMPT) - 1) * decode.engine.info.kv_layout.bytes_per_token
    assert handoff_bytes(decode, "received") == kv_bytes  # counted like a streamed one
    assert handoff_bytes(prefill, "sent") == 2 * kv_bytes
    assert files(tmp_path) == []  # the receiver removed its file
    assert_no_locks(prefill, decode, streamed_decode)


async def test_a_same_host_prefix_pull_goes_through_shared_memory_bit_for_bit(
    start_agent: AgentFactory, tmp_path: Path
) -> None:
    shm = {"kv_shm_dir": str(tmp_path), "capacity_blocks": 32}
    src = await start_agent("prefill", **shm)
    dst = await start_agent("prefill", **shm)
    async with (
        grpc.aio.insecure_channel(src.address) as sch,
        grpc.aio.insecure_channel(dst.address) as dch,
    ):
        s, d = pb_grpc.NodeAgentStub(sch), pb_grpc.NodeAgentStub(dch)
        await cache_prompt(s, S_PROMPT, "warm")
        keys = keys_of(S_PROMPT)[:3]
        grant = (await s.TxAllocate(alloc("T_src", keys, lock_only=True))).read_token
        await d.TxAllocate(alloc("T_dst", keys))
        pulled = await d.PullBlocks(
            pb.PullBlocksRequest(
                tx_id="T_dst", source_address=src.address, source_tx_id="T_src",
                source_read_token=grant, num_blocks=3,
            )
        )  # fmt: skip
        assert pulled.blocks_copied == 3
        assert shared_transfers(dst) == 1.0
        pool_s, pool_d = src.service.pool, dst.service.pool
        pairs = zip(pool_s.get_tx("T_src").handles, pool_d.get_tx("T_dst").handles, strict=True)
        for hs, hd in pairs:
            theirs, ours = pool_s.get_payload(hs), pool_d.get_payload(hd)
            assert isinstance(theirs, KvCache)
            assert isinstance(ours, KvCache)
            for (k1, v1), (k2, v2) in zip(ours.layers, theirs.layers, strict=True):
                assert torch.equal(k1, k2)
                assert torch.equal(v1, v2)
        await s.TxCommit(pb.TxCommitRequest(tx_id="T_src"))
        await d.TxCommit(pb.TxCommitRequest(tx_id="T_dst"))
    assert files(tmp_path) == []
    assert_no_locks(src, dst)


async def test_agents_that_cannot_see_each_others_file_stream(
    start_agent: AgentFactory, tmp_path: Path
) -> None:
    """Two directories stand for two hosts: the sender finds no offer and streams."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    prefill = await start_agent("prefill", kv_shm_dir=str(tmp_path / "a"))
    decode = await start_agent("decode", kv_shm_dir=str(tmp_path / "b"))
    tokens = await handoff_tokens(prefill, decode, "r3")
    assert len(tokens) == 6
    assert shared_transfers(decode) == 0.0
    assert files(tmp_path / "b") == []  # the unused offer was removed too
    assert_no_locks(prefill, decode)


class ClaimsSharedMemory(DelegatingTransport):
    """A receiving transport whose peer answers "written to your file" and wrote nothing."""

    async def receive(  # an async generator: the same call shape
        self, address: str, request: KvRequest, *, timeout_s: float | None = None
    ) -> AsyncGenerator[pb.KvChunk, None]:
        request.shared_memory_name = ""  # the real peer streams; its first chunk is replaced
        async for chunk in self._real.receive(address, request, timeout_s=timeout_s):
            yield pb.KvChunk(
                layout=chunk.layout, num_tokens=chunk.num_tokens,
                total_bytes=chunk.total_bytes, in_shared_memory=True,
            )  # fmt: skip
            return


async def test_a_claimed_shared_memory_transfer_nobody_wrote_fails_cleanly(
    start_agent: AgentFactory, tmp_path: Path
) -> None:
    prefill = await start_agent("prefill")
    decode = await start_agent("decode", kv_shm_dir=str(tmp_path), transport=ClaimsSharedMemory())
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await handoff_tokens(prefill, decode, "r4")
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "not written" in (failed.value.details() or "")  # never decoded as zeros
    assert shared_transfers(decode) == 0.0
    assert files(tmp_path) == []
    assert decode.engine.load().running_requests == 0
    assert_no_locks(decode)
