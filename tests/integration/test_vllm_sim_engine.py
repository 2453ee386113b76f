"""The project's real vLLM adapter against the simulated vLLM engine (kvc_sim.vllm_sim),
end to end: real sim engines under uvicorn on loopback (port 0, KV events over ZMQ),
real agents (``VllmEngineAdapter`` in an ``AgentServer``) attached by URL, and the real
conductor app.

Checked: the agent's pool takes the engine's geometry; a generation streams; the engine's
KV events land in the agent's pool under the canonical keys the conductor computes; a
second identical request reports cached tokens; prefill/decode through
``kv_transfer_params`` (``pd_connector=nixl``) moves the KV from the prefill engine to
the decode engine (the prefill engine's held blocks are released by the pull); a
prefix pull between two vLLM nodes (``PullBlocks`` → the holder's ``LendBlocks``) through
the same protocol lands the prefix in the puller's engine cache, where its prefill finds it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import grpc
import httpx
import pytest

from conductor.core.prefix_index import NodeId
from kvc.block_keys import KEY_LAYOUT, BlockKey, compute_block_keys
from kvc.models import DEFAULT_MODEL_DIR
from kvc.roles import NodeRole
from kvc.tokenization import ChatTokenizer
from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from kvc_sim.profile import load_profile
from kvc_sim.vllm_sim.config import KvEventsConfig, SimEngineConfig
from kvc_sim.vllm_sim.server import SimEngineServer, SimEngineState, create_app
from node_agent.blocks.types import KvMedium
from node_agent.engines.vllm.adapter import VllmEngineAdapter
from node_agent.engines.vllm.config import VllmConfig, salt_for_tenant
from node_agent.main import start_engine
from node_agent.server import AgentServer
from node_agent.settings import AgentSettings
from node_agent.transfer.transport import GrpcKvTransport, KvTransport
from tests.conftest import ConductorFactory, assert_no_locks, chat_body, metric_value, wait_until

MODEL = "tiny-llama"
TENANT = "default"  # the conductor's tenant for unauthenticated requests
BLOCK_SIZE = 16
TOKENIZER = ChatTokenizer.from_dir(DEFAULT_MODEL_DIR)
PROMPT = " ".join(f"word{i}" for i in range(60))

Node = tuple[AgentServer, SimEngineServer]
StartNode = Callable[..., Awaitable[Node]]


def _engine_state(engine: SimEngineServer) -> SimEngineState:
    state: SimEngineState = engine.app.state.sim
    return state


@pytest.fixture
async def start_node() -> AsyncIterator[StartNode]:
    """A sim engine with KV events and an agent attached to it; all stopped at teardown."""
    nodes: list[Node] = []

    async def start(
        role: NodeRole,
        pd_connector: str,
        *,
        cpu_blocks: int = 0,
        transport: KvTransport | None = None,
        scheduling_policy: str = "fcfs",
        **agent_settings: Any,
    ) -> Node:
        config = SimEngineConfig(
            model_dir=DEFAULT_MODEL_DIR,
            served_model_name=MODEL,
            max_model_len=2048,
            block_size=BLOCK_SIZE,
            num_gpu_blocks=129,
            num_cpu_blocks=cpu_blocks,
            time_scale=0.01,
            scheduling_policy=scheduling_policy,
            engine_id=f"engine-{role}-{len(nodes)}",
            kv_events=KvEventsConfig(
                enable_kv_cache_events=True,
                endpoint="tcp://*:0",
                replay_endpoint="tcp://*:0",
                topic="kv-events",
            ),
        )
        engine = SimEngineServer(create_app(config, load_profile("llama3-70b-8xa800")))
        await engine.start()
        state = engine.app.state
        settings = AgentSettings(
            role=role,
            port=0,
            engine="vllm",
            vllm_url=engine.url,
            kv_events_endpoint=loopback(state.kv_events_endpoint),
            kv_events_replay_endpoint=loopback(state.kv_events_replay_endpoint),
            pd_connector=pd_connector,
            load_interval_s=0.05,
            calibrate=False,
            vllm_cpu_offload_bytes=cpu_blocks * BLOCK_SIZE * 2048,  # tiny-llama: 2 KiB/token
            **agent_settings,
        )
        adapter = VllmEngineAdapter(VllmConfig.from_settings(settings), TOKENIZER)
        settings = await start_engine(adapter, settings)
        agent = AgentServer(settings, adapter, transport=transport)
        await agent.start()
        nodes.append((agent, engine))
        return agent, engine

    yield start
    for agent, engine in nodes:
        await agent.stop(grace_s=0.5)
        await engine.stop()


def loopback(endpoint: str) -> str:
    """The engine bound ``tcp://*:0``; the agent connects on loopback."""
    return endpoint.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")


