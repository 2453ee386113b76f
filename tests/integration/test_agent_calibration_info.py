"""An agent started with calibration reports its engine's fitted profile in GetInfo,
leaves its pool untouched, and one started without reports none."""

from __future__ import annotations

import time

import grpc

from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from node_agent.server import AgentServer
from tests.conftest import AgentFactory


async def _info(agent: AgentServer) -> tuple[pb.NodeInfo, pb.SnapshotResponse]:
    async with grpc.aio.insecure_channel(agent.address) as channel:
        stub = pb_grpc.NodeAgentStub(channel)
        return await stub.GetInfo(pb.GetInfoRequest()), await stub.Snapshot(pb.SnapshotRequest())


async def test_a_calibrated_agent_reports_its_profile(start_agent: AgentFactory) -> None:
    started = time.perf_counter()
    agent = await start_agent("both", calibrate=True, calibration_budget_s=5.0)
    start_s = time.perf_counter() - started
    info, snapshot = await _info(agent)
    assert info.HasField("calibration")
    cal = info.calibration
    assert cal.prefill_samples >= 4
    assert cal.decode_samples >= 2
    # The budget's timeout cancels the probe running at the deadline; the cancellation
    # reaches it one event-loop turn later (CI measured 5.001 s on a loaded machine).
    assert 0 < cal.duration_s <= 5.0 + 0.25
    assert start_s >= cal.duration_s  # measured before the agent served
    assert cal.prefill_per_token_s > 0 or cal.prefill_per_token_context_s > 0
    assert cal.decode_fixed_s > 0 or cal.decode_per_request_s > 0
    assert info.max_running_requests == 16
    # Nothing of the calibration is in the pool, the snapshot or the event stream.
    assert list(snapshot.cached_keys) == []
    assert snapshot.load.free_blocks == info.capacity_blocks
    stats = agent.service.pool.stats()
    assert (stats.cached_blocks, stats.allocated_blocks) == (0, 0)
    assert snapshot.load.running_requests == 0


async def test_an_agent_without_calibration_reports_none(start_agent: AgentFactory) -> None:
    agent = await start_agent("both", calibrate=False)
    info, _ = await _info(agent)
    assert not info.HasField("calibration")
