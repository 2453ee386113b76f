"""The dispatcher's fleet view (``Dispatcher.node_states``) is rebuilt per agent only when
what it is built from changed, and is then exactly what a fresh build gives."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from conductor.adapters.agents import AgentFleet
from conductor.core.prefix_index import NodeId, PrefixIndex
from conductor.core.scheduler import NodeState, Scheduler, SchedulerConfig
from conductor.dispatch import Dispatcher
from kvc.priors import PrefillPrior
from kvc.v1 import node_agent_pb2 as pb

ADDRESSES = ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")


def _info(address: str, *, fixed_s: float = 0.01, draining: bool = False) -> pb.NodeInfo:
    info = pb.NodeInfo(
        node_id=address,
        model="m",
        block_size=32,
        capacity_blocks=5_000,
        role=pb.NODE_ROLE_BOTH,
        draining=draining,
        engine="embedded",
    )
    info.calibration.prefill_fixed_s = fixed_s
    info.calibration.prefill_per_token_s = 1e-4
    info.calibration.decode_fixed_s = 0.02
    info.kv_layout.bytes_per_token = 131_072
    return info


@pytest.fixture
async def fleet() -> AsyncIterator[AgentFleet]:
    fleet = AgentFleet(ADDRESSES, model="m", rpc_timeout_s=1.0)
    for address in ADDRESSES:
        handle = fleet.add(address)
        handle.info = _info(address)
        handle.reachable = handle.compatible = True
        handle.set_load(pb.LoadUpdate(free_blocks=3_000, running_requests=2))
    yield fleet
    await fleet.aclose()


def _dispatcher(fleet: AgentFleet) -> Dispatcher:
    return Dispatcher(
        fleet,
        PrefixIndex(),
        Scheduler(SchedulerConfig()),
        model="m",
        lease_s=5.0,
        rpc_timeout_s=1.0,
        request_timeout_s=10.0,
    )


def _fresh(fleet: AgentFleet) -> list[NodeState]:
    """The view built from nothing (a new dispatcher over the same handles)."""
    return _dispatcher(fleet).node_states()


def _by_node(states: list[NodeState]) -> dict[NodeId, NodeState]:
    return {state.node_id: state for state in states}


async def test_an_unchanged_agent_keeps_its_state_and_a_changed_one_is_rebuilt(
    fleet: AgentFleet,
) -> None:
    dispatcher = _dispatcher(fleet)
    first = _by_node(dispatcher.node_states())
    again = _by_node(dispatcher.node_states())
    assert all(again[node] is first[node] for node in first)

    one, two, three = (fleet.get(address) for address in ADDRESSES)
    one.inflight = 5  # ours in flight
    two.set_load(pb.LoadUpdate(free_blocks=10, running_requests=1, queued_prefill_tokens=70))
    three.ended_generations = 1  # ours ended since the report
    changed = dispatcher.node_states()
    assert changed == _fresh(fleet)
    now = _by_node(changed)
    assert now[NodeId(one.address)].running_requests == 5
    assert now[NodeId(two.address)].free_blocks == 10
    assert now[NodeId(two.address)].queued_prefill_tokens == 70
    assert now[NodeId(three.address)].running_requests == 1

    three.ended_prefill_tokens = 3
    three.reachable = False
    assert _by_node(dispatcher.node_states())[NodeId(three.address)].healthy is False
    three.reachable = True
    three.compatible = False
    assert _by_node(dispatcher.node_states())[NodeId(three.address)].healthy is False
    three.compatible = True
    assert dispatcher.node_states() == _fresh(fleet)


async def test_a_new_node_info_is_read_again(fleet: AgentFleet) -> None:
    dispatcher = _dispatcher(fleet)
    handle = fleet.get(ADDRESSES[0])
    node = NodeId(handle.address)
    before = _by_node(dispatcher.node_states())[node]

    # The next poll's message with the same content: the same state.
    handle.info = _info(handle.address)
    assert _by_node(dispatcher.node_states())[node] is before

    # A new calibration becomes the node's prior; a draining node is not healthy.
    handle.info = _info(handle.address, fixed_s=0.5, draining=True)
    after = _by_node(dispatcher.node_states())[node]
    assert after.healthy is False
    assert dispatcher.scheduler.prefill_model(node).prior == PrefillPrior(0.5, 1e-4, 0.0)
    assert dispatcher.node_states() == _fresh(fleet)


async def test_removed_agents_leave_the_view(fleet: AgentFleet) -> None:
    dispatcher = _dispatcher(fleet)
    dispatcher.node_states()
    fleet.remove(ADDRESSES[1])
    states = dispatcher.node_states()
    assert {state.node_id for state in states} == {NodeId(ADDRESSES[0]), NodeId(ADDRESSES[2])}
    assert len(dispatcher._views) == 2
