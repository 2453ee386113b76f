"""Per-node columns kept between decisions (``conductor/core/node_columns.py``).

A row must always hold what the scheduler's per-node code computes now, whatever
changed since it was computed: the node's state (a new report), the scheduler's books
(assignments, prefills ending, pulls, decodes finishing) or the node's cost models
(observations, measured priors, also asked of the models directly). And a decision over
the columns must be the decision the per-node code makes.
"""

from __future__ import annotations

import random
from dataclasses import replace
from unittest.mock import patch

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.core import policies
from conductor.core.placement import FailureKind, PlacementLoop
from conductor.core.policies import Policy
from conductor.core.prefix_index import NodeId
from conductor.core.scheduler import (
    NodeState,
    Placement,
    Rejection,
    Scheduler,
    ScheduleRequest,
    Slo,
)
from conductor.core.tier_index import TierHits
from conductor.core.transfer_model import TransferModel
from kvc.block_keys import BlockKey
from kvc.priors import DecodePrior, PrefillPrior
from tests.scheduling_helpers import make_node, round_number_config

NOW = 100.0


def _fleet(count: int, rng: random.Random) -> list[NodeState]:
    roles = ("prefill", "decode", "both")
    return [
        make_node(
            f"n{i:03d}",
            roles[rng.randrange(3)],
            block_size=16,
            kv_bytes_per_token=1000,
            queued_prefill_tokens=rng.choice([0, 100, 5000]),
            running_requests=rng.choice([0, 1, 8]),
            max_running_requests=rng.choice([0, 0, 4]),
            kv_family=rng.choice(["embedded", "vllm"]),
            lend_wait=rng.choice(["none", "none", "queue", "running"]),
            tier_read_bytes_per_s=rng.choice([(0.0, 0.0), (1e9, 1e8)]),
        )
        for i in range(count)
    ]


def _report(node: NodeState, rng: random.Random) -> NodeState:
    """A new state of ``node``, as a load report makes."""
    return replace(
        node,
        healthy=rng.random() > 0.1,
        queued_prefill_tokens=rng.choice([0, 100, 5000, 40_000]),
        running_requests=rng.choice([0, 1, 8, 70]),
        free_blocks=rng.choice([5, 10_000]),
        allocatable_blocks=rng.choice([None, 20, 10_000]),
        kv_migration=rng.random() > 0.2,
    )


def _request(i: int, nodes: list[NodeState], rng: random.Random) -> ScheduleRequest:
    some = len(nodes) + 1
    pool = nodes[:3] if rng.random() < 0.5 else nodes  # a few nodes hold prefixes most often
    held = {n.node_id: rng.randrange(1, 40) for n in rng.sample(pool, rng.randrange(min(4, some)))}
    pending = {
        n.node_id: rng.randrange(1, 50) for n in rng.sample(nodes, rng.randrange(min(3, some)))
    }
    # Lower-tier blocks in some holders' prefixes, and now and then an affinity hint.
    tiers = {n: TierHits(rng.randrange(held[n] + 1), 0) for n in held if rng.random() < 0.5}
    affinity = rng.choice(nodes).node_id if nodes and rng.random() < 0.3 else None
    return ScheduleRequest(
        request_id=f"r{i}",
        prompt_tokens=rng.choice([200, 640, 4000]),
        prefix_blocks=held,
        pending_blocks=pending,
        tier_blocks=tiers,
        affinity=affinity,
        affinity_slack_s=rng.choice([0.0, 0.05]),
        max_new_tokens=rng.choice([8, 64]),
        slo=Slo(ttft_s=rng.choice([0.5, 30.0]), tbt_s=rng.choice([0.02, 1.0])),
        length_key=("m", "t"),
    )


