"""Donate before evict: the pool's offer of a hot victim, a peer's acceptance, the
conductor core's choice of peer, and the simulator running the three together."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from conductor.core.prefix_index import NodeId
from kvc.block_keys import BlockKey
from kvc.donation import choose_donee
from kvc.v1 import node_agent_pb2 as pb
from node_agent.blocks.pool import BlockPool, Donation
from node_agent.blocks.types import AllocateParams, BlockRemoved, BlockStored
from node_agent.donation import Donations
from node_agent.engines.embedded.kv_tensors import TensorKvCodec
from node_agent.metrics import AgentMetrics
from node_agent.replica_hints import ReplicaHintSet
from node_agent.settings import AgentSettings
from tests.unit.test_kv_tiers import Clock, content_of, same, store


def reuse(pool: BlockPool, tx_id: str, keys: list[int]) -> None:
    """A request whose prompt is ``keys``, all cached: every block is hit once."""
    result = pool.tx_allocate(AllocateParams(tx_id, "t", [BlockKey(k) for k in keys], 30.0))
    assert result.reused_blocks == len(keys)
    pool.tx_commit(tx_id)


def donor_pool(
    clock: Clock, offers: list[Donation], accept: bool = True, min_hits: int = 1
) -> BlockPool:
    def donate(d: Donation) -> bool:
        offers.append(d)
        return accept

    return BlockPool(2, clock, donate=donate, donate_min_hits=min_hits)


def test_a_hot_victim_is_offered_with_its_content_parent_and_idle_time() -> None:
    clock = Clock()
    offers: list[Donation] = []
    pool = donor_pool(clock, offers)
    store(pool, "a", [1, 2])
    reuse(pool, "hit", [1, 2])
    clock.now_s = 10.0
    store(pool, "b", [7])  # evicts 2 (a prefix's leaf goes first), hit once
    assert [d.key for d in offers] == [2]
    offer = offers[0]
    assert offer.parent == 1
    assert offer.hits == 1
    assert offer.hops == 1
    assert offer.idle_s == 10.0
    assert offer.tenant == "t"
    assert same(offer.content, content_of(2))
    store(pool, "c", [8])  # evicts 1, the prefix's first block
    assert [(d.key, d.parent) for d in offers] == [(2, 1), (1, None)]
    assert pool.donated_blocks == 2
    # The donor still reports them gone: they left this node.
    assert [e.keys for e in pool.take_events() if isinstance(e, BlockRemoved)] == [(2,), (1,)]
    pool.check_invariants()


def test_cold_and_too_often_donated_victims_are_dropped_without_an_offer() -> None:
    clock = Clock()
    offers: list[Donation] = []
    pool = donor_pool(clock, offers, min_hits=1)
    store(pool, "a", [1, 2])  # never reused: cold
    store(pool, "b", [3, 4])
    assert offers == []
    assert pool.donated_blocks == 0
    # A block a peer donated here, already at the hop limit, is not passed on again.
    peer = donor_pool(clock, offers)  # donate_max_hops: 1, the default
    assert peer.accept_donation(Donation(BlockKey(9), None, "t", content_of(9), 0.0, 3, 1))
    reuse(peer, "hit", [9])
    store(peer, "x", [5, 6])
    assert offers == []


def test_a_refused_offer_is_not_counted() -> None:
    clock = Clock()
    offers: list[Donation] = []
    pool = donor_pool(clock, offers, accept=False)
    store(pool, "a", [1])
    reuse(pool, "hit", [1])
    store(pool, "b", [2, 3])
    assert len(offers) == 1
    assert pool.donated_blocks == 0


def test_a_peer_takes_a_donation_into_a_free_block_and_reuses_it() -> None:
    clock = Clock()
    peer = BlockPool(4, clock)
    assert peer.lru_tail_idle_s() == float("inf")  # room: a donation costs nothing
    clock.now_s = 100.0
    donation = Donation(BlockKey(5), None, "t", content_of(5), 4.0, 2, 1)
    assert peer.accept_donation(donation)
    assert not peer.accept_donation(donation)  # held already
    assert peer.cached_keys() == [5]
    assert peer.take_events() == [BlockStored((BlockKey(5),), None)]
    result = peer.tx_allocate(AllocateParams("use", "t", [BlockKey(5), BlockKey(6)], 30.0))
    assert result.reused_blocks == 1
    assert same(peer.get_payload(result.handles[0]), content_of(5))
    peer.tx_commit("use")
    assert peer.accepted_donations == 1
    assert peer.donation_hits == 1
    peer.check_invariants()


def test_a_full_peer_swaps_only_a_colder_victim() -> None:
    clock = Clock()
    peer = BlockPool(2, clock)
    store(peer, "a", [1, 2])  # both used at t=0
    clock.now_s = 50.0
    assert peer.lru_tail_idle_s() == 50.0
    staler = Donation(BlockKey(8), None, "t", content_of(8), 60.0, 1, 1)
    assert not peer.accept_donation(staler)  # the peer's victim (idle 50 s) is more recent
    fresher = Donation(BlockKey(9), None, "t", content_of(9), 20.0, 1, 1)
    assert peer.accept_donation(fresher)
    assert sorted(peer.cached_keys()) == [1, 9]  # 2, the LRU's oldest (a leaf), made room
    # The donated block keeps its idle time: used 20 s ago.
    assert peer.lru_tail_idle_s() == 50.0  # block 1 is next, still
    peer.check_invariants()


def test_a_pool_in_the_middle_of_an_eviction_accepts_nothing() -> None:
    """An offer that would come back into its own donor (or a peer passing on its own
    victim) is refused, so a pool never changes under its own allocation."""
    clock = Clock()
    answers: list[bool] = []
    pool: BlockPool

    def donate(d: Donation) -> bool:
        answers.append(pool.accept_donation(d))
        return False

    pool = BlockPool(2, clock, donate=donate)
    store(pool, "a", [1])
    reuse(pool, "hit", [1])
    clock.now_s = 5.0
    store(pool, "b", [2, 3])
    assert answers == [False]
    pool.check_invariants()


def test_the_peer_whose_victim_is_coldest_takes_the_block() -> None:
    tails = {NodeId("b"): 30.0, NodeId("a"): 30.0, NodeId("c"): 5.0}
    assert choose_donee(10.0, tails) == "a"  # the coldest; ties by id
    assert choose_donee(30.0, tails) is None  # nobody's victim is colder
    assert choose_donee(1e9, {NodeId("x"): float("inf")}) == "x"  # a free block
    assert choose_donee(0.0, {}) is None


@settings(max_examples=int(os.environ.get("KVC_DONATION_EXAMPLES", "60")), deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 2), st.lists(st.integers(1, 12), min_size=1, max_size=4)),
        max_size=40,
    )
)
def test_three_pools_passing_victims_keep_their_invariants(
    ops: list[tuple[int, list[int]]],
) -> None:
    """Random traffic on three small pools that donate to each other (the chooser on
    their tails): every pool's invariants hold, no tx or lock is left, and a key lives
    once on a pool at most."""
    clock = Clock()
    pools: list[BlockPool] = []

    def donor(me: int) -> Callable[[Donation], bool]:
        def donate(d: Donation) -> bool:
            tails = {NodeId(str(i)): p.lru_tail_idle_s() for i, p in enumerate(pools) if i != me}
            while (target := choose_donee(d.idle_s, tails)) is not None:
                if pools[int(target)].accept_donation(d):
                    return True
                del tails[target]
            return False

        return donate

    for i in range(3):
        pool = BlockPool(3, clock, donate=donor(i), donate_min_hits=0, donate_max_hops=2)
        pools.append(pool)
    for n, (node, keys) in enumerate(ops):
        clock.now_s += 1.0
        pool = pools[node]
        prompt = list(dict.fromkeys(keys))[:3]
        store(pool, f"tx{n}", prompt)
    assert sum(p.donated_blocks for p in pools) == sum(p.accepted_donations for p in pools)
    for pool in pools:
        pool.check_invariants()
        assert pool.stats().open_txs == 0
        assert len(set(pool.cached_keys())) == len(pool.cached_keys())


def test_only_the_embedded_engine_donates() -> None:
    """vLLM evicts inside its own process: the agent could not take the block's KV."""
    base = {"port": 0, "calibrate": False, "donate_before_evict": True}
    assert AgentSettings.model_validate(base).donate_before_evict
    with pytest.raises(ValidationError, match="donate_before_evict needs the embedded engine"):
        AgentSettings.model_validate({**base, "engine": "vllm", "vllm_url": "http://vllm"})
    with pytest.raises(ValidationError, match="donate_max_hops"):
        AgentSettings.model_validate({**base, "donate_max_hops": 0})


