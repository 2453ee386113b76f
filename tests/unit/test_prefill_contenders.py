"""Ranked by TTFT, the prefill stage builds candidates only for the nodes that may win
(``PrefixPlanner.contenders``): its first candidate must be the one ranking every node
puts first, whatever the fleet's queues, prefixes, learned models and affinity."""

from __future__ import annotations

from dataclasses import replace
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.core import policies
from conductor.core.policies import Policy
from conductor.core.prefix_index import NodeId
from conductor.core.scheduler import (
    NodeState,
    Placement,
    Scheduler,
    ScheduleRequest,
    Slo,
    _with_affinity,
)
from conductor.core.tier_index import TierHits
from kvc.priors import PrefillPrior
from tests.scheduling_helpers import make_node, round_number_config

NOW = 100.0
RANKED_BY_TTFT = (Policy.KV_CENTRIC, Policy.KV_ADAPTIVE, Policy.LOCAL_PREFIX)


@st.composite
def situations(draw: st.DrawFn) -> tuple[Scheduler, list[NodeState], ScheduleRequest]:
    policy = draw(st.sampled_from(RANKED_BY_TTFT))
    s = Scheduler(
        round_number_config(
            policy=policy,
            priors_measured=draw(st.booleans()),
            kvcache_balancing_threshold=draw(st.sampled_from([1.0, 2.0, 4.0])),
            min_migration_blocks=draw(st.integers(1, 4)),
            transfer_bandwidth_bytes_per_s=draw(st.sampled_from([1e7, 1e9, 1e11])),
            transfer_latency_s=draw(st.sampled_from([0.0, 0.002])),
        )
    )
    prompt = draw(st.integers(1, 4000))
    nodes = []
    prefix: dict[NodeId, int] = {}
    pending: dict[NodeId, int] = {}
    tiers: dict[NodeId, TierHits] = {}
    for i in range(draw(st.integers(1, 12))):
        block_size = draw(st.sampled_from([16, 32]))
        n = make_node(
            f"p{i:02d}",
            draw(st.sampled_from(["prefill", "both"])),
            block_size=block_size,
            kv_bytes_per_token=1000,
            queued_prefill_tokens=draw(st.integers(0, 20_000)),
            kv_family=draw(st.sampled_from(["", "vllm"])),
            kv_migration=draw(st.booleans()),
            lend_wait=draw(st.sampled_from(["none", "queue", "running"])),
        )
        nodes.append(n)
        blocks = prompt // block_size
        if draw(st.booleans()):
            prefix[n.node_id] = draw(st.integers(0, blocks))
        if draw(st.booleans()):
            pending[n.node_id] = draw(st.integers(0, blocks))
        if prefix.get(n.node_id, 0) and draw(st.booleans()):
            held = prefix[n.node_id]
            host = draw(st.integers(0, held))
            tiers[n.node_id] = TierHits(host, draw(st.integers(0, held - host)))
        if draw(st.booleans()):  # a calibrated engine of its own
            s.set_measured_priors(
                n.node_id,
                PrefillPrior(
                    fixed_s=draw(st.sampled_from([0.0, 0.01])),
                    per_token_s=draw(st.sampled_from([1e-4, 1e-3, 5e-3])),
                    per_token_context_s=draw(st.sampled_from([0.0, 1e-7])),
                ),
                None,
            )
        # What the node's engine has been seen to take: fast, slow, erratic.
        for k in range(draw(st.integers(0, 12))):
            total = draw(st.integers(1, 8000))
            cached = draw(st.integers(0, total))
            scale = draw(st.sampled_from([0.05, 0.5, 1.0, 3.0, 20.0]))
            duration = s.prefill_model(n.node_id).estimate(total, cached) * scale
            s.on_prefill_done(f"seen{k}", n.node_id, total, cached, duration, NOW - 1)
    # Work of ours queued on some nodes (pending prefills and booked lends).
    decode = make_node("d", "decode", block_size=16, kv_bytes_per_token=1000)
    for k in range(draw(st.integers(0, 6))):
        queued = ScheduleRequest(
            request_id=f"q{k}",
            prompt_tokens=draw(st.integers(1, 4000)),
            prefix_blocks={},
            max_new_tokens=8,
            slo=Slo(ttft_s=1e9, tbt_s=1e9),
        )
        placed = s.schedule(queued, [*nodes, decode], NOW - 1)
        if isinstance(placed, Placement):
            target = draw(st.sampled_from(nodes)).node_id
            s.on_assigned(queued, replace(placed, prefill=target), NOW - 1)
    affinity = None
    if draw(st.booleans()):
        affinity = draw(st.sampled_from([*(n.node_id for n in nodes), NodeId("gone")]))
    req = ScheduleRequest(
        request_id="r",
        prompt_tokens=prompt,
        prefix_blocks=prefix,
        max_new_tokens=8,
        slo=Slo(ttft_s=30.0, tbt_s=1.0),
        pending_blocks=pending,
        tier_blocks=tiers,
        affinity=affinity,
        affinity_slack_s=draw(st.sampled_from([0.0, 0.01, 1.0])),
    )
    return s, nodes, req


@pytest.mark.parametrize("vector_min", [0, 10**9], ids=["arrays", "per-node"])
@settings(max_examples=300, deadline=None)
@given(situation=situations())
def test_the_contenders_first_is_the_full_rankings_first(
    vector_min: int, situation: tuple[Scheduler, list[NodeState], ScheduleRequest]
) -> None:
    """Whether the bounds are taken over arrays or node by node (``VECTOR_MIN_NODES``)."""
    s, nodes, req = situation
    policy = s.policy
    s._decision_now_s = NOW
    full = policy.prefill_ranker.rank(policy.prefix.candidates(req, nodes, s))
    with patch.object(policies, "VECTOR_MIN_NODES", vector_min):
        fast = policy.order_prefill(req, nodes, s)
    assert fast[0] == full[0]
    assert all(c in full for c in fast)
    if req.affinity is not None:
        slack = req.affinity_slack_s
        assert (
            _with_affinity(fast, req.affinity, slack)[0]
            == _with_affinity(full, req.affinity, slack)[0]
        )


@pytest.mark.parametrize("vector_min", [0, 10**9], ids=["arrays", "per-node"])
def test_nodes_that_cannot_win_get_no_candidate(vector_min: int) -> None:
    """One holder of the whole prefix on an idle node; 99 others behind long queues:
    only the holder and the idle nodes' bounds reach the best TTFT."""
    s = Scheduler(round_number_config(policy=Policy.KV_CENTRIC))
    holder = make_node("h", block_size=32, kv_bytes_per_token=1000)
    busy = [
        make_node(f"b{i:02d}", block_size=32, kv_bytes_per_token=1000, queued_prefill_tokens=10**5)
        for i in range(99)
    ]
    req = ScheduleRequest(
        request_id="r",
        prompt_tokens=32 * 64 + 1,
        prefix_blocks={NodeId("h"): 64},
        max_new_tokens=8,
        slo=Slo(ttft_s=30.0, tbt_s=1.0),
    )
    s._decision_now_s = NOW
    with patch.object(policies, "VECTOR_MIN_NODES", vector_min):
        contenders = s.policy.order_prefill(req, [*busy, holder], s)
    assert [c.node.node_id for c in contenders] == ["h"]
    full = s.policy.prefill_ranker.rank(s.policy.prefix.candidates(req, [*busy, holder], s))
    assert len(full) == 100
    assert full[0] == contenders[0]