def _rows_match_the_per_node_code(s: Scheduler, nodes: list[NodeState]) -> None:
    columns = s.columns(nodes)
    for i, n in enumerate(nodes):
        row = columns.data[i]
        assert bool(columns.can_prefill[i]) == n.can_prefill
        assert bool(columns.can_decode[i]) == n.can_decode
        assert columns.room_tokens[i] == n.room_blocks * n.block_size
        assert columns.running[i] == n.running_requests
        assert columns.max_running[i] == n.max_running_requests
        assert bool(columns.kv_migration[i]) == n.kv_migration
        assert columns.family[i] == columns.code(n.kv_family)
        if n.can_prefill:
            assert columns.queue_s[i] == s.queue_s(n)
            assert tuple(columns.prefill_terms[i]) == s.prefill_model(n.node_id).floor_row()
        if n.can_decode:
            assert columns.placed[i] == len(s._book(n.node_id).decodes)
            assert columns.step_s[i] == s.reported_step_s(n)
            assert tuple(columns.decode_terms[i]) == s.decode_model(n.node_id).floor_row()
        assert len(row) == columns.data.shape[1]


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    policy=st.sampled_from([Policy.KV_CENTRIC, Policy.KV_ADAPTIVE, Policy.LOCAL_PREFIX]),
    count=st.integers(1, 40),
    vector_min=st.sampled_from([0, 8]),
)
def test_decisions_over_the_columns_are_the_per_node_decisions(
    seed: int, policy: Policy, count: int, vector_min: int
) -> None:
    """Twin schedulers fed the same events: one decides over the columns (every list is
    'large' at ``vector_min`` 0; at 8, fleets under 16 nodes look up the columns of the
    stages that have 8 or more), the other node by node; their decisions and their
    columns agree."""
    rng = random.Random(seed)
    config = round_number_config(
        policy=policy,
        priors_measured=rng.random() > 0.5,
        # At 1 MB/s a pull costs about what a prefill does, so learned links decide.
        transfer_bandwidth_bytes_per_s=rng.choice([1e9, 1e6]),
    )
    columnar, per_node = Scheduler(config), Scheduler(config)
    twins = (columnar, per_node)
    nodes = _fleet(count, rng)
    open_requests: list[tuple[str, Placement]] = []
    for step in range(40):
        action = rng.randrange(8)
        if action == 0:  # load reports
            for _ in range(rng.randrange(1, 4)):
                i = rng.randrange(len(nodes))
                nodes[i] = _report(nodes[i], rng)
        elif action == 1 and open_requests:  # a prefill ends, observed or failed (None)
            rid, placed = open_requests[rng.randrange(len(open_requests))]
            seconds: float | None = max(1e-6, placed.prefill_s * rng.uniform(0.3, 3.0))
            if rng.random() < 0.4:
                seconds = None
            for s in twins:
                s.on_prefill_done(rid, placed.prefill, 4000, 0, seconds, NOW + step)
        elif action == 2 and open_requests:  # a request ends
            rid, placed = open_requests.pop(rng.randrange(len(open_requests)))
            for s in twins:
                s.on_decode_started(rid, placed.decode, NOW + step)
                s.observe_decode(rid, placed.decode, placed.tbt_s * 1.5, NOW + step + 1)
                s.on_finished(rid, placed.prefill, placed.decode, output_tokens=9,
                              stopped=True, now_s=NOW + step + 1)  # fmt: skip
                if placed.migration is not None:
                    s.on_pulled(rid, placed.migration.source)
        elif action == 3:  # one model asked directly, or measured priors
            node = rng.choice(nodes).node_id
            which = rng.randrange(3)
            for s in twins:
                if which == 0:
                    s.prefill_model(node).observe(1000, 0, 0.7)
                elif which == 1:
                    s.decode_model(node).observe(4.0, 1000.0, 0.05)
                else:
                    s.set_measured_priors(
                        node, PrefillPrior(0.0, 0.002, 0.0), DecodePrior(0.02, 0.01, 0.0)
                    )
        elif action == 4:  # links learned from a node, fast or slow
            src = rng.choice(nodes[:3])  # the nodes that hold prefixes most often
            for dst in rng.sample(nodes, min(len(nodes), 6)):
                seconds = rng.choice([1e-4, 0.05, 5.0])
                for s in twins:
                    s.transfer.observe(src.node_id, dst.node_id, 10**6, seconds)
        else:  # a decision
            req = _request(step, nodes, rng)
            at = NOW + step
            with patch.object(policies, "VECTOR_MIN_NODES", vector_min):
                got = columnar.schedule(req, list(nodes), at)
            with patch.object(policies, "VECTOR_MIN_NODES", 10**9):
                want = per_node.schedule(req, list(nodes), at)
            assert got == want
            if isinstance(got, Placement):
                for s in twins:
                    s.on_assigned(req, got, at)
                open_requests.append((req.request_id, got))
            else:
                assert isinstance(got, Rejection)
        _rows_match_the_per_node_code(columnar, nodes)