def _events_applied(agent: AgentServer) -> int:
    """KV-event batches the agent's subscriber applied (the mirror is fed by them)."""
    adapter = agent.engine
    assert isinstance(adapter, VllmEngineAdapter)
    subscriber = adapter._subscriber
    assert subscriber is not None
    return subscriber.stats.batches


def _prompt_keys() -> set[int]:
    ids = TOKENIZER.chat_token_ids([{"role": "user", "content": PROMPT}])
    keys = compute_block_keys(ids, tenant=TENANT, model=MODEL, block_size=BLOCK_SIZE)
    assert len(keys) >= 3
    return {int(k) for k in keys}


def _mirrored(agent: AgentServer, keys: set[int]) -> bool:
    return keys <= {int(k) for k in agent.service.pool.cached_keys()}


async def test_agent_attaches_streams_and_mirrors_the_sim_engine(
    start_node: StartNode, conductor: ConductorFactory
) -> None:
    agent, engine = await start_node("both", "none")
    info = agent.service.node_info
    # The agent's settings say 32-token blocks and 4096 of them: the engine's win.
    assert (info.engine, info.block_size, info.capacity_blocks) == ("vllm", 16, 128)
    assert agent.service.pool.capacity_blocks == 128
    async with conductor([agent]) as c:
        body = chat_body(PROMPT, max_tokens=6, stream=True, stream_options={"include_usage": True})
        async with c.client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            chunks = [
                json.loads(line[6:])
                async for line in r.aiter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
        tokens = [ch for ch in chunks if ch["choices"] and ch["choices"][0]["delta"].get("content")]
        assert len(tokens) >= 2  # streamed, not one block of text
        assert chunks[-1]["usage"]["completion_tokens"] == 6
        await wait_until(partial(_mirrored, agent, _prompt_keys()))
        await wait_until(lambda: _events_applied(agent) > 0)
        again = await c.client.post("/v1/chat/completions", json=chat_body(PROMPT, max_tokens=2))
        assert again.status_code == 200, again.text
        cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 3 * BLOCK_SIZE
    scheduler = _engine_state(engine).runner.scheduler
    assert scheduler.prefix_cache_hits >= cached
    # A request straight to the engine (no Tx in the agent): only KV events can tell the
    # agent, under the keys the conductor computes for the tenant whose salt it carried.
    ids = list(range(300, 364))
    async with httpx.AsyncClient(base_url=engine.url) as http:
        body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "cache_salt": "t-direct"}
        assert (await http.post("/v1/completions", json=body)).status_code == 200
    keys = compute_block_keys(ids, tenant="t-direct", model=MODEL, block_size=BLOCK_SIZE)
    await wait_until(partial(_mirrored, agent, {int(k) for k in keys[:3]}))
    assert_no_locks(agent)


async def test_prefill_decode_hand_off_between_sim_engines(
    start_node: StartNode, conductor: ConductorFactory
) -> None:
    prefill, p_engine = await start_node("prefill", "nixl")
    decode, d_engine = await start_node("decode", "nixl")
    p_state, d_state = _engine_state(p_engine), _engine_state(d_engine)
    async with conductor([prefill, decode]) as c:
        first = await c.client.post("/v1/chat/completions", json=chat_body(PROMPT, max_tokens=5))
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["completion_tokens"] == 5
        # A cold prompt: the KV the decode engine pulled is no cache hit for the client.
        assert first.json()["usage"].get("prompt_tokens_details") in (None, {"cached_tokens": 0})
        assert d_state.puller.pulls == 1
        assert d_state.puller.failures == 0
        assert p_state.runner.scheduler.held == {}  # the pull released the prefill's blocks
        # The decode engine cached the pulled prompt: its KV events reach its agent.
        await wait_until(partial(_mirrored, decode, _prompt_keys()))
        await wait_until(partial(_mirrored, prefill, _prompt_keys()))
        assert _events_applied(decode) > 0
        second = await c.client.post("/v1/chat/completions", json=chat_body(PROMPT, max_tokens=5))
        assert second.status_code == 200, second.text
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert d_state.puller.pulls == 2
    assert p_state.runner.scheduler.prefix_cache_hits > 0  # the prefill engine reused it
    assert p_state.runner.scheduler.pool.free_blocks == p_state.runner.scheduler.pool.usable_blocks
    assert_no_locks(prefill, decode)


