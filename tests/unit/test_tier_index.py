"""The conductor's lower-tier index and the placement loop's charge for tier hits:
which of a node's prefix blocks sit in host memory or on disk, what loading them costs,
and that a holder lends only what is in its engine memory."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.core.prefix_index import ApplyOutcome, NodeId, PrefixIndex
from conductor.core.scheduler import (
    NodeState,
    Placement,
    Rejection,
    Scheduler,
    ScheduleRequest,
    Slo,
)
from conductor.core.tier_index import (
    DEFAULT_READ_BYTES_PER_S,
    LowerTierIndex,
    Medium,
    TierHits,
    medium_of,
    reset_node_view,
    tier_load_s,
)
from kvc.block_keys import BlockKey
from tests.scheduling_helpers import make_node, round_number_config

A, B = NodeId("a"), NodeId("b")
BS = 32
KV_BYTES_PER_TOKEN = 1000
BLOCK_BYTES = BS * KV_BYTES_PER_TOKEN


def keys(*values: int) -> list[BlockKey]:
    return [BlockKey(v) for v in values]


def test_moves_between_tiers_and_hits_within_a_prefix() -> None:
    lower = LowerTierIndex()
    lower.reset_node(A, "e", 0, keys(3), keys(4))
    prompt = keys(1, 2, 3, 4, 5)
    assert lower.hits(prompt, {A: 5}) == {A: TierHits(1, 1)}
    assert lower.hits(prompt, {A: 3}) == {A: TierHits(1, 0)}  # 4 lies past A's prefix
    # 2 demoted to host, 3 pushed on to disk, 4 promoted back, 5 dropped.
    assert lower.apply(A, "e", 1, moved=(Medium.HOST, keys(2))) is ApplyOutcome.APPLIED
    assert lower.apply(A, "e", 2, moved=(Medium.DISK, keys(3))) is ApplyOutcome.APPLIED
    assert lower.apply(A, "e", 3, moved=(Medium.DEVICE, keys(4))) is ApplyOutcome.APPLIED
    assert lower.apply(A, "e", 4, removed=keys(5)) is ApplyOutcome.APPLIED
    assert lower.hits(prompt, {A: 5}) == {A: TierHits(1, 1)}
    assert lower.apply(A, "e", 6) is ApplyOutcome.RESYNC  # a gap
    assert lower.apply(A, "e", 5, cleared=True) is ApplyOutcome.APPLIED
    assert lower.hits(prompt, {A: 5}) == {}


def test_untracked_nodes_and_empty_index_cost_nothing() -> None:
    lower = LowerTierIndex()
    assert lower.empty
    assert lower.hits(keys(1), {A: 1}) == {}
    lower.reset_node(A, "e", 0, keys(1), ())
    assert lower.tracks(A)
    assert not lower.tracks(B)
    assert lower.hits(keys(1), {A: 1, B: 1}) == {A: TierHits(1, 0)}
    lower.remove_node(A)
    assert lower.empty


@settings(max_examples=80, deadline=None)
@given(
    held=st.dictionaries(
        st.sampled_from(["a", "b", "c"]), st.sets(st.integers(1, 12), max_size=8), min_size=1
    ),
    prompt=st.lists(st.integers(1, 12), min_size=1, max_size=12, unique=True),
    depth=st.integers(0, 12),
)
def test_held_within_agrees_with_counting_by_hand(
    held: dict[str, set[int]], prompt: list[int], depth: int
) -> None:
    index = PrefixIndex()
    for node, node_keys in held.items():
        index.reset_node(NodeId(node), "e", 0, keys(*node_keys))
    upto = {NodeId(node): depth for node in held}
    expected = {}
    for node, node_keys in held.items():
        inside = [i for i, k in enumerate(prompt[:depth]) if k in node_keys]
        if inside:
            expected[NodeId(node)] = len(inside)
    assert index.held_within(keys(*prompt), upto) == expected


def test_load_time_uses_each_tier_measured_bandwidth() -> None:
    hits = TierHits(host_blocks=2, disk_blocks=1)
    assert tier_load_s(hits, 1000, (1e6, 1e3)) == pytest.approx(2e-3 + 1.0)
    assert tier_load_s(hits, 1000, (0.0, 0.0)) == pytest.approx(
        2000 / DEFAULT_READ_BYTES_PER_S[0] + 1000 / DEFAULT_READ_BYTES_PER_S[1]
    )
    assert tier_load_s(None, 1000, (1.0, 1.0)) == 0.0


def node(name: str, role: str = "prefill", **kw: object) -> NodeState:
    return make_node(name, role, block_size=BS, kv_bytes_per_token=KV_BYTES_PER_TOKEN, **kw)


def request(prefix: dict[NodeId, int], tiers: dict[NodeId, TierHits]) -> ScheduleRequest:
    return ScheduleRequest(
        request_id="r",
        prompt_tokens=30 * BS + 1,
        prefix_blocks=prefix,
        max_new_tokens=10,
        slo=Slo(ttft_s=30.0, tbt_s=1.0),
        tier_blocks=tiers,
    )


def placed(decision: Placement | Rejection) -> Placement:
    assert isinstance(decision, Placement), decision
    return decision


def fleet(disk_bw: float) -> list[NodeState]:
    return [
        node("a", "both"),
        node("b", "both", tier_read_bytes_per_s=(1e10, disk_bw)),
    ]


def test_a_slow_disk_hit_loses_to_an_engine_memory_hit_of_the_same_length() -> None:
    """Both hold the 30-block prefix; b's is on a disk that takes 30 x 32 kB / 1 MB/s
    ~ 1 s to read, more than a's zero — a fixed tier discount could not tell."""
    s = Scheduler(round_number_config(policy="kv_centric"))
    req = request({A: 30, B: 30}, {B: TierHits(0, 30)})
    p = placed(s.schedule(req, fleet(1e6), 100.0))
    assert p.prefill == "a"


