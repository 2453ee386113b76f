"""The simulated fleet drives the real core exactly like the live dispatcher does."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Literal

import pytest

from conductor.core.policies import Policy
from conductor.core.prefix_index import NodeId
from conductor.core.scheduler import Admission, SchedulerConfig, Slo
from kvc_sim.cluster import Cluster, simulate
from kvc_sim.cluster_config import ClusterConfig
from kvc_sim.instances import PrefillInstance, QueuedPrefill
from kvc_sim.metrics import RequestRecord, summarize
from kvc_sim.profile import Profile, load_profile
from kvc_sim.trace import TraceRequest
from kvc_sim.workload import SyntheticSpec, generate
from node_agent.blocks.types import KvMedium

SLO = Slo(ttft_s=30.0, tbt_s=0.1)


def profile(overrides: dict[str, object] | None = None) -> Profile:
    return load_profile("llama3-70b-8xa800", overrides)


def sched(p: Profile, policy: Policy = Policy.KV_CENTRIC, **kw: object) -> SchedulerConfig:
    base = SchedulerConfig(
        policy=policy,
        admission=Admission.NONE,
        prefill_prior=p.prefill_prior(),
        decode_prior=p.decode_prior(),
        transfer_bandwidth_bytes_per_s=p.network.nic_bytes_per_s,
        transfer_latency_s=p.network.latency_s,
        output_length_prior_tokens=150,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def workload(n: int = 250, rate: float = 3.0, seed: int = 2) -> list[TraceRequest]:
    return generate(SyntheticSpec(requests=n, rate_per_s=rate, seed=seed))


def check_consistent(cluster: Cluster) -> None:
    """Shadow index == every pool's cached keys; no tx left open; pool invariants hold."""
    for node, inst in cluster.prefill.items():
        inst.pool.check_invariants()
        assert inst.pool.stats().open_txs == 0
        assert cluster.index.node_keys(node) == frozenset(inst.pool.cached_keys())
        assert cluster.index.position(node) == (inst.epoch, inst.last_seq)
    cluster.index.check_invariants()
    # Every pull ended: no lend is still booked on a holder's queue.
    assert not any(book.pending_lends for book in cluster.scheduler._books.values())


@pytest.mark.parametrize("delay_s", [0.0, 0.5])
def test_shadow_index_follows_the_pools_with_migrations_and_evictions(delay_s: float) -> None:
    p = profile()
    reqs = workload()
    config = ClusterConfig(
        prefill_instances=4, decode_instances=2, cache_tokens=200_000, index_event_delay_s=delay_s
    )
    cluster = Cluster(p, config, sched(p), SLO, reqs)
    result = cluster.run(reqs, speed=3.0)
    assert len(result.records) == len(reqs)
    assert result.migrations > 0
    assert all(inst.evicted_blocks > 0 for inst in cluster.prefill.values())
    check_consistent(cluster)
    # The scheduler learned from the hooks: prefill durations, transfers, token gaps.
    node = next(iter(cluster.prefill))
    assert cluster.scheduler.prefill_model(node).sample_count > 0
    assert any(cluster.scheduler.decode_model(d).sample_count > 0 for d in cluster.decode)
    # Everything finished: no pending prefill or active decode is left in its books.
    for d in cluster.decode:
        assert cluster.scheduler.active_decodes(d, cluster.loop.now_s) == (0, 0)


def test_a_busy_holder_makes_algorithm_1_pull_its_prefix() -> None:
    p = profile()
    prefix = tuple(range(40))  # 20,480 tokens
    reqs = [
        TraceRequest("a", 0.0, 40 * 512, 1, prefix),
        # Same prefix and a long tail: cheapest on the holder, which it keeps busy for
        # ~15 s (a longer tail would make the holder's learned 0.4% slowdown outweigh
        # moving the prefix, and x itself would go elsewhere).
        TraceRequest("x", 60.0, 140 * 512, 1, (*prefix, *range(1000, 1100))),
        TraceRequest("b", 60.001, 41 * 512, 1, (*prefix, 5000)),
    ]
    config = ClusterConfig(prefill_instances=2, decode_instances=1, load_sample_s=1e6)
    for policy, migrated in ((Policy.KV_CENTRIC, True), (Policy.LOCAL_PREFIX, False)):
        cluster = Cluster(p, config, sched(p, policy), SLO, reqs)
        result = cluster.run(reqs)
        by_id = {r.request_id: r for r in result.records}
        assert by_id["a"].prefill_node == "prefill-00"
        assert by_id["x"].prefill_node == "prefill-00"
        assert by_id["b"].prefill_node == "prefill-01"
        if migrated:
            assert result.migrations == 1
            assert by_id["b"].migrated_tokens == 40 * 512
            assert by_id["b"].cached_tokens == 40 * 512
            # Both nodes now hold the prefix: the pull replicated it (hot-spot copy).
            for inst in cluster.prefill.values():
                assert inst.pool.match_prefix([*map(int, prefix)]) == 40  # type: ignore[list-item]
        else:
            assert result.migrations == 0
            assert by_id["b"].cached_tokens == 0
        check_consistent(cluster)


