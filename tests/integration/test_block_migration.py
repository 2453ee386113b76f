"""Hot-spot replication between prefill nodes (Mooncake §4.2, paired TxAllocate).

The conductor's choreography, driven here over real gRPC on loopback: the
destination P allocates the whole prompt, the source S locks its cached prefix
(LOCK_ONLY), P pulls those blocks from S (PullBlocks → S.ReadBlocks), P's
Prefill reuses them, and both Txs are committed. Greedy decoding from the
migrated KV must equal a full recompute.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from kvc.block_keys import KEY_LAYOUT, BlockKey, compute_block_keys
from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from node_agent.blocks.types import BlockPoolError, BlockState, KvMedium
from node_agent.engines.embedded.kv_tensors import KvCache
from node_agent.server import AgentServer
from node_agent.transfer.transport import KvRequest
from tests.conftest import MODEL, AgentFactory, DelegatingTransport, assert_no_locks, wait_until

BS = 32
TENANT = "t"
UNREACHABLE = "127.0.0.1:1"  # nothing listens on port 1 of loopback

# Three blocks of a shared "system prompt", then per-request tails.
SHARED = [10 + (7 * i + 3) % 1500 for i in range(3 * BS)]
S_PROMPT = [*SHARED, *range(100, 120)]  # S caches the 3 shared blocks
P_WARM = [*SHARED[:BS], *range(50, 60)]  # P caches only the first shared block
P_PROMPT = [*SHARED, *range(900, 945)]  # 141 tokens: 4 keys, 3 shared with S


def tx_open(agent: AgentServer, tx_id: str) -> bool:
    try:
        agent.service.pool.get_tx(tx_id)
    except BlockPoolError:
        return False
    return True


def keys_of(prompt: list[int]) -> list[int]:
    return list(compute_block_keys(prompt[:-1], tenant=TENANT, model=MODEL, block_size=BS))


def alloc(
    tx_id: str, keys: list[int], *, lease_s: float = 30.0, lock_only: bool = False
) -> pb.TxAllocateRequest:
    mode = pb.TX_MODE_LOCK_ONLY if lock_only else pb.TX_MODE_ALLOCATE
    return pb.TxAllocateRequest(
        key_layout=KEY_LAYOUT,
        tx_id=tx_id,
        tenant=TENANT,
        block_keys=keys,
        lease_s=lease_s,
        mode=mode,
    )


Stubs = Callable[[AgentServer], "pb_grpc.NodeAgentAsyncStub"]


class SlowToFinish(DelegatingTransport):
    """A KV transport whose received streams end only once ``until()`` holds."""

    def __init__(self) -> None:
        super().__init__()
        self.until: Callable[[], bool] = lambda: True

    async def receive(  # an async generator: the same call shape
        self, address: str, request: KvRequest, *, timeout_s: float | None = None
    ) -> AsyncGenerator[pb.KvChunk, None]:
        async for chunk in self._real.receive(address, request, timeout_s=timeout_s):
            yield chunk
        await wait_until(self.until)


@pytest.fixture
async def stubs() -> AsyncIterator[Stubs]:
    """One channel per agent, all closed at teardown."""
    channels: list[grpc.aio.Channel] = []

    def make(agent: AgentServer) -> pb_grpc.NodeAgentAsyncStub:
        channel = grpc.aio.insecure_channel(agent.address)
        channels.append(channel)
        return pb_grpc.NodeAgentStub(channel)

    yield make
    for channel in channels:
        await channel.close()


async def cache_prompt(stub: pb_grpc.NodeAgentAsyncStub, prompt: list[int], tag: str) -> None:
    """What the conductor does for one request: TxAllocate, Prefill, (decode,) TxCommit."""
    await stub.TxAllocate(alloc(f"{tag}-tx", keys_of(prompt)))
    await stub.Prefill(
        pb.PrefillRequest(
            request_id=f"{tag}-req", tenant=TENANT, tx_id=f"{tag}-tx", prompt_token_ids=prompt
        )
    )
    await stub.TxCommit(pb.TxCommitRequest(tx_id=f"{tag}-tx"))


def payloads(agent: AgentServer, tx_id: str) -> list[object | None]:
    pool = agent.service.pool
    return [pool.get_payload(h) for h in pool.get_tx(tx_id).handles]


def cached_state(agent: AgentServer) -> dict[int | None, object | None]:
    """Cached key -> payload object (identity shows the content was left alone)."""
    pool = agent.service.pool
    return {
        pool.block_key(h): pool.get_payload(h)
        for h in range(pool.capacity_blocks)
        if pool.block_state(h) is BlockState.CACHED
    }


async def greedy(stub: pb_grpc.NodeAgentAsyncStub, request: pb.GenerateRequest) -> list[int]:
    request.sampling.CopyFrom(pb.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return [t async for msg in stub.Generate(request) for t in msg.token_ids]


async def expect_code(call: Awaitable[Any], code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    return info.value.details() or ""


async def read_all(call: grpc.aio.UnaryStreamCall[Any, pb.KvChunk]) -> list[pb.KvChunk]:
    return [chunk async for chunk in call]


async def test_pulled_prefix_is_reused_and_decodes_like_recompute(
    start_agent: AgentFactory, stubs: Stubs
) -> None:
    src, dst, dec, cold = await asyncio.gather(
        start_agent("prefill", capacity_blocks=32),
        start_agent("prefill", capacity_blocks=32),
        start_agent("decode", capacity_blocks=8),
        start_agent("both", capacity_blocks=8),
    )
    s, p = stubs(src), stubs(dst)
    await cache_prompt(s, S_PROMPT, "s-warm")
    await cache_prompt(p, P_WARM, "p-warm")
    s_before = cached_state(src)
    keys = keys_of(P_PROMPT)
    assert len(keys) == 4

    # 1. destination: reuse its 1 cached block, allocate 3, lock all 4.
    dst_tx = await p.TxAllocate(alloc("T_dst", keys))
    assert (dst_tx.reused_blocks, dst_tx.new_blocks) == (1, 3)
    # 2. source: lock its cached prefix only.
    n = 3
    src_tx = await s.TxAllocate(alloc("T_src", keys[:n], lock_only=True))
    assert (src_tx.reused_blocks, src_tx.new_blocks) == (n, 0)
    # 3. pull: block 0 is cached on P already and left alone; blocks 1, 2 are copied.
    block0 = payloads(dst, "T_dst")[0]
    # Tokens are optional here; given, they must be those blocks' tokens.
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await p.PullBlocks(
            pb.PullBlocksRequest(
                tx_id="T_dst", source_address=src.address, source_tx_id="T_src",
                source_read_token=src_tx.read_token, num_blocks=n,
                prompt_token_ids=[t + 1 for t in P_PROMPT[: n * BS]],
            )
        )  # fmt: skip
    assert exc.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert payloads(dst, "T_dst")[1:] == [None, None, None]
    pulled = await p.PullBlocks(
        pb.PullBlocksRequest(
            tx_id="T_dst",
            source_address=src.address,
            source_tx_id="T_src",
            source_read_token=src_tx.read_token,
            num_blocks=n,
        )
    )
    bytes_per_token = dst.engine.info.kv_layout.bytes_per_token
    assert pulled.blocks_copied == 2
    assert pulled.bytes == n * BS * bytes_per_token
    assert pulled.transfer_s > 0
    after = payloads(dst, "T_dst")
    assert after[0] is block0
    assert after[3] is None
    src_blocks = payloads(src, "T_src")
    for i in (1, 2):
        mine, theirs = after[i], src_blocks[i]
        assert isinstance(mine, KvCache)
        assert isinstance(theirs, KvCache)
        assert mine.num_tokens == BS
        for (k1, v1), (k2, v2) in zip(mine.layers, theirs.layers, strict=True):
            assert torch.equal(k1.cpu(), k2.cpu())
            assert torch.equal(v1.cpu(), v2.cpu())
    # A retried pull finds nothing left to copy.
    again = await p.PullBlocks(
        pb.PullBlocksRequest(
            tx_id="T_dst",
            source_address=src.address,
            source_tx_id="T_src",
            source_read_token=src_tx.read_token,
            num_blocks=n,
        )
    )
    assert (again.blocks_copied, again.bytes) == (0, 0)
    # 4. prefill reuses the leading run: 1 own + 2 pulled blocks.
    prefill = await p.Prefill(
        pb.PrefillRequest(
            request_id="r-dst", tenant=TENANT, tx_id="T_dst", prompt_token_ids=P_PROMPT
        )
    )
    assert prefill.cached_tokens == n * BS
    assert prefill.computed_tokens == len(P_PROMPT) - 1 - n * BS
    # 5. source releases its locks; end to end, decode from the migrated KV.
    await s.TxCommit(pb.TxCommitRequest(tx_id="T_src"))
    migrated = await greedy(
        stubs(dec),
        pb.GenerateRequest(
            request_id="g-dst",
            tenant=TENANT,
            prompt_token_ids=P_PROMPT,
            kv_source=pb.KvSource(
                address=dst.address,
                request_id="r-dst",
                stage_handle=prefill.stage_handle,
                num_tokens=len(P_PROMPT) - 1,
            ),
        ),
    )
    recomputed = await greedy(
        stubs(cold),
        pb.GenerateRequest(request_id="g-cold", tenant=TENANT, prompt_token_ids=P_PROMPT),
    )
    assert len(migrated) == 8
    assert migrated == recomputed
    commit = await p.TxCommit(pb.TxCommitRequest(tx_id="T_dst"))
    assert commit.stored_blocks == 3
    assert_no_locks(src, dst, dec, cold)
    assert cached_state(src) == s_before
    assert dst.service.pool.match_prefix([BlockKey(k) for k in keys]) == 4


async def test_read_blocks_streams_checked_chunks_and_refuses_bad_requests(
    start_agent: AgentFactory, stubs: Stubs
) -> None:
    src = await start_agent("both", capacity_blocks=32)
    s = stubs(src)
    await cache_prompt(s, S_PROMPT, "warm")
    keys = keys_of(S_PROMPT)
    grants = {"lock": (await s.TxAllocate(alloc("lock", keys, lock_only=True))).read_token}
    assert len(grants["lock"]) >= 20

    chunks = await read_all(
        s.ReadBlocks(
            pb.ReadBlocksRequest(
                tx_id="lock",
                tenant=TENANT,
                block_keys=keys[:2],
                max_chunk_bytes=4096,
                read_token=grants["lock"],
            )
        )
    )
    total = 2 * BS * src.engine.info.kv_layout.bytes_per_token
    assert len(chunks) == total // 4096
    assert chunks[0].layout.num_layers > 0
    assert {(c.num_tokens, c.total_bytes) for c in chunks} == {(2 * BS, total)}
    assert [c.offset for c in chunks] == list(range(0, total, 4096))
    assert all(zlib.crc32(c.data) == c.crc32 for c in chunks)

    def read(
        tx_id: str, block_keys: list[int], token: str | None = None
    ) -> Awaitable[list[pb.KvChunk]]:
        request = pb.ReadBlocksRequest(
            tx_id=tx_id,
            tenant=TENANT,
            block_keys=block_keys,
            read_token=grants.get(tx_id, "") if token is None else token,
        )
        return read_all(s.ReadBlocks(request))

    denied = grpc.StatusCode.PERMISSION_DENIED
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    precondition = grpc.StatusCode.FAILED_PRECONDITION
    await expect_code(read("never-opened", keys), denied)  # no grant for it
    await expect_code(read("lock", keys, token=""), denied)
    token = grants["lock"]
    tampered = token[:-1] + ("B" if token.endswith("A") else "A")  # one character off
    await expect_code(read("lock", keys, token=tampered), denied)
    await expect_code(read("lock", keys[1:]), invalid)  # not the tx's leading blocks
    await expect_code(read("lock", [*keys_of(P_PROMPT)[:3], keys[0]]), invalid)
    await expect_code(read("lock", [*keys, 12345]), invalid)  # more than the tx holds
    await expect_code(read("lock", []), invalid)
    # An ALLOCATE Tx gets no grant: only a conductor's LOCK_ONLY source is readable.
    fresh = await s.TxAllocate(alloc("fresh", keys_of(P_PROMPT)))
    assert fresh.read_token == ""
    await expect_code(read("fresh", keys_of(P_PROMPT)[:3]), denied)
    # Blocks committed bare (without KV) are locked, and not readable.
    bare = keys_of([*range(1000, 1000 + 2 * BS), 1])
    await s.TxAllocate(alloc("bare", bare))
    await s.TxCommit(pb.TxCommitRequest(tx_id="bare"))
    bare_lock = await s.TxAllocate(alloc("bare-lock", bare, lock_only=True))
    grants["bare-lock"] = bare_lock.read_token
    details = await expect_code(read("bare-lock", bare), precondition)
    assert "hold no KV" in details
    await s.TxCommit(pb.TxCommitRequest(tx_id="bare-lock"))
    await expect_code(read("bare-lock", bare), precondition)  # closed tx
    await src.service.housekeeping_once()  # forgets the closed tx's grant: same answer
    await expect_code(read("bare-lock", bare), precondition)
    retried = await s.TxAllocate(alloc("lock", keys, lock_only=True))  # idempotent retry
    assert retried.read_token == grants["lock"]

    for tx_id in ("lock", "fresh"):
        await s.TxAbort(pb.TxAbortRequest(tx_id=tx_id))
    await src.service.housekeeping_once()
    assert len(src.service.read_grants) == 0  # grants go with their transactions
    assert_no_locks(src)


async def test_failed_pulls_change_nothing_on_the_destination(
    start_agent: AgentFactory, stubs: Stubs
) -> None:
    src, dst, dec = await asyncio.gather(
        start_agent("both", capacity_blocks=32),
        start_agent("prefill", capacity_blocks=32),
        start_agent("decode", capacity_blocks=8),
    )
    s, p = stubs(src), stubs(dst)
    await cache_prompt(s, S_PROMPT, "s-warm")
    await cache_prompt(p, P_WARM, "p-warm")
    keys = keys_of(P_PROMPT)
    await p.TxAllocate(alloc("T_dst", keys))
    grant = (await s.TxAllocate(alloc("T_src", keys[:3], lock_only=True))).read_token
    other = await s.TxAllocate(alloc("T_other", keys_of(S_PROMPT)[:1], lock_only=True))
    before = payloads(dst, "T_dst")
    dst_cached = cached_state(dst)

    def pull(**fields: Any) -> Awaitable[pb.PullBlocksResponse]:
        request = pb.PullBlocksRequest(
            tx_id="T_dst",
            source_address=src.address,
            source_tx_id="T_src",
            source_read_token=grant,
            num_blocks=3,
        )
        for name, value in fields.items():
            setattr(request, name, value)
        return p.PullBlocks(request)

    unavailable = grpc.StatusCode.UNAVAILABLE
    await expect_code(pull(source_address=UNREACHABLE), unavailable)
    details = await expect_code(pull(source_tx_id="no-such-tx"), unavailable)
    assert "PERMISSION_DENIED" in details  # the source's refusal is named in the message
    details = await expect_code(pull(source_read_token=""), unavailable)
    assert "PERMISSION_DENIED" in details  # no grant, no KV
    # The source's tx holds fewer blocks than the destination asks for.
    details = await expect_code(
        pull(source_tx_id="T_other", source_read_token=other.read_token), unavailable
    )
    assert "INVALID_ARGUMENT" in details
    await expect_code(pull(tx_id="no-such-tx"), grpc.StatusCode.NOT_FOUND)
    await expect_code(pull(num_blocks=5), grpc.StatusCode.INVALID_ARGUMENT)
    await expect_code(pull(num_blocks=0), grpc.StatusCode.INVALID_ARGUMENT)
    await expect_code(pull(source_address=""), grpc.StatusCode.INVALID_ARGUMENT)
    await expect_code(
        stubs(dec).PullBlocks(
            pb.PullBlocksRequest(
                tx_id="T_dst", source_address=src.address, source_tx_id="T_src", num_blocks=1
            )
        ),
        grpc.StatusCode.INVALID_ARGUMENT,  # a decode node does not pull prefixes
    )
    after = payloads(dst, "T_dst")
    assert all(a is b for a, b in zip(after, before, strict=True))
    assert cached_state(dst) == dst_cached

    for stub, tx_id in ((p, "T_dst"), (s, "T_src"), (s, "T_other")):
        await stub.TxAbort(pb.TxAbortRequest(tx_id=tx_id))
    assert_no_locks(src, dst, dec)
    assert cached_state(dst) == dst_cached


async def test_pull_after_the_destination_lease_expired_is_refused(
    start_agent: AgentFactory, stubs: Stubs
) -> None:
    slow = SlowToFinish()
    src, dst = await asyncio.gather(
        start_agent("prefill", capacity_blocks=32),
        start_agent("prefill", capacity_blocks=32, transport=slow),
    )
    s, p = stubs(src), stubs(dst)
    await cache_prompt(s, S_PROMPT, "s-warm")
    keys = keys_of(P_PROMPT)
    grant = (await s.TxAllocate(alloc("T_src", keys[:3], lock_only=True))).read_token
    request = pb.PullBlocksRequest(
        tx_id="T_dst",
        source_address=src.address,
        source_tx_id="T_src",
        source_read_token=grant,
        num_blocks=3,
    )

    # Expired before the pull.
    await p.TxAllocate(alloc("T_dst", keys, lease_s=0.2))
    await wait_until(lambda: not tx_open(dst, "T_dst"))  # the agent expires it by itself
    await expect_code(p.PullBlocks(request), grpc.StatusCode.FAILED_PRECONDITION)
    assert_no_locks(dst)

    # Expired during the transfer: nothing may be written into the freed blocks.
    service = dst.service
    slow.until = lambda: not tx_open(dst, "T_dst2")  # the lease runs out meanwhile
    await p.TxAllocate(alloc("T_dst2", keys, lease_s=0.6))
    request.tx_id = "T_dst2"
    details = await expect_code(p.PullBlocks(request), grpc.StatusCode.FAILED_PRECONDITION)
    assert "expired" in details
    assert service.pool.stats().cached_blocks == 0
    assert all(service.pool.get_payload(h) is None for h in range(service.pool.capacity_blocks))

    await s.TxCommit(pb.TxCommitRequest(tx_id="T_src"))
    assert_no_locks(src, dst)


async def test_a_source_lends_a_prefix_from_its_host_memory_and_disk(
    start_agent: AgentFactory, stubs: Stubs, tmp_path: Path
) -> None:
    """The source's copy of the prefix was pushed out of its pool into its lower tiers:
    LOCK_ONLY promotes it, the pull copies it, the destination reuses it, and decoding
    from it gives what a full recompute gives."""
    block_bytes = BS * 2048  # tiny-llama: 2 KiB of KV per token
    src, dst, cold = await asyncio.gather(
        start_agent(
            "prefill", capacity_blocks=4, host_tier_bytes=2 * block_bytes,
            disk_tier_dir=tmp_path, disk_tier_bytes=8 * block_bytes,
        ),
        start_agent("both", capacity_blocks=16),
        start_agent("both", capacity_blocks=16),
    )  # fmt: skip
    s, p = stubs(src), stubs(dst)
    await cache_prompt(s, S_PROMPT, "s-warm")  # 3 shared blocks
    for n in range(2):  # 3 + 3 more blocks through a pool of 4: the shared ones go down
        await cache_prompt(s, [*range(200 + 100 * n, 200 + 100 * n + 3 * BS + 5)], f"f{n}")
    keys = keys_of(P_PROMPT)[:3]
    pool = src.service.pool
    assert not set(keys) & {int(k) for k in pool.cached_keys()}
    lower = {int(k) for m in (KvMedium.HOST, KvMedium.DISK) for k in pool.tier_keys(m)}
    assert set(keys) <= lower
    lock = await s.TxAllocate(alloc("T_src", keys, lock_only=True))
    assert lock.reused_blocks == 3  # promoted from host memory and disk
    await p.TxAllocate(alloc("T_dst", keys_of(P_PROMPT)))
    pulled = await p.PullBlocks(
        pb.PullBlocksRequest(
            tx_id="T_dst", source_address=src.address, source_tx_id="T_src",
            source_read_token=lock.read_token, num_blocks=3,
        )
    )  # fmt: skip
    assert pulled.blocks_copied == 3
    await s.TxCommit(pb.TxCommitRequest(tx_id="T_src"))
    await p.TxCommit(pb.TxCommitRequest(tx_id="T_dst"))  # the pulled blocks are cached
    request = pb.GenerateRequest(request_id="g", tenant=TENANT, prompt_token_ids=P_PROMPT)
    from_pulled = await greedy(p, request)
    recomputed = await greedy(stubs(cold), request)
    assert from_pulled == recomputed
    assert_no_locks(src, dst, cold)