def test_a_fast_tier_hit_still_beats_recomputing() -> None:
    """b holds 30 blocks in host memory (load 96 us); a holds nothing (compute ~0.96 s)."""
    s = Scheduler(round_number_config(policy="kv_centric"))
    req = request({A: 0, B: 30}, {B: TierHits(30, 0)})
    p = placed(s.schedule(req, fleet(1e6), 100.0))
    assert p.prefill == "b"
    assert p.prefix_blocks == 30


def test_a_disk_hit_slower_than_recomputing_is_not_worth_it() -> None:
    """Reading 30 blocks at 100 kB/s (~9.6 s) costs more than computing them (~0.96 s)."""
    s = Scheduler(round_number_config(policy="kv_centric"))
    slow = [node("a", "both"), node("b", "both", tier_read_bytes_per_s=(1e10, 1e5))]
    req = request({A: 0, B: 30}, {B: TierHits(0, 30)})
    p = placed(s.schedule(req, slow, 100.0))
    assert p.prefill == "a"


def test_a_holder_lends_from_every_tier_and_the_pull_pays_its_load() -> None:
    """b holds 30 blocks, 20 of them in host memory, and is busy: a pulls all 30, the
    estimate paying b's load of the 20 before the wire."""
    s = Scheduler(round_number_config(policy="kv_centric"))
    busy = [
        node("a"),
        node("b", queued_prefill_tokens=50_000, tier_read_bytes_per_s=(1e8, 1e9)),
        node("d", "decode"),
    ]
    req = request({A: 0, B: 30}, {B: TierHits(20, 0)})
    p = placed(s.schedule(req, busy, 100.0))
    assert p.prefill == "a"
    assert p.migration is not None
    assert p.migration.blocks == 30
    load_s = 20 * BLOCK_BYTES / 1e8
    wire_s = 30 * BLOCK_BYTES / 1e9
    assert p.migration.transfer_s == pytest.approx(load_s + wire_s)


def test_without_tiers_nothing_changes() -> None:
    s1 = Scheduler(round_number_config(policy="kv_centric"))
    s2 = Scheduler(round_number_config(policy="kv_centric"))
    plain = [node("a", "both"), node("b", "both")]
    req = request({A: 5, B: 30}, {})
    p1 = placed(s1.schedule(req, plain, 100.0))
    p2 = placed(s2.schedule(replace(req, tier_blocks={}), plain, 100.0))
    assert (p1.prefill, p1.prefix_blocks) == (p2.prefill, p2.prefix_blocks) == ("b", 30)


def test_a_snapshot_resets_every_table_and_an_unknown_medium_is_no_error() -> None:
    index, lower = PrefixIndex(), LowerTierIndex()
    reset_node_view(
        index, lower, A, "e", 3, cached=keys(1), host=keys(2), disk=keys(3), tiered=True
    )
    assert index.match(keys(1, 2, 3)) == {A: 3}  # held in any tier
    assert lower.hits(keys(1, 2, 3), {A: 3}) == {A: TierHits(1, 1)}
    reset_node_view(index, lower, A, "e2", 0, cached=keys(1), host=(), disk=(), tiered=False)
    assert not lower.tracks(A)
    assert medium_of(1) is Medium.HOST
    assert medium_of(7) is None  # a newer agent's medium: kept as held, never a crash