def test_a_pull_from_a_holder_that_lends_through_its_engine_waits_its_turn() -> None:
    """``lend_wait``: the holder lends with a request to its engine (vLLM). "running"
    (legs first) waits for the prefill running there, "queue" for every prefill queued
    ahead as well; "none" sends at once. Unreported (conductors before
    ``NodeInfo.lend_wait``) the scheduler still plans the pull and the request pays the
    wait; reported, the wait is charged and the request computes instead."""
    p = profile()
    prefix = tuple(range(40))  # 20,480 tokens
    reqs = [
        TraceRequest("a", 0.0, 40 * 512, 1, prefix),
        TraceRequest("x", 60.0, 140 * 512, 1, (*prefix, *range(1000, 1100))),  # the holder's
        TraceRequest("b", 60.001, 41 * 512, 1, (*prefix, 5000)),  # pulls the prefix
    ]
    base = ClusterConfig(prefill_instances=2, decode_instances=1, load_sample_s=1e6)
    results = {}
    for wait in ("none", "running", "queue"):
        config = replace(base, lend_wait=wait, lend_wait_reported=False)
        cluster = Cluster(p, config, sched(p), SLO, reqs)
        results[wait] = {r.request_id: r for r in cluster.run(reqs).records}
        check_consistent(cluster)
    for wait in ("none", "running", "queue"):
        b = results[wait]["b"]
        assert (b.prefill_node, b.migrated_tokens) == ("prefill-01", 40 * 512)
    x = results["none"]["x"]
    x_end_s = x.arrival_s + x.ttft_s  # type: ignore[operator]
    assert results["none"]["b"].ttft_s < 0.5 * x.prefill_s  # type: ignore[operator]
    for wait in ("running", "queue"):  # x is the only prefill ahead of the lend
        b = results[wait]["b"]
        assert b.arrival_s + b.ttft_s > x_end_s  # type: ignore[operator]
    # Reported: the wait is charged, and computing the prompt beats waiting for x.
    config = replace(base, lend_wait="running")
    cluster = Cluster(p, config, sched(p), SLO, reqs)
    result = cluster.run(reqs)
    b = {r.request_id: r for r in result.records}["b"]
    assert result.migrations == 0
    assert (b.prefill_node, b.cached_tokens) == ("prefill-01", 0)
    assert b.ttft_s < results["running"]["b"].ttft_s  # type: ignore[operator]
    check_consistent(cluster)


def test_lends_go_before_waiting_prefills_first_come_first_served() -> None:
    """vLLM's priority scheduling with the lend legs first: a lend waits behind the
    running prefill and the lends already waiting, never behind a waiting prefill."""
    inst = PrefillInstance(NodeId("prefill-00"), profile(), 100, 512, lambda: 0.0, 60.0)

    def job(rid: str, lend: bool = False) -> QueuedPrefill:
        return QueuedPrefill(rid, f"{rid}-tx", (), (), 1, lambda _c, _d: None, lambda: None,
                             lend=lend)  # fmt: skip

    inst.enqueue(job("running"))
    running = inst.next_ready()
    assert running is not None
    for j in (job("w1"), job("l1", lend=True), job("w2"), job("l2", lend=True)):
        if j.lend:
            inst.enqueue_lend(j)
        else:
            inst.enqueue(j)
    assert [j.request_id for j in inst.queue] == ["l1", "l2", "w1", "w2"]
    assert inst.next_ready() is None  # the running one first
    inst.finish(running)
    order = []
    while (nxt := inst.next_ready()) is not None:
        order.append(nxt.request_id)
        inst.finish(nxt)
    assert order == ["l1", "l2", "w1", "w2"]
    assert inst.queued_tokens == 0