def test_an_agent_offers_only_last_copies_and_only_to_colder_donees() -> None:
    clock = Clock()
    hints = ReplicaHintSet(max_keys=16)
    hints.epoch = "e"
    block = content_of(1)
    donations = Donations(
        BlockPool(2, clock), hints, TensorKvCodec("cpu"), block.layout, AgentMetrics(),
        wall=lambda: 1_000.0,
    )  # fmt: skip
    offer = Donation(BlockKey(1), None, "t", block, idle_s=30.0, hits=1, hops=1)
    assert not donations.offer(offer)  # no donees known
    hints.apply(
        pb.ReplicaHintsRequest(
            epoch="e", reset=True, replicated=[2],
            donees=[
                pb.Donee(address="warm:1", eviction_tail_used_unix_s=990.0),  # idle 10 s
                pb.Donee(address="cold:1", eviction_tail_used_unix_s=900.0),  # idle 100 s
                pb.Donee(address="free:1", eviction_tail_used_unix_s=0.0),  # a free block
            ],
        )
    )  # fmt: skip
    assert donations._donees(30.0) == ["free:1", "cold:1"]  # coldest first, never "warm"
    assert not donations.offer(Donation(BlockKey(2), None, "t", block, 30.0, 1, 1))  # held
    assert donations.offer(offer)
    assert donations.eviction_tail_used_unix_s() == 0.0  # the pool has a free block


def test_a_donation_never_replaces_its_own_parent() -> None:
    clock = Clock()
    peer = BlockPool(1, clock)
    store(peer, "a", [1])
    clock.now_s = 50.0
    child = Donation(BlockKey(2), BlockKey(1), "t", content_of(2), 5.0, 1, 1)
    assert not peer.accept_donation(child)  # the only victim is its parent
    assert peer.cached_keys() == [1]
    peer.check_invariants()