async def test_a_decode_leg_whose_prefill_is_gone_computes_the_prompt(
    start_node: StartNode,
) -> None:
    _, engine = await start_node("both", "none")
    body = {
        "model": MODEL,
        "prompt": list(range(5, 60)),
        "max_tokens": 2,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "nobody",
            "remote_request_id": "r-1",
            "remote_host": "127.0.0.1",
            "remote_port": engine.port,
            "remote_block_ids": [1, 2, 3],
        },
    }
    async with httpx.AsyncClient(base_url=engine.url) as http:
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
        assert _engine_state(engine).puller.failures == 1
        bad = {**body, "kv_transfer_params": {"do_remote_prefill": True}}
        assert (await http.post("/v1/completions", json=bad)).status_code == 400


async def test_host_copies_of_vllm_cpu_offloading_keep_a_prefix_held(
    start_node: StartNode, conductor: ConductorFactory
) -> None:
    """The engine offloads every cached block to host memory; other traffic pushes the
    prompt's blocks off its GPU; the agent reports them moved to HOST (not removed), the
    conductor still counts them as held there, and the next request for the prompt is
    served from the engine's host copies (cached tokens, nothing recomputed)."""
    agent, engine = await start_node("both", "none", cpu_blocks=1024)
    assert [t.medium for t in agent.service.node_info.tiers] == [pb.KV_MEDIUM_HOST]
    keys = _prompt_keys()
    pool = agent.service.pool
    async with conductor([agent]) as c:
        first = await c.client.post("/v1/chat/completions", json=chat_body(PROMPT, max_tokens=2))
        assert first.status_code == 200, first.text
        await wait_until(partial(_mirrored, agent, keys))
        await wait_until(
            lambda: (
                keys
                <= {int(k) for k in pool.tier_keys(KvMedium.HOST)}
                | {int(k) for k in pool.cached_keys()}
            )
        )
        # 3 x 62 blocks of other prompts straight to the engine: the GPU holds 128.
        async with httpx.AsyncClient(base_url=engine.url) as http:
            for n in range(3):
                ids = [10 + n, *((i * 7 + n) % 1900 + 10 for i in range(999))]
                body = {"model": MODEL, "prompt": ids, "max_tokens": 1}
                assert (await http.post("/v1/completions", json=body)).status_code == 200

        def moved_to_host() -> bool:
            host = {int(k) for k in pool.tier_keys(KvMedium.HOST)}
            return keys <= host and not keys & {int(k) for k in pool.cached_keys()}

        await wait_until(moved_to_host)
        agent.service.refresh_metrics()
        registry = agent.service.metrics.registry
        host_blocks = registry.get_sample_value("node_agent_tier_blocks", {"medium": "host"})
        assert host_blocks is not None
        assert host_blocks >= len(keys)
        shadow = c.state.dispatcher.lower_tiers
        ordered = [BlockKey(k) for k in sorted(keys, key=_prompt_order)]
        node = NodeId(agent.address)

        # The shadow applies the moves as their events arrive: wait for all of them (seen in
        # CI: the node showed 7 of the 10 host blocks when only its presence was awaited).
        def all_on_host() -> bool:
            hit = shadow.hits(ordered, {node: len(ordered)}).get(node)
            return hit is not None and hit.host_blocks == len(ordered)

        await wait_until(all_on_host)
        assert shadow.hits(ordered, {node: len(ordered)})[node].host_blocks == len(ordered)
        hits_before = _engine_state(engine).runner.scheduler.prefix_cache_hits
        again = await c.client.post("/v1/chat/completions", json=chat_body(PROMPT, max_tokens=2))
        assert again.status_code == 200, again.text
        cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= len(keys) * BLOCK_SIZE  # loaded from host memory, not computed
        assert _engine_state(engine).runner.scheduler.prefix_cache_hits == hits_before
        await wait_until(partial(_mirrored, agent, keys))  # back on the GPU
    assert_no_locks(agent)


def _prompt_order(key: int) -> int:
    ids = TOKENIZER.chat_token_ids([{"role": "user", "content": PROMPT}])
    order = compute_block_keys(ids, tenant=TENANT, model=MODEL, block_size=BLOCK_SIZE)
    return [int(k) for k in order].index(key)