def test_nodes_that_own_their_kv_never_migrate() -> None:
    """``kv_migration=False`` (vLLM nodes, as the live conductor sees them): kv_centric
    recomputes where it would have pulled; the same workload migrates otherwise."""
    p = profile()
    reqs = workload()
    base = ClusterConfig(prefill_instances=4, decode_instances=2, cache_tokens=200_000)
    moved = Cluster(p, base, sched(p), SLO, reqs).run(reqs, speed=3.0)
    assert moved.migrations > 0
    cluster = Cluster(p, replace(base, kv_migration=False), sched(p), SLO, reqs)
    result = cluster.run(reqs, speed=3.0)
    assert len(result.records) == len(reqs)
    assert result.migrations == 0
    assert all(r.migrated_tokens == 0 for r in result.records)
    check_consistent(cluster)


def test_no_room_on_a_prefill_node_moves_the_request_or_rejects_it() -> None:
    p = profile()
    small = ClusterConfig(prefill_instances=2, decode_instances=1, cache_tokens=10 * 512)
    fits = TraceRequest("fits", 0.0, 8 * 512, 1, tuple(range(8)))
    too_big = TraceRequest("big", 0.0, 20 * 512, 1, tuple(range(100, 120)))
    # Two 8-block prompts at once: the first fills most of prefill-00, the second must go
    # to prefill-01 (TxAllocate refuses, the scheduler retries elsewhere).
    twin = TraceRequest("twin", 0.0, 8 * 512, 1, tuple(range(200, 208)))
    result = simulate(p, small, sched(p, Policy.ROUND_ROBIN), SLO, [fits, twin, too_big])
    by_id = {r.request_id: r for r in result.records}
    assert by_id["fits"].outcome == "completed"
    assert by_id["twin"].outcome == "completed"
    assert by_id["big"].outcome == "rejected"
    assert by_id["big"].reject_reason == "insufficient_capacity"
    assert by_id["big"].prefill_s == 0.0


def decode_tight(p: Profile) -> ClusterConfig:
    del p
    return ClusterConfig(prefill_instances=4, decode_instances=1, load_sample_s=1e6)


def test_decode_queue_or_refusal_when_kv_runs_out() -> None:
    p = profile({"decode": {"hbm_kv_tokens": 60_000}})
    reqs = [TraceRequest(f"r{i}", 0.01 * i, 20_000, 200, (i * 100,)) for i in range(8)]
    queued = simulate(p, decode_tight(p), sched(p), SLO, reqs)
    assert all(r.outcome == "completed" for r in queued.records)
    # Only two fit at a time (40k of 60k tokens): the rest waited, which shows in TBT.
    assert max(r.tbt_s or 0 for r in queued.records) > 5 * p.tbt_s(2, 40_000)
    refusing = replace(decode_tight(p), decode_refuses=True)
    refused = simulate(p, refusing, sched(p), SLO, reqs)
    wasted = [r for r in refused.records if r.outcome == "rejected_after_prefill"]
    assert wasted
    summary = summarize(refused, 30.0, 0.1, [0.1])
    assert summary.wasted_prefill_s == pytest.approx(sum(r.prefill_s for r in wasted))
    assert summary.rejected_after_prefill == len(wasted)


@pytest.mark.parametrize(
    "admission", [Admission.EARLY, Admission.PREDICTIVE, Admission.PREFILL_ONLY]
)
def test_admission_rejects_before_any_work(admission: Admission) -> None:
    p = profile()
    reqs = workload(n=120, rate=20.0)
    tight = Slo(ttft_s=3.0, tbt_s=0.1)
    config = ClusterConfig(prefill_instances=2, decode_instances=2, load_sample_s=1e6)
    result = simulate(p, config, sched(p, admission=admission), tight, reqs)
    rejected = [r for r in result.records if r.outcome == "rejected"]
    assert rejected
    assert all(r.reject_reason == "ttft_slo" and r.prefill_s == 0.0 for r in rejected)
    served = [r for r in result.records if r.outcome == "completed"]
    assert served


