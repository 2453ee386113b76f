"""One scenario table through both drivers of the placement loop: the live conductor
(real agents over gRPC) and the simulator (real pools in virtual time). Each scenario
states its fleet and the decision it expects; both drivers must make exactly that one.

Nodes have logical names (p0, p1 prefill; d0 decode); prompts are 64 blocks of 32 tokens.
p0 always holds the prompt's first 32 blocks, so a healthy p0 with room is the choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from conductor.core.policies import Policy
from conductor.core.prefix_index import NodeId
from conductor.core.scheduler import Admission, SchedulerConfig, Slo
from conductor.errors import ConductorError
from conductor.generation import GenerationRequest
from kvc.block_keys import BlockKey, compute_block_keys
from kvc.sampling import Sampling
from kvc_sim.cluster import TENANT, Cluster
from kvc_sim.cluster_config import ClusterConfig
from kvc_sim.profile import load_profile
from kvc_sim.trace import TraceRequest
from node_agent.blocks.pool import BlockPool
from node_agent.blocks.types import AllocateParams
from node_agent.server import AgentServer
from tests.conftest import MODEL, AgentFactory, ConductorFactory, assert_no_locks, wait_until

BLOCK = 32
PROMPT_BLOCKS = 64
SEEDED_BLOCKS = 32  # on p0
SMALL_POOL = 40  # p0's pool in the capacity scenario: the prompt needs 64 blocks


@dataclass(frozen=True)
class Scenario:
    name: str
    p0: str  # "ok" | "small" | "gone" | "draining"
    d0: str  # "ok" | "warm" (pool full of evictable cached blocks)
    expect: str  # "p1>d0" (prefill>decode) or "refused:REASON"


SCENARIOS = [
    Scenario("prefix holder chosen", p0="ok", d0="ok", expect="p0>d0"),
    Scenario("capacity refusal moves to the next node", p0="small", d0="ok", expect="p1>d0"),
    Scenario("node gone", p0="gone", d0="ok", expect="p1>d0"),
    Scenario("draining", p0="draining", d0="ok", expect="p1>d0"),
    Scenario("warm decode pool has room", p0="ok", d0="warm", expect="p0>d0"),
]


# ---------------------------------------------------------------------------- live


def _seed(agent: AgentServer, keys: list[BlockKey], tx_id: str) -> None:
    pool = agent.service.pool
    pool.tx_allocate(AllocateParams(tx_id, TENANT, tuple(keys), 60.0))
    pool.tx_commit(tx_id)


async def _live(scenario: Scenario, start_agent: AgentFactory, conductor: ConductorFactory) -> str:
    p0 = await start_agent(
        "prefill", capacity_blocks=SMALL_POOL if scenario.p0 == "small" else 4096
    )
    p1 = await start_agent("prefill")
    d0 = await start_agent("decode", capacity_blocks=256)
    names = {p0.address: "p0", p1.address: "p1", d0.address: "d0"}
    prompt = tuple(10 + (i * 7) % 900 for i in range(PROMPT_BLOCKS * BLOCK + 1))
    keys = compute_block_keys(prompt[:-1], tenant=TENANT, model=MODEL, block_size=BLOCK)
    _seed(p0, keys[:SEEDED_BLOCKS], "seed")
    if scenario.d0 == "warm":  # every block cached and unlocked: nothing strictly free
        _seed(d0, [BlockKey(1_000_000 + i) for i in range(256)], "warm")
        assert d0.service.pool.stats().free_blocks == 0
    await p0.service.housekeeping_once()
    await d0.service.housekeeping_once()
    async with conductor([p0, p1, d0], policy="kv_centric", admission="none") as c:
        node = NodeId(p0.address)
        await wait_until(lambda: c.state.index.node_key_count(node) == SEEDED_BLOCKS)
        if scenario.d0 == "warm":

            def warm_reported() -> bool:
                handle = c.state.fleet.get(d0.address)
                load = None if handle is None else handle.load
                return load is not None and load.allocatable_blocks == 256

            await wait_until(warm_reported)
        if scenario.p0 == "gone":
            await p0.stop(grace_s=0.1)  # the conductor still believes it usable
        elif scenario.p0 == "draining":
            await p0.service.set_draining(True)  # the conductor has not polled since
        request = GenerationRequest(
            request_id=f"drv-{scenario.p0}-{scenario.d0}",
            tenant=TENANT,
            prompt_ids=prompt,
            sampling=Sampling(temperature=0.0, top_p=1.0, max_tokens=2, seed=None, stop=()),
            slo=Slo(ttft_s=600.0, tbt_s=10.0),
        )
        try:
            stream = await c.state.dispatcher.start(request)
        except ConductorError as exc:
            return f"refused:{exc.code}"
        async for _ in stream:
            pass
        decision = f"{names[stream.placed.prefill_node]}>{names[stream.placed.decode_node]}"
    assert_no_locks(*(a for a in (p1, d0)))
    return decision


# ---------------------------------------------------------------------------- simulated


def _sim(scenario: Scenario) -> str:
    profile = load_profile("llama3-70b-8xa800")
    config = ClusterConfig(prefill_instances=2, decode_instances=1, block_tokens=BLOCK)
    scheduler = SchedulerConfig(
        policy=Policy.KV_CENTRIC,
        admission=Admission.NONE,
        prefill_prior=profile.prefill_prior(),
        decode_prior=profile.decode_prior(),
        priors_measured=True,
    )
    trace_blocks = PROMPT_BLOCKS * BLOCK // 512
    request = TraceRequest(
        request_id="drv",
        arrival_s=0.0,
        input_tokens=PROMPT_BLOCKS * BLOCK + 1,
        output_tokens=2,
        hash_ids=tuple(range(1, trace_blocks + 2)),
    )
    cluster = Cluster(profile, config, scheduler, Slo(600.0, 10.0), [request])
    p0_id, p1_id = sorted(cluster.prefill)
    (d0_id,) = cluster.decode
    names = {p0_id: "p0", p1_id: "p1", d0_id: "d0"}
    p0 = cluster.prefill[p0_id]
    if scenario.p0 == "small":
        p0.pool = BlockPool(SMALL_POOL, cluster.loop.clock, max_lease_s=config.lease_s)
    keys = cluster.keys_of(request)
    p0.pool.tx_allocate(AllocateParams("seed", TENANT, keys[:SEEDED_BLOCKS], config.lease_s))
    p0.pool.tx_commit("seed")
    cluster._publish(p0)
    assert cluster.index.match(keys).get(p0_id) == SEEDED_BLOCKS
    if scenario.p0 in ("gone", "draining"):
        cluster.set_available(p0_id, False)
    result = cluster.run([request])
    (record,) = result.records
    if record.outcome == "rejected":
        return f"refused:{record.reject_reason}"
    assert record.prefill_node is not None
    assert record.decode_node is not None
    return f"{names[NodeId(record.prefill_node)]}>{names[NodeId(record.decode_node)]}"


# ---------------------------------------------------------------------------- the table

DRIVERS: dict[str, Callable[..., object]] = {"live": _live, "sim": _sim}


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
async def test_both_drivers_make_the_same_decision(
    scenario: Scenario, start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    simulated = await asyncio.to_thread(_sim, scenario)
    live = await _live(scenario, start_agent, conductor)
    assert (live, simulated) == (scenario.expect, scenario.expect)