async def test_a_vllm_node_answers_breakpoints_unsupported_and_serves(
    start_node: StartNode, conductor: ConductorFactory
) -> None:
    """vLLM evicts from its own cache: the agent cannot promise a retention, so it says
    so (the request is served with vLLM's automatic caching)."""
    agent, _engine = await start_node("both", "none")
    async with conductor([agent], prompt_cache_min_tokens=32) as c:
        body = chat_body(PROMPT, max_tokens=2)
        body["messages"][-1]["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
        r = await c.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_cache"] == {
            "retention": "unsupported",
            "cache_write_tokens": 0,
            "cache_read_tokens": usage["prompt_tokens_details"]["cached_tokens"],
        }
    assert agent.service.pool.stats().retained_blocks == 0
    registry = agent.service.metrics.registry
    assert registry.get_sample_value("node_agent_retentions_total", {"outcome": "unsupported"}) == 1
    assert_no_locks(agent)


def _stub(agent: AgentServer) -> tuple[grpc.aio.Channel, pb_grpc.NodeAgentAsyncStub]:
    channel = grpc.aio.insecure_channel(agent.address)
    return channel, pb_grpc.NodeAgentStub(channel)


# Five whole blocks of a shared prefix, then a tail of the puller's own.
SHARED_IDS = [(7 * i + 11) % 1900 + 10 for i in range(5 * BLOCK_SIZE)]
PULL_PROMPT = [*SHARED_IDS, *range(40, 61)]


async def _seed(agent: AgentServer, engine: SimEngineServer, ids: list[int]) -> list[BlockKey]:
    """Cache ``ids`` in the engine under the tenant's salt; wait for the agent's mirror."""
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "cache_salt": salt_for_tenant(TENANT)}
    async with httpx.AsyncClient(base_url=engine.url) as http:
        assert (await http.post("/v1/completions", json=body)).status_code == 200
    keys = compute_block_keys(ids[:-1], tenant=TENANT, model=MODEL, block_size=BLOCK_SIZE)
    await wait_until(partial(_mirrored, agent, {int(k) for k in keys}))
    return keys


async def test_a_prefix_moves_between_vllm_nodes_through_kv_transfer_params(
    start_node: StartNode,
) -> None:
    """The conductor's choreography for hot-spot replication, on two prefill vLLM nodes:
    the puller allocates the whole prompt, the holder locks the shared prefix, the puller's
    ``PullBlocks`` has the holder's engine lend it (a prefill leg of the prefix) and its
    own engine load it (a decode leg of one token); the puller's prefill then finds the
    prefix in its engine's cache instead of computing it."""
    holder, h_engine = await start_node("prefill", "nixl", vllm_prefix_pulls=True)
    puller, p_engine = await start_node("prefill", "nixl", vllm_prefix_pulls=True)
    assert holder.service.node_info.kv_migration
    assert puller.service.node_info.kv_migration
    # Its lend is a request to the engine, first come first served (no leg priority).
    assert holder.service.node_info.lend_wait == pb.LEND_WAIT_QUEUE
    await _seed(holder, h_engine, [*SHARED_IDS, 7])
    keys = compute_block_keys(PULL_PROMPT[:-1], tenant=TENANT, model=MODEL, block_size=BLOCK_SIZE)
    h_channel, h_stub = _stub(holder)
    p_channel, p_stub = _stub(puller)
    try:
        alloc = await p_stub.TxAllocate(
            pb.TxAllocateRequest(
                key_layout=KEY_LAYOUT, tx_id="p", tenant=TENANT, block_keys=keys, lease_s=30
            )
        )
        assert alloc.reused_blocks == 0
        lock = await h_stub.TxAllocate(
            pb.TxAllocateRequest(key_layout=KEY_LAYOUT,
                tx_id="s", tenant=TENANT, block_keys=keys[:5], lease_s=30,
                mode=pb.TX_MODE_LOCK_ONLY, grantee=puller.service.node_info.node_id,
            )
        )  # fmt: skip
        assert lock.reused_blocks == 5
        pull = pb.PullBlocksRequest(
            tx_id="p", source_address=holder.address, source_tx_id="s",
            source_read_token=lock.read_token, num_blocks=5,
            prompt_token_ids=PULL_PROMPT[: 5 * BLOCK_SIZE],
        )  # fmt: skip
        # Tokens that are not the Tx's blocks, or no read token: refused, nothing moved.
        wrong = pb.PullBlocksRequest()
        wrong.CopyFrom(pull)
        wrong.prompt_token_ids[0] += 1
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await p_stub.PullBlocks(wrong)
        assert exc.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        no_token = pb.PullBlocksRequest()
        no_token.CopyFrom(pull)
        no_token.source_read_token = "forged"
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await p_stub.PullBlocks(no_token)
        assert "no read grant" in (exc.value.details() or "")
        assert _engine_state(p_engine).puller.pulls == 0

        pulled = await p_stub.PullBlocks(pull)
        assert pulled.blocks_copied == 5
        assert pulled.bytes == 5 * BLOCK_SIZE * 2048  # tiny-llama: 2 KiB of KV per token
        assert pulled.transfer_s > 0
        assert _engine_state(p_engine).puller.pulls == 1
        assert _engine_state(h_engine).runner.scheduler.held == {}  # the pull released them
        await h_stub.TxCommit(pb.TxCommitRequest(tx_id="s"))

        hits_before = _engine_state(p_engine).runner.scheduler.prefix_cache_hits
        pre = await p_stub.Prefill(
            pb.PrefillRequest(
                request_id="r1", tenant=TENANT, tx_id="p", prompt_token_ids=PULL_PROMPT
            )
        )
        assert pre.cached_tokens == 5 * BLOCK_SIZE  # found in the engine's cache
        hits = _engine_state(p_engine).runner.scheduler.prefix_cache_hits - hits_before
        assert hits == 5 * BLOCK_SIZE
        await p_stub.TxCommit(pb.TxCommitRequest(tx_id="p"))
    finally:
        await h_channel.close()
        await p_channel.close()
    # The request's prefill leg holds its KV for a decode engine, nothing else is held.
    assert len(_engine_state(p_engine).runner.scheduler.held) == 1
    assert_no_locks(holder, puller)


