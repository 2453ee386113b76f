"""Fused transactions: the TxAllocate rides in the call that does the work.

Over a real channel on loopback, against the embedded engine. ``Generate`` on a "both"
node commits before the first token leaves; ``Prefill`` on a prefill node commits once
the KV is staged. Either way the blocks are reusable prefix afterwards, any call that
fails before its commit leaves nothing locked, and the errors are TxAllocate's.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import pytest

from conductor.adapters.agents import translate_rpc_error
from kvc.block_keys import KEY_LAYOUT, compute_block_keys
from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from node_agent.server import AgentServer
from tests.conftest import MODEL, AgentFactory, assert_no_locks, wait_until

PROMPT = list(range(100, 100 + 70))  # prompt[:-1] is 69 tokens: 2 full 32-token blocks


def allocation(tx_id: str, keys: Sequence[int]) -> pb.TxAllocateRequest:
    """The TxAllocate a conductor of this version fuses into a call (tenant "t")."""
    return pb.TxAllocateRequest(
        key_layout=KEY_LAYOUT,
        tx_id=tx_id,
        tenant="t",
        block_keys=keys,
        lease_s=30.0,
        mode=pb.TX_MODE_ALLOCATE,
    )


def fused(
    tx_id: str, prompt: list[int], *, keys: Sequence[int] | None = None, max_tokens: int = 4
) -> pb.GenerateRequest:
    if keys is None:
        keys = list(compute_block_keys(prompt[:-1], tenant="t", model=MODEL, block_size=32))
    return pb.GenerateRequest(
        request_id=f"r-{tx_id}",
        tenant="t",
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0),
        tx_id=tx_id,
        tx=allocation(tx_id, keys),
    )


async def test_the_agent_says_it_fuses(stub: pb_grpc.NodeAgentAsyncStub) -> None:
    assert (await stub.GetInfo(pb.GetInfoRequest())).fused_tx


async def test_commits_before_the_first_token_and_reuses_after(
    agent: AgentServer, stub: pb_grpc.NodeAgentAsyncStub
) -> None:
    call = stub.Generate(fused("tx-1", PROMPT))
    first = await call.read()
    assert isinstance(first, pb.GenerateResponse)
    assert first.token_ids
    assert first.timings.cached_tokens == 0
    assert agent.service.pool.stats().open_txs == 0  # committed before it was sent
    assert agent.service.pool.stats().cached_blocks == 2
    last = first
    while (msg := await call.read()) is not grpc.aio.EOF:
        assert isinstance(msg, pb.GenerateResponse)
        last = msg
    assert last.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    again = [msg async for msg in stub.Generate(fused("tx-2", PROMPT))]
    assert again[0].timings.cached_tokens == 64
    assert again[-1].usage.cached_tokens == 64
    assert_no_locks(agent)


async def test_a_call_that_fails_after_allocating_leaves_nothing_locked(
    agent: AgentServer, stub: pb_grpc.NodeAgentAsyncStub
) -> None:
    other = [
        int(k)
        for k in compute_block_keys(range(5000, 5064), tenant="t", model=MODEL, block_size=32)
    ]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Generate(fused("tx-bad", PROMPT, keys=other)).read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # keys of another prompt
    assert_no_locks(agent)
    assert agent.service.pool.stats().cached_blocks == 0


async def test_a_call_cancelled_while_it_holds_the_tx_aborts_it(
    agent: AgentServer, stub: pb_grpc.NodeAgentAsyncStub
) -> None:
    """Cancelled between the allocation and the first token: the agent aborts the Tx."""
    call = stub.Generate(fused("tx-c", PROMPT, max_tokens=64))
    # The handler runs on this loop: yield to it until it holds the Tx.
    await wait_until(lambda: agent.service.pool.stats().open_txs > 0, poll_s=0)
    call.cancel()
    await wait_until(lambda: agent.service.pool.stats().open_txs == 0)
    assert_no_locks(agent)
    assert agent.service.pool.stats().cached_blocks == 0  # aborted, not committed


async def test_a_call_cancelled_after_its_first_token_keeps_the_commit(
    agent: AgentServer, stub: pb_grpc.NodeAgentAsyncStub
) -> None:
    call = stub.Generate(fused("tx-t", PROMPT, max_tokens=64))
    assert isinstance(await call.read(), pb.GenerateResponse)
    call.cancel()
    assert_no_locks(agent)
    assert agent.service.pool.stats().cached_blocks == 2


@pytest.mark.parametrize(
    ("mutate", "code"),
    [
        (lambda r: setattr(r, "tx_id", "other"), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda r: setattr(r.tx, "tenant", "u"), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda r: setattr(r.tx, "mode", pb.TX_MODE_LOCK_ONLY), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda r: setattr(r.tx, "lease_s", 0.0), grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_malformed_fused_calls_are_refused_and_change_nothing(
    agent: AgentServer, stub: pb_grpc.NodeAgentAsyncStub, mutate: object, code: grpc.StatusCode
) -> None:
    request = fused("tx-m", PROMPT)
    assert callable(mutate)
    mutate(request)
    before = agent.service.pool.stats()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Generate(request).read()
    assert info.value.code() == code
    assert agent.service.pool.stats() == before


async def test_capacity_refusal_is_the_allocations(
    agent: AgentServer, stub: pb_grpc.NodeAgentAsyncStub
) -> None:
    prompt = list(range(65 * 32 + 1))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Generate(fused("tx-big", prompt)).read()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    error = translate_rpc_error(agent.address, info.value)
    assert error.reason == "capacity"  # the conductor tries another node
    assert_no_locks(agent)


async def test_a_draining_node_refuses_fused_calls(
    agent: AgentServer, stub: pb_grpc.NodeAgentAsyncStub
) -> None:
    await stub.Drain(pb.DrainRequest())
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Generate(fused("tx-d", PROMPT)).read()
    assert translate_rpc_error(agent.address, info.value).reason == "draining"
    assert_no_locks(agent)


def fused_prefill(tx_id: str, prompt: list[int], tenant: str = "t") -> pb.PrefillRequest:
    keys = list(compute_block_keys(prompt[:-1], tenant="t", model=MODEL, block_size=32))
    return pb.PrefillRequest(
        request_id=f"r-{tx_id}",
        tenant=tenant,
        tx_id=tx_id,
        prompt_token_ids=prompt,
        tx=allocation(tx_id, keys),
    )


async def test_a_fused_prefill_commits_once_its_kv_is_staged(start_agent: AgentFactory) -> None:
    prefill = await start_agent("prefill", capacity_blocks=64)
    async with grpc.aio.insecure_channel(prefill.address) as channel:
        stub = pb_grpc.NodeAgentStub(channel)
        first = await stub.Prefill(fused_prefill("p-1", PROMPT))
        assert (first.cached_tokens, first.computed_tokens) == (0, 69)
        assert prefill.service.pool.stats().open_txs == 0
        assert prefill.service.pool.stats().cached_blocks == 2
        fetch = pb.FetchKvRequest(request_id="r-p-1", stage_handle=first.stage_handle, tenant="t")
        chunks = [c async for c in stub.FetchKv(fetch)]
        assert sum(len(c.data) for c in chunks) == chunks[0].total_bytes > 0
        again = await stub.Prefill(fused_prefill("p-2", PROMPT))
        assert again.cached_tokens == 64  # the first prefill's blocks, reused
    assert_no_locks(prefill)


async def test_a_fused_prefill_that_fails_leaves_nothing_locked(
    start_agent: AgentFactory,
) -> None:
    prefill = await start_agent("prefill", capacity_blocks=64)
    decode = await start_agent("decode", capacity_blocks=64)
    async with (
        grpc.aio.insecure_channel(prefill.address) as p_channel,
        grpc.aio.insecure_channel(decode.address) as d_channel,
    ):
        stub = pb_grpc.NodeAgentStub(p_channel)
        request = fused_prefill("p-bad", PROMPT)
        request.request_id = ""  # refused by the prefill after the allocation
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Prefill(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        before = decode.service.pool.stats()
        with pytest.raises(grpc.aio.AioRpcError) as info:  # wrong role: refused up front
            await pb_grpc.NodeAgentStub(d_channel).Prefill(fused_prefill("p-d", PROMPT))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert decode.service.pool.stats() == before
        mismatched = fused_prefill("p-m", PROMPT)
        mismatched.tx.tx_id = "other"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Prefill(mismatched)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_no_locks(prefill, decode)
    assert prefill.service.pool.stats().cached_blocks == 0


async def test_the_agent_says_which_block_key_layout_it_keys_in(
    stub: pb_grpc.NodeAgentAsyncStub,
) -> None:
    assert (await stub.GetInfo(pb.GetInfoRequest())).block_key_layout == KEY_LAYOUT == 2


async def test_a_conductor_from_before_layouts_is_still_served(
    agent: AgentServer, stub: pb_grpc.NodeAgentAsyncStub
) -> None:
    """A transaction without ``key_layout`` carries layout-1 keys (what conductors sent
    before the field): the agent verifies the prompt in layout 1, serves it, and the
    blocks are reused by the next such call. Agents can be upgraded first."""
    old_keys = list(
        compute_block_keys(PROMPT[:-1], tenant="t", model=MODEL, block_size=32, layout=1)
    )
    first = fused("tx-old-1", PROMPT, keys=old_keys)
    first.tx.ClearField("key_layout")
    assert [msg.token_ids async for msg in stub.Generate(first)]
    again = fused("tx-old-2", PROMPT, keys=old_keys)
    again.tx.ClearField("key_layout")
    replies = [msg async for msg in stub.Generate(again)]
    assert replies[0].timings.cached_tokens == 64
    # The same prompt in layout 2 shares no block with them: a fresh allocation.
    fresh = [msg async for msg in stub.Generate(fused("tx-new", PROMPT))]
    assert fresh[0].timings.cached_tokens == 0
    assert agent.service.pool.stats().cached_blocks == 4
    assert_no_locks(agent)


@pytest.mark.parametrize(
    ("layout", "keys_layout"),
    [
        (0, 2),  # layout-2 keys named as layout 1 (no field): they are not this prompt's
        (1, 2),
        (2, 1),
        (3, 2),  # a layout this agent does not know
        (99, 2),
    ],
)
async def test_keys_of_another_layout_than_named_are_refused_and_change_nothing(
    agent: AgentServer, stub: pb_grpc.NodeAgentAsyncStub, layout: int, keys_layout: int
) -> None:
    keys = list(
        compute_block_keys(PROMPT[:-1], tenant="t", model=MODEL, block_size=32, layout=keys_layout)
    )
    request = fused("tx-l", PROMPT, keys=keys)
    request.tx.key_layout = layout
    before = agent.service.pool.stats()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Generate(request).read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    if layout > 2:
        assert "layout" in (info.value.details() or "")
    assert agent.service.pool.stats().open_txs == before.open_txs
    assert_no_locks(agent)