def test_kv_centric_beats_prefix_blind_policies_on_shared_prefixes() -> None:
    p = profile()
    reqs = workload(n=300, rate=4.0)
    config = ClusterConfig(prefill_instances=4, decode_instances=2, load_sample_s=1e6)
    hits = {}
    for policy in Policy:
        result = simulate(p, config, sched(p, policy), SLO, reqs)
        hits[policy] = summarize(result, 30.0, 0.1, [0.1]).hit_ratio
        assert all(r.outcome == "completed" for r in result.records)
    assert hits[Policy.KV_CENTRIC] > hits[Policy.LOCAL_PREFIX] >= hits[Policy.ROUND_ROBIN]
    assert hits[Policy.KV_ADAPTIVE] > hits[Policy.ROUND_ROBIN]


def test_block_tokens_must_divide_the_trace_block() -> None:
    with pytest.raises(ValueError, match="divide"):
        ClusterConfig(prefill_instances=1, decode_instances=1, block_tokens=300)
    config = ClusterConfig(prefill_instances=1, decode_instances=1, block_tokens=128)
    cluster = Cluster(profile(), config, sched(profile()), SLO)
    keys = cluster.keys_of(TraceRequest("k", 0.0, 600, 1, (7, 9)))
    assert keys == (28, 29, 30, 31, 36)  # 4 sub-blocks of id 7, then ceil(88/128) of id 9
    assert not math.isnan(float(len(keys)))


@pytest.mark.parametrize("replica_aware", [False, True])
def test_tiered_nodes_keep_evicted_prefixes_and_the_shadow_follows_every_tier(
    replica_aware: bool,
) -> None:
    """The agent's tier model in the simulator: a pool too small for the workload keeps
    what it evicts in host memory and on disk (the agent's own ``LowerTiers``); hits
    there are reused and pay their load; the shadow (any tier + the per-tier tables)
    equals what the pools and tiers hold."""
    p = profile()
    reqs = workload(n=300, rate=3.0)

    def run(host: int, disk: int) -> tuple[Cluster, float]:
        config = ClusterConfig(
            prefill_instances=2, decode_instances=1, cache_tokens=100_000,
            output_tokens=1, host_tier_tokens=host, disk_tier_tokens=disk,
            replica_aware_eviction=replica_aware,
        )  # fmt: skip
        cluster = Cluster(p, config, sched(p), SLO, reqs)
        result = cluster.run(reqs, speed=3.0)
        assert len(result.records) == len(reqs)
        hit = sum(r.cached_tokens for r in result.records) / sum(
            r.input_tokens for r in result.records
        )
        return cluster, hit

    l1_only, hit_l1 = run(0, 0)
    tiered, hit_tiers = run(200_000, 2_000_000)
    assert hit_tiers > hit_l1  # the same L1, more kept
    promoted = [inst.promoted_counts() for inst in tiered.prefill.values()]
    assert sum(h for h, _ in promoted) > 0  # hits served from host memory
    assert sum(sum(inst.promoted_counts()) for inst in l1_only.prefill.values()) == 0
    lower = tiered.lower
    assert lower is not None
    for node, inst in tiered.prefill.items():
        pool = inst.pool
        pool.check_invariants()
        assert pool.stats().open_txs == 0
        host = pool.tier_keys(KvMedium.HOST)
        disk = pool.tier_keys(KvMedium.DISK)
        assert host
        assert disk or replica_aware
        assert tiered.index.node_keys(node) == frozenset([*pool.cached_keys(), *host, *disk])
        prompt = [*host, *disk]
        hits = lower.hits(prompt, {node: len(prompt)})
        assert hits[node].host_blocks == len(host)
        assert hits[node].disk_blocks == len(disk)
    tiered.index.check_invariants()