def test_a_state_replaced_in_the_same_list_is_seen() -> None:
    """The caller may renew a state in place in the list it passes every decision."""
    s = Scheduler(round_number_config(policy=Policy.KV_CENTRIC))
    nodes = _fleet(12, random.Random(1))
    s.schedule(_request(0, nodes, random.Random(2)), nodes, NOW)
    nodes[3] = replace(nodes[3], queued_prefill_tokens=nodes[3].queued_prefill_tokens + 777)
    nodes[5] = replace(nodes[5], healthy=False)
    with patch.object(policies, "VECTOR_MIN_NODES", 0):
        s.schedule(_request(1, nodes, random.Random(3)), nodes, NOW)
    _rows_match_the_per_node_code(s, nodes)


def test_other_lists_and_a_changing_fleet_keep_rows_right() -> None:
    s = Scheduler(round_number_config(policy=Policy.KV_CENTRIC))
    rng = random.Random(4)
    nodes = _fleet(10, rng)
    with patch.object(policies, "VECTOR_MIN_NODES", 0):
        s.schedule(_request(0, nodes, rng), nodes, NOW)
        # A list with another state object for a node, asked outside any decision.
        other = [replace(nodes[2], running_requests=99), nodes[4]]
        assert s.columns(other).running.tolist() == [99, nodes[4].running_requests]
        s.schedule(_request(1, nodes, rng), nodes, NOW)  # the fleet's own state again
        _rows_match_the_per_node_code(s, nodes)
        # Nodes leave and join: many times more than the fleet, so the table restarts.
        for k in range(30):
            nodes = _fleet(3, random.Random(k))
            nodes = [replace(n, node_id=NodeId(f"g{k}-{n.node_id}")) for n in nodes]
            s.schedule(_request(k, nodes, rng), nodes, NOW)
            _rows_match_the_per_node_code(s, nodes)
    assert len(s._table.row_of) <= 2 * 3 + 64 + 3  # a fleet's worth past the limit at most


def test_of_reads_a_mapping_per_node_of_the_list() -> None:
    s = Scheduler(round_number_config(policy=Policy.KV_CENTRIC))
    nodes = _fleet(5, random.Random(5))
    columns = s.columns(nodes[1:4])
    values = {nodes[0].node_id: 7, nodes[2].node_id: 3, NodeId("stranger"): 9}
    assert columns.of(values).tolist() == [0, 3, 0]
    assert columns.of({}).tolist() == [0, 0, 0]
    assert Scheduler(round_number_config()).columns([]).of(values).tolist() == []
    assert columns.position_of(nodes[3].node_id) == 2
    assert columns.position_of(nodes[0].node_id) == -1
    picked, sub = columns.pick(nodes[1:4], np.array([True, False, True]))
    assert picked == [nodes[1], nodes[3]]
    assert s.columns(picked) is sub


def test_transfer_fits_from_a_source_follow_its_links() -> None:
    model = TransferModel(default_bandwidth_bytes_per_s=1e9, default_latency_s=0.002, max_pairs=2)
    a, b, c = NodeId("a"), NodeId("b"), NodeId("c")
    assert model.fits_from(a) == []
    assert model.default_fit == (0.002, 1e-9)
    model.observe(a, b, 10**6, 0.01)
    model.observe(a, c, 10**6, 0.02)
    fits = {dst: (lat, spb) for dst, lat, spb in model.fits_from(a)}
    assert set(fits) == {b, c}
    for dst, (lat, spb) in fits.items():
        assert lat + 10**6 * spb == model.estimate(a, dst, 10**6)
    model.observe(b, a, 10**6, 0.01)  # over max_pairs: (a, b), the oldest, is dropped
    assert [dst for dst, _, _ in model.fits_from(a)] == [c]
    assert [dst for dst, _, _ in model.fits_from(b)] == [a]


