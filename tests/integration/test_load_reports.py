"""Agents report their load every ``load_interval_s``; between two reports the conductor
discounts its own work that ended since the last one, so a prefill queue or a decode
batch that is gone does not steer placements until the next report comes."""

from __future__ import annotations

from conductor.core.prefix_index import NodeId
from conductor.core.scheduler import NodeState, Slo
from conductor.generation import GenerationRequest
from kvc.sampling import Sampling
from kvc.v1 import node_agent_pb2 as pb
from node_agent.server import AgentServer
from tests.conftest import AgentFactory, ConductorFactory, assert_no_locks, wait_until


def _state(states: list[NodeState], agent: AgentServer) -> NodeState:
    (state,) = [s for s in states if s.node_id == NodeId(agent.address)]
    return state


async def test_work_that_ended_since_the_last_report_is_not_counted(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    # Reports only when the test asks for one (housekeeping_once), never on a timer.
    p = await start_agent("prefill", load_interval_s=3600.0)
    d = await start_agent("decode", load_interval_s=3600.0)
    prompt = tuple(10 + (i * 7) % 900 for i in range(200))
    async with conductor([p, d], policy="kv_centric", admission="none") as c:
        fleet = c.state.fleet
        await wait_until(lambda: all(fleet.get(a.address).load is not None for a in (p, d)))
        request = GenerationRequest(
            request_id="stale-load",
            tenant="t",
            prompt_ids=prompt,
            sampling=Sampling(temperature=0.0, top_p=1.0, max_tokens=4, seed=None, stop=()),
            slo=Slo(ttft_s=600.0, tbt_s=10.0),
        )
        stream = await c.state.dispatcher.start(request)
        # A report taken while the generation runs on the decode node...
        await d.service.housekeeping_once()
        handle = fleet.get(d.address)
        await wait_until(lambda: handle.load is not None and handle.load.running_requests == 1)
        async for _ in stream:
            pass
        # ...still counts it after it ended: the conductor does not.
        assert handle.load is not None
        assert handle.load.running_requests == 1
        assert _state(c.state.dispatcher.node_states(), d).running_requests == 0
        # The prefill node's queue lost the prompt when its Prefill returned.
        assert fleet.get(p.address).ended_prefill_tokens == len(prompt)
        # The next report starts afresh.
        await d.service.housekeeping_once()
        await wait_until(lambda: handle.load is not None and handle.load.running_requests == 0)
        assert handle.ended_generations == 0
        assert _state(c.state.dispatcher.node_states(), d).running_requests == 0
    assert_no_locks(p, d)


def test_a_stale_report_is_discounted_never_below_zero_nor_below_our_own_work() -> None:
    from conductor.adapters.agents import AgentHandle

    handle = AgentHandle(address="a", channel=None, stub=None)  # type: ignore[arg-type]
    assert (handle.queued_prefill_tokens, handle.running_requests) == (0, 0)
    handle.set_load(pb.LoadUpdate(queued_prefill_tokens=3000, running_requests=5))
    handle.ended_prefill_tokens += 1000
    handle.ended_generations += 2
    assert (handle.queued_prefill_tokens, handle.running_requests) == (2000, 3)
    handle.ended_prefill_tokens += 5000  # ours ended, others' counted only as 0
    handle.ended_generations += 9
    handle.inflight = 1
    assert (handle.queued_prefill_tokens, handle.running_requests) == (0, 1)
    handle.set_load(pb.LoadUpdate(queued_prefill_tokens=10, running_requests=4))
    assert (handle.ended_prefill_tokens, handle.ended_generations) == (0, 0)
    assert (handle.queued_prefill_tokens, handle.running_requests) == (10, 4)