async def test_a_vllm_node_without_prefix_pulls_neither_lends_nor_pulls(
    start_node: StartNode,
) -> None:
    holder, h_engine = await start_node("prefill", "nixl")  # pulls are opt-in
    colocated, _ = await start_node("both", "none")
    assert not holder.service.node_info.kv_migration
    assert not colocated.service.node_info.kv_migration
    assert holder.service.node_info.lend_wait == pb.LEND_WAIT_NONE
    await _seed(holder, h_engine, [*SHARED_IDS, 7])
    keys = compute_block_keys(SHARED_IDS, tenant=TENANT, model=MODEL, block_size=BLOCK_SIZE)
    channel, stub = _stub(holder)
    try:
        lock = await stub.TxAllocate(
            pb.TxAllocateRequest(
                key_layout=KEY_LAYOUT,
                tx_id="s",
                tenant=TENANT,
                block_keys=keys,
                lease_s=30,
                mode=pb.TX_MODE_LOCK_ONLY,
            )
        )
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.LendBlocks(
                pb.LendBlocksRequest(
                    tx_id="s", tenant=TENANT, read_token=lock.read_token,
                    prompt_token_ids=SHARED_IDS, request_id="r",
                )
            )  # fmt: skip
        assert exc.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "does not lend prefixes" in (exc.value.details() or "")
        await stub.TxAbort(pb.TxAbortRequest(tx_id="s"))
    finally:
        await channel.close()
    assert _engine_state(h_engine).runner.scheduler.held == {}
    assert_no_locks(holder, colocated)