def test_vllm_pull_handoff_adds_the_transfer_and_the_first_decode_step() -> None:
    """``kv_handoff="pull"`` (vLLM's NixlConnector, as ``kvc sim-engine`` runs it): the
    KV moves after the prefill, and the decode node's first step — the prompt's last
    token computed again, no decode batch on an idle node — yields the first token.
    Layerwise, the first token is the prefill's own, one latency after its end."""
    p = profile()
    n, out = 8192, 5
    req = TraceRequest("a", 0.0, n, out, tuple(range(n // 512)))
    runs: dict[str, RequestRecord] = {}
    handoffs: tuple[Literal["layerwise", "pull"], ...] = ("layerwise", "pull")
    for handoff in handoffs:
        config = ClusterConfig(prefill_instances=1, decode_instances=1, kv_handoff=handoff)
        cluster = Cluster(p, config, sched(p), SLO, [req])
        (record,) = cluster.run([req]).records
        assert record.outcome == "completed"
        runs[handoff] = record
        check_consistent(cluster)
    layerwise, pull = runs["layerwise"], runs["pull"]
    assert layerwise.ttft_s is not None
    assert layerwise.finish_s is not None
    assert pull.ttft_s is not None
    assert pull.finish_s is not None
    latency = p.network.latency_s
    assert layerwise.prefill_s == pull.prefill_s
    assert layerwise.ttft_s == pytest.approx(layerwise.prefill_s + latency)
    wire = p.wire_s(n * p.kv_bytes_per_token)
    recompute = p.prefill_compute_s(n, n - 1)
    assert recompute > 0
    assert pull.ttft_s == pytest.approx(pull.prefill_s + wire + latency + recompute)
    # Then out - 1 decode steps of one request each, in both modes.
    assert pull.finish_s - pull.ttft_s == pytest.approx(
        sum(p.tbt_s(1, n + 1 + i) for i in range(out - 1))
    )
    assert layerwise.finish_s - layerwise.ttft_s == pytest.approx(
        sum(p.tbt_s(1, n + 1 + i) for i in range(out - 1))
    )
    assert pull.tbt_s == pytest.approx(p.tbt_s(1, n + 1 + out - 2))


def test_pulled_requests_join_a_running_batch_at_its_next_step() -> None:
    """Under load the pull hand-off keeps every request, every pool and the shadow
    consistent, and costs TTFT against the layerwise hand-off on the same workload."""
    p = profile()
    reqs = workload()
    base = ClusterConfig(prefill_instances=4, decode_instances=2, cache_tokens=200_000)
    layerwise = simulate(p, base, sched(p), SLO, reqs, speed=3.0)
    cluster = Cluster(p, replace(base, kv_handoff="pull"), sched(p), SLO, reqs)
    pull = cluster.run(reqs, speed=3.0)
    assert all(r.outcome == "completed" for r in pull.records)
    assert len(pull.records) == len(reqs)
    check_consistent(cluster)
    for inst in cluster.decode.values():
        assert inst.batch_requests == inst.reserved_tokens == inst.context_tokens == 0

    def mean_ttft(records: Sequence[RequestRecord]) -> float:
        ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
        return sum(ttfts) / len(ttfts)

    assert mean_ttft(pull.records) > mean_ttft(layerwise.records)


def test_donate_before_evict_moves_last_copies_to_peers_and_the_shadow_follows() -> None:
    """L1-only nodes too small for the workload: hot victims the shadow sees nowhere
    else go to a peer holding their parent (``donate_before_evict``); the peers' pools
    and the shadow agree, and nothing is left open."""
    p = profile()
    reqs = workload(n=300, rate=3.0)
    config = ClusterConfig(
        prefill_instances=3, decode_instances=1, cache_tokens=60_000, output_tokens=1,
        host_tier_tokens=0, disk_tier_tokens=0, donate_before_evict=True, donate_min_hits=0,
    )  # fmt: skip
    cluster = Cluster(p, config, sched(p), SLO, reqs)
    result = cluster.run(reqs, speed=3.0)
    assert len(result.records) == len(reqs)
    pools = [inst.pool for inst in cluster.prefill.values()]
    assert result.donated_blocks > 0
    assert result.donated_blocks == sum(pool.accepted_donations for pool in pools)
    for node, inst in cluster.prefill.items():
        inst.pool.check_invariants()
        assert inst.pool.stats().open_txs == 0
        assert cluster.index.node_keys(node) == frozenset(inst.pool.cached_keys())
    summary = summarize(result, SLO.ttft_s, SLO.tbt_s, (SLO.tbt_s,))
    assert summary.donated_blocks == result.donated_blocks


def test_donation_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="donate_max_hops"):
        ClusterConfig(prefill_instances=1, decode_instances=1, donate_max_hops=0)