def test_the_placement_loop_decides_the_same_over_columns() -> None:
    """Through the loop, with exclusions (a shorter list each retry)."""
    rng = random.Random(6)
    nodes = _fleet(30, rng)
    config = round_number_config(policy=Policy.KV_CENTRIC)
    loops = (PlacementLoop(Scheduler(config)), PlacementLoop(Scheduler(config)))
    for i in range(20):
        req = _request(i, nodes, rng)
        keys: list[BlockKey] = []
        a, b = (loop.begin(req, keys, NOW) for loop in loops)
        for attempt in range(3):
            with patch.object(policies, "VECTOR_MIN_NODES", 0):
                got = a.decide(nodes, NOW + i)
            with patch.object(policies, "VECTOR_MIN_NODES", 10**9):
                want = b.decide(nodes, NOW + i)
            assert got == want
            if not isinstance(got, Placement):
                break
            if attempt < 2:
                a.failed(got.prefill, FailureKind.BUSY)
                b.failed(got.prefill, FailureKind.BUSY)
        a.finished()
        b.finished()
        if i % 4 == 0:
            j = rng.randrange(len(nodes))
            nodes[j] = _report(nodes[j], rng)


def test_the_role_lists_follow_reports_health_and_roles() -> None:
    """``pick_role`` reuses the previous decision's lists where only states changed; they
    must still be exactly the fleet's capable nodes, in fleet order, with new states."""
    s = Scheduler(round_number_config(policy=Policy.KV_CENTRIC))
    table = s._table
    rng = random.Random(7)
    nodes = _fleet(50, rng)
    for step in range(60):
        table.begin()
        fleet = table.sync(nodes)
        for role, capable in (("prefill", NodeState.can_prefill), ("decode", NodeState.can_decode)):
            mask = fleet.can_prefill if role == "prefill" else fleet.can_decode
            picked = table.pick_role(role, fleet, mask)
            want = [n for n in nodes if capable.fget(n)]  # type: ignore[attr-defined]
            assert [n.node_id for n in picked] == [n.node_id for n in want]
            assert picked == want  # the new states (equal ones may stay the old objects)
        table.end()
        for _ in range(rng.randrange(4)):
            i = rng.randrange(len(nodes))
            if step % 7 == 0:  # a role change, not only a load report
                nodes[i] = replace(nodes[i], role=rng.choice(["prefill", "decode", "both"]))
            else:
                nodes[i] = _report(nodes[i], rng)
        if step % 11 == 0:  # an agent leaves and another joins at its place
            nodes[rng.randrange(len(nodes))] = make_node(
                f"new{step}", "both", block_size=16, kv_bytes_per_token=1000
            )


@settings(max_examples=200, deadline=None)
@given(
    count=st.integers(0, 300),
    edits=st.lists(st.tuples(st.integers(0, 299), st.sampled_from(["same", "equal", "new"]))),
)
def test_changed_finds_every_state_that_differs(count: int, edits: list[tuple[int, str]]) -> None:
    """``_changed`` (the fleet comparison in slices) reports every position whose state
    differs in value, and none whose state is the same object."""
    from conductor.core.node_columns import _changed

    before = _fleet(count, random.Random(count))
    current = list(before)
    for i, kind in edits:
        if i >= count:
            continue
        if kind == "equal":  # another object, equal in every field
            current[i] = replace(current[i])
        elif kind == "new":
            current[i] = replace(current[i], running_requests=current[i].running_requests + 1)
    got = _changed(current, before)
    assert got == sorted(set(got))
    assert {i for i in range(count) if current[i] != before[i]} <= set(got)
    assert all(current[i] is not before[i] for i in got)