async def test_the_conductor_replicates_a_hot_prefix_between_vllm_nodes(
    start_node: StartNode, conductor: ConductorFactory
) -> None:
    """Through the conductor: a prefix cached on one prefill node, a prior that makes
    prefill expensive (queueing on the holder costs more than a pull, Algorithm 1 lines
    5-8), concurrent requests: the idle prefill node pulls the prefix from the holder
    through vLLM's protocol, and every request is served from cached KV. The legs go
    first (priority scheduling): a lend waits only for the prefill running on the holder,
    not for its whole queue, which is what makes the pull pay."""
    legs_first: dict[str, Any] = {
        "scheduling_policy": "priority", "vllm_prefix_pulls": True,
        "vllm_prefix_pull_priority": -1,
    }  # fmt: skip
    holder, _ = await start_node("prefill", "nixl", **legs_first)
    puller, p_engine = await start_node("prefill", "nixl", **legs_first)
    assert holder.service.node_info.lend_wait == pb.LEND_WAIT_RUNNING
    decode, _ = await start_node("decode", "nixl")
    system = " ".join(f"rule{i}" for i in range(80))

    def body(question: str) -> dict[str, object]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return chat_body(messages=messages, max_tokens=3)

    async with conductor([holder, decode]) as c:
        r = await c.client.post("/v1/chat/completions", json=body("hello"))
        assert r.status_code == 200, r.text
    shared = len(TOKENIZER.chat_token_ids([{"role": "system", "content": system}])) // BLOCK_SIZE
    assert shared >= 8
    slow = {"prefill_prior_per_token_s": 0.01, "kvcache_balancing_threshold": 2.0}
    async with conductor([holder, puller, decode], placement_headers=True, **slow) as c:
        node = NodeId(holder.address)
        await wait_until(lambda: c.state.index.node_key_count(node) >= shared)
        responses = await asyncio.gather(
            *(c.client.post("/v1/chat/completions", json=body(f"question {i}?")) for i in range(4))
        )
        # At least one ran on the node that pulled the prefix, and was served from it.
        assert puller.address in {r.headers.get("x-kvc-prefill-node") for r in responses}
        for r in responses:
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= (
                (shared - 1) * BLOCK_SIZE
            )
        metrics = (await c.client.get("/metrics")).text
        assert metric_value(metrics, "conductor_kv_migrations_total") >= 1
        await wait_until(lambda: c.state.index.node_key_count(NodeId(puller.address)) >= shared)
    assert _engine_state(p_engine).puller.pulls >= 1
    assert _engine_state(p_engine).puller.failures == 0
    assert_no_locks(holder, puller, decode)


class LendNeverAnswers(GrpcKvTransport):
    """A KV transport whose ``LendBlocks`` calls hang (a holder stuck behind its queue)."""

    def __init__(self) -> None:
        super().__init__()
        self.lends = 0

    async def lend(
        self, address: str, request: pb.LendBlocksRequest, *, timeout_s: float | None = None
    ) -> pb.LendBlocksResponse:
        self.lends += 1
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_a_prefix_pull_gives_up_in_time_for_the_prefill(start_node: StartNode) -> None:
    """A pull that has not finished within half of what its Tx's lease had left is given
    up (UNAVAILABLE, reason transfer): the Tx is still open and the prefill computes."""
    stuck = LendNeverAnswers()
    holder, h_engine = await start_node("prefill", "nixl", vllm_prefix_pulls=True)
    puller, _ = await start_node("prefill", "nixl", transport=stuck, vllm_prefix_pulls=True)
    await _seed(holder, h_engine, [*SHARED_IDS, 7])
    keys = compute_block_keys(PULL_PROMPT[:-1], tenant=TENANT, model=MODEL, block_size=BLOCK_SIZE)
    h_channel, h_stub = _stub(holder)
    p_channel, p_stub = _stub(puller)
    try:
        await p_stub.TxAllocate(
            pb.TxAllocateRequest(
                key_layout=KEY_LAYOUT, tx_id="p", tenant=TENANT, block_keys=keys, lease_s=1.0
            )
        )
        lock = await h_stub.TxAllocate(
            pb.TxAllocateRequest(key_layout=KEY_LAYOUT,
                tx_id="s", tenant=TENANT, block_keys=keys[:5], lease_s=30,
                mode=pb.TX_MODE_LOCK_ONLY,
            )
        )  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await p_stub.PullBlocks(
                pb.PullBlocksRequest(
                    tx_id="p", source_address=holder.address, source_tx_id="s",
                    source_read_token=lock.read_token, num_blocks=5,
                    prompt_token_ids=PULL_PROMPT[: 5 * BLOCK_SIZE],
                )
            )  # fmt: skip
        assert exc.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "half of what the transaction's lease had left" in (exc.value.details() or "")
        assert stuck.lends == 1
        await h_stub.TxCommit(pb.TxCommitRequest(tx_id="s"))
        pre = await p_stub.Prefill(
            pb.PrefillRequest(
                request_id="r1", tenant=TENANT, tx_id="p", prompt_token_ids=PULL_PROMPT
            )
        )
        assert pre.cached_tokens == 0  # computed
        await p_stub.TxCommit(pb.TxCommitRequest(tx_id="p"))
    finally:
        await h_channel.close()
        await p_channel.close()
    assert_no_locks(holder, puller)
