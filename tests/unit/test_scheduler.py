"""Algorithm 1, the comparison policies and admission, branch by branch (fake clock)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from conductor.core.policies import (
    BUILTIN_POLICIES,
    LeastQueue,
    LocalPrefix,
    LowestTbt,
    Policy,
    SchedulingPolicy,
)
from conductor.core.prefix_index import NodeId
from conductor.core.scheduler import (
    Admission,
    NodeState,
    Placement,
    Rejection,
    Scheduler,
    SchedulerConfig,
    ScheduleRequest,
    Slo,
)
from kvc.priors import PrefillPrior
from tests.scheduling_helpers import ROUND_DECODE, ROUND_PREFILL, make_node, round_number_config

PREFILL = ROUND_PREFILL
DECODE = ROUND_DECODE
BS = 32
KV_BYTES_PER_TOKEN = 1000
NOW = 100.0


def config(**kw: object) -> SchedulerConfig:
    return round_number_config(**kw)


def node(name: str, role: str = "prefill", **kw: object) -> NodeState:
    return make_node(name, role, block_size=BS, kv_bytes_per_token=KV_BYTES_PER_TOKEN, **kw)


def request(
    prefix: dict[str, int] | None = None,
    prompt: int = 1024 + 1,
    ttft_s: float = 30.0,
    tbt_s: float = 1.0,
    max_new: int = 100,
    rid: str = "r",
) -> ScheduleRequest:
    return ScheduleRequest(
        request_id=rid,
        prompt_tokens=prompt,
        prefix_blocks={NodeId(k): v for k, v in (prefix or {}).items()},
        max_new_tokens=max_new,
        slo=Slo(ttft_s=ttft_s, tbt_s=tbt_s),
    )


FLEET = [node("p1"), node("p2"), node("p3"), node("d1", "decode")]


def placed(decision: Placement | Rejection) -> Placement:
    assert isinstance(decision, Placement), decision
    return decision


def test_prefers_the_node_holding_the_prefix() -> None:
    s = Scheduler(config())
    p = placed(s.schedule(request({"p2": 30}), FLEET, NOW))
    assert p.prefill == "p2"
    assert p.decode == "d1"
    assert p.prefix_blocks == 30
    assert p.migration is None
    assert p.prefill_s == pytest.approx((1025 - 30 * BS) * 0.001)


def test_busy_holder_loses_to_migration_when_ratio_exceeds_threshold() -> None:
    """Algorithm 1 line 5: best_len / prefix_len > threshold → pull the prefix."""
    s = Scheduler(config())
    busy = [node("p1"), node("p2", queued_prefill_tokens=5000), node("d1", "decode")]
    p = placed(s.schedule(request({"p2": 30}), busy, NOW))
    assert p.prefill == "p1"
    assert p.migration is not None
    assert p.migration.source == "p2"
    assert p.migration.blocks == 30
    assert p.migration.transfer_s == pytest.approx(30 * BS * KV_BYTES_PER_TOKEN / 1e9)
    assert p.prefix_blocks == 30


def test_no_migration_when_ratio_is_below_threshold() -> None:
    """p1 holds 20, best holds 30: 30/20 = 1.5 ≤ 2 → compute locally from 20 blocks."""
    s = Scheduler(config())
    fleet = [node("p1"), node("p2", queued_prefill_tokens=5000), node("d1", "decode")]
    p = placed(s.schedule(request({"p1": 20, "p2": 30}), fleet, NOW))
    assert p.prefill == "p1"
    assert p.migration is None
    assert p.prefix_blocks == 20


def test_local_prefix_policy_never_migrates() -> None:
    s = Scheduler(config(policy=Policy.LOCAL_PREFIX))
    fleet = [node("p1"), node("p2", queued_prefill_tokens=5000), node("d1", "decode")]
    p = placed(s.schedule(request({"p2": 30}), fleet, NOW))
    assert p.migration is None
    assert p.prefill == "p1"  # p2's queue (5 s) costs more than recomputing (1 s)
    assert p.prefix_blocks == 0


def test_least_loaded_ignores_prefixes() -> None:
    s = Scheduler(config(policy=Policy.LEAST_LOADED))
    fleet = [node("p1", queued_prefill_tokens=10), node("p2"), node("d1", "decode")]
    p = placed(s.schedule(request({"p1": 30}), fleet, NOW))
    assert p.prefill == "p2"


def test_round_robin_rotates() -> None:
    s = Scheduler(config(policy=Policy.ROUND_ROBIN))
    chosen = [placed(s.schedule(request({"p1": 30}), FLEET, NOW)).prefill for _ in range(4)]
    assert chosen == ["p1", "p2", "p3", "p1"]


def test_policies_are_chosen_by_name_from_a_registry() -> None:
    """Every built-in name is registered; unknown names fail fast; a registry can grow."""
    assert set(BUILTIN_POLICIES) == {p.value for p in Policy}
    assert Scheduler(config(policy="least_loaded")).policy.name == "least_loaded"
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        Scheduler(config(policy="nope"))

    def queue_only(_: SchedulerConfig) -> SchedulingPolicy:
        return SchedulingPolicy("queue_only", LocalPrefix(), LeastQueue(), LowestTbt())

    s = Scheduler(config(policy="queue_only"), {**BUILTIN_POLICIES, "queue_only": queue_only})
    fleet = [node("p1", queued_prefill_tokens=10), node("p2"), node("d1", "decode")]
    assert placed(s.schedule(request({"p1": 30}), fleet, NOW)).prefill == "p2"


def test_own_assignments_queue_up() -> None:
    """Without agent reports, the scheduler's own pending prefills make the queue."""
    s = Scheduler(config(policy=Policy.LEAST_LOADED))
    chosen = []
    for i in range(3):
        req = request(rid=f"r{i}")
        p = placed(s.schedule(req, FLEET, NOW))
        s.on_assigned(req, p, NOW)
        chosen.append(p.prefill)
    assert sorted(chosen) == ["p1", "p2", "p3"]
    s.on_prefill_done("r0", NodeId(chosen[0]), 1025, 0, 1.0)
    assert s.queue_s(node(chosen[0])) == 0.0


def test_agent_reported_queue_is_not_double_counted() -> None:
    s = Scheduler(config())
    req = request(rid="mine")
    p = placed(s.schedule(req, [node("p1"), node("d1", "decode")], NOW))
    s.on_assigned(req, p, NOW)
    own = s.queue_s(node("p1"))
    assert own == pytest.approx(1.025)
    # The agent now reports our own request as queued: same estimate, not twice.
    assert s.queue_s(node("p1", queued_prefill_tokens=1025)) == pytest.approx(own)
    # Another conductor's 2000 tokens on top add their linear cost.
    assert s.queue_s(node("p1", queued_prefill_tokens=3025)) == pytest.approx(own + 2.0)


def test_ttft_rejection_with_retry_after_from_queue_drain() -> None:
    s = Scheduler(config())
    fleet = [node("p1", queued_prefill_tokens=20_000), node("d1", "decode")]
    r = s.schedule(request(ttft_s=5.0), fleet, NOW)
    assert isinstance(r, Rejection)
    assert r.reason == "ttft_slo"
    assert r.ttft_s == pytest.approx(20.0 + 1.025 + 1025 * KV_BYTES_PER_TOKEN / 1e9)
    assert r.retry_after_s == pytest.approx(r.ttft_s - 5.0)


def test_admission_none_never_rejects_on_slo() -> None:
    s = Scheduler(config(admission=Admission.NONE))
    fleet = [node("p1", queued_prefill_tokens=20_000), node("d1", "decode")]
    assert isinstance(s.schedule(request(ttft_s=5.0, tbt_s=0.001), fleet, NOW), Placement)


def _load_decode(s: Scheduler, count: int, end_s: float) -> None:
    """Put ``count`` decodes on d1 that started at NOW-1 and stop at ``end_s`` (max_tokens)."""
    step_s = 0.01
    for i in range(count):
        cap = round((end_s - (NOW - 1)) / step_s)
        req = request(rid=f"busy{i}", max_new=cap)
        p = Placement(
            prefill=NodeId("p1"), decode=NodeId("d1"), prefix_blocks=0, migration=None,
            queue_s=0, prefill_s=0, handoff_s=0, ttft_s=0, tbt_s=step_s,
        )  # fmt: skip
        s.on_assigned(req, p, NOW - 1)
        s.on_decode_started(req.request_id, NodeId("d1"), NOW - 1)
        s.on_prefill_done(req.request_id, NodeId("p1"), 10, 0, None)


def test_early_rejects_on_current_decode_load() -> None:
    """9 running + this one → TBT 0.11 s > 0.1 s, even though they end before prefill does."""
    s = Scheduler(config(admission=Admission.EARLY))
    _load_decode(s, 9, end_s=NOW + 0.5)
    r = s.schedule(request(tbt_s=0.1), FLEET, NOW)
    assert isinstance(r, Rejection)
    assert r.reason == "tbt_slo"
    assert r.tbt_s == pytest.approx(0.11)
    assert r.retry_after_s == pytest.approx(1.0)  # drains at NOW+0.5; Retry-After ≥ 1 s


def test_predictive_admits_when_decodes_end_before_prefill_finishes() -> None:
    """§4.3.4: the same load is gone by the time this prefill (≈1 s) completes."""
    s = Scheduler(config(admission=Admission.PREDICTIVE))
    _load_decode(s, 9, end_s=NOW + 0.5)
    p = placed(s.schedule(request(tbt_s=0.1), FLEET, NOW))
    assert p.tbt_s == pytest.approx(0.02)


def test_predictive_rejects_load_that_will_still_be_there() -> None:
    s = Scheduler(config(admission=Admission.PREDICTIVE))
    _load_decode(s, 9, end_s=NOW + 50)
    r = s.schedule(request(tbt_s=0.1), FLEET, NOW)
    assert isinstance(r, Rejection)
    assert r.reason == "tbt_slo"
    # They end at NOW+50; the forecast is probed at growing delays after the prefill.
    assert 49.0 <= r.retry_after_s <= 60.0


def test_predictive_counts_requests_joining_before_prefill_ends() -> None:
    s = Scheduler(config(admission=Admission.PREDICTIVE))
    # Nine requests admitted now, whose decode starts at ~NOW+1 and lasts long.
    for i in range(9):
        req = request(rid=f"j{i}", prompt=33, max_new=1000)
        p = placed(s.schedule(req, [node("p9"), node("d1", "decode")], NOW))
        s.on_assigned(req, p, NOW)
    r = s.schedule(request(tbt_s=0.1), [node("p1"), node("d1", "decode")], NOW)
    assert isinstance(r, Rejection)
    assert r.reason == "tbt_slo"


def test_decode_choice_by_tbt_and_room() -> None:
    s = Scheduler(config())
    _load_decode(s, 3, end_s=NOW + 100)
    fleet = [
        node("p1"),
        node("d1", "decode"),
        node("d2", "decode"),
        node("d3", "decode", free_blocks=1),
    ]
    p = placed(s.schedule(request(), fleet, NOW))
    assert p.decode == "d2"  # d1 is loaded, d3 has no room for the prompt's KV


def test_both_node_decodes_locally_without_handoff() -> None:
    s = Scheduler(config())
    p = placed(s.schedule(request(), [node("b1", "both")], NOW))
    assert (p.prefill, p.decode, p.handoff_s) == ("b1", "b1", 0.0)


def test_handoff_is_part_of_ttft() -> None:
    s = Scheduler(config())
    p = placed(s.schedule(request(), FLEET, NOW))
    assert p.handoff_s == pytest.approx(1025 * KV_BYTES_PER_TOKEN / 1e9)
    assert p.ttft_s == pytest.approx(p.queue_s + p.prefill_s + p.handoff_s)


@pytest.mark.parametrize(
    ("fleet", "reason"),
    [
        ([node("d1", "decode")], "no_prefill_node"),
        ([node("p1")], "no_decode_node"),
        ([node("p1", healthy=False), node("d1", "decode")], "no_prefill_node"),
        ([node("p1"), node("d1", "decode", free_blocks=0)], "no_decode_node"),
    ],
)
def test_no_node(fleet: list[NodeState], reason: str) -> None:
    r = Scheduler(config()).schedule(request(), fleet, NOW)
    assert isinstance(r, Rejection)
    assert r.reason == reason
    assert r.retry_after_s >= 1.0


def test_observed_prefill_times_change_estimates() -> None:
    s = Scheduler(config())
    before = s.prefill_model(NodeId("p1")).estimate(1025, 0)
    for _ in range(200):
        s.on_prefill_done("x", NodeId("p1"), 1025, 0, 3 * before)
    assert s.prefill_model(NodeId("p1")).estimate(1025, 0) > 2 * before
    assert math.isclose(s.prefill_model(NodeId("p2")).estimate(1025, 0), before)


def test_finished_requests_leave_the_books() -> None:
    s = Scheduler(config())
    req = request(rid="done")
    p = placed(s.schedule(req, FLEET, NOW))
    s.on_assigned(req, p, NOW)
    assert s.active_decodes(NodeId("d1"), NOW + p.ttft_s)[0] == 1
    s.on_finished("done", p.prefill, p.decode)
    assert s.active_decodes(NodeId("d1"), NOW + p.ttft_s) == (0, 0)
    assert s.queue_s(node(p.prefill)) == 0.0


def test_no_migration_involving_nodes_that_own_their_kv() -> None:
    """vLLM nodes keep KV inside the engine: Algorithm 1 must not plan a pull to or from them."""
    s = Scheduler(config())
    busy_holder = node("p2", queued_prefill_tokens=5000, kv_migration=False)
    p = placed(
        s.schedule(request({"p2": 30}), [node("p1"), busy_holder, node("d1", "decode")], NOW)
    )
    assert p.migration is None
    p = placed(
        s.schedule(
            request({"p2": 30}),
            [
                node("p1", kv_migration=False),
                node("p2", queued_prefill_tokens=5000),
                node("d1", "decode"),
            ],
            NOW,
        )
    )
    assert p.migration is None


def test_nodes_pull_only_from_holders_of_their_own_kv_family() -> None:
    """A mixed fleet: the embedded node cannot load what a vLLM node lends, so it pulls
    from the longest embedded holder, even when a vLLM node holds more."""
    s = Scheduler(config())
    fleet = [
        node("p1", kv_family="embedded"),
        node("p2", queued_prefill_tokens=5000, kv_family="embedded"),
        node("p3", queued_prefill_tokens=5000, kv_family="vllm"),
        node("d1", "decode", kv_family="embedded"),
    ]
    p = placed(s.schedule(request({"p2": 20, "p3": 30}), fleet, NOW))
    assert p.prefill == "p1"
    assert p.migration is not None
    assert (p.migration.source, p.migration.blocks) == ("p2", 20)
    # One family: the longest holder overall lends, as before.
    same = [n if n.node_id != "p3" else node("p3", queued_prefill_tokens=5000,
            kv_family="embedded") for n in fleet]  # fmt: skip
    p = placed(s.schedule(request({"p2": 20, "p3": 30}), same, NOW))
    assert p.migration is not None
    assert (p.migration.source, p.migration.blocks) == ("p3", 30)


@pytest.mark.parametrize("policy", [Policy.KV_CENTRIC, Policy.KV_ADAPTIVE])
def test_a_pull_is_charged_what_the_holders_lend_waits_for(policy: Policy) -> None:
    """vLLM lends a prefix with a request to its engine. First come first served
    ("queue") it waits for the holder's whole queue: a pull from a busy holder then never
    beats computing, and is not planned even past Algorithm 1's threshold. With the
    legs first ("running") it waits for the prefill running there (the oldest of ours):
    charged that, the pull pays when the holder has more queued behind it."""
    s = Scheduler(config(policy=policy))
    wire_s = 30 * BS * KV_BYTES_PER_TOKEN / 1e9
    fleet = [
        node("p1", kv_family="vllm", lend_wait="queue"),
        node("p2", queued_prefill_tokens=5000, kv_family="vllm", lend_wait="queue"),
        node("d1", "decode"),
    ]
    p = placed(s.schedule(request({"p2": 30}), fleet, NOW))
    assert (p.prefill, p.migration, p.prefix_blocks) == ("p1", None, 0)
    assert p.ttft_s - p.handoff_s == pytest.approx(1.025)  # the whole prompt, at once
    # The same holder whose lending waits for nothing (pool payloads): pulled.
    direct = [replace(n, lend_wait="none") for n in fleet]
    p = placed(s.schedule(request({"p2": 30}), direct, NOW))
    assert p.migration is not None
    assert p.migration.transfer_s == pytest.approx(wire_s)
    # Legs first: our two prefills on p2 (200 then 4,800 tokens) make its queue; the lend
    # waits for the first.
    first = [replace(n, lend_wait="running", queued_prefill_tokens=0) for n in fleet]
    for rid, tokens in (("a", 200), ("b", 4800)):
        queued = request(prompt=tokens, rid=rid)
        s.on_assigned(queued, placed(s.schedule(queued, [first[1], first[2]], NOW)), NOW)
    running_s = s.prefill_model(NodeId("p2")).estimate(200, 0)
    p = placed(s.schedule(request({"p2": 30}), first, NOW))
    assert s.lend_wait_s(first[1]) == pytest.approx(running_s)
    assert (p.prefill, p.prefix_blocks) == ("p1", 30)
    assert p.migration is not None
    assert p.migration.transfer_s == pytest.approx(running_s + wire_s)
    # What is left of it: a decision 0.1 s later waits 0.1 s less.
    p = placed(s.schedule(request({"p2": 30}), first, NOW + 0.1))
    assert s.lend_wait_s(first[1]) == pytest.approx(running_s - 0.1)
    assert p.migration is not None
    assert p.migration.transfer_s == pytest.approx(running_s - 0.1 + wire_s)
    # "a" ended late, at NOW + 1: "b" runs from then, and a lend waits for all of it.
    s.on_prefill_done("a", NodeId("p2"), 200, 0, 1.0, now_s=NOW + 1.0)
    b_s = s.prefill_model(NodeId("p2")).estimate(4800, 0)
    s.schedule(request({"p2": 30}), first, NOW + 1.0)
    assert s.lend_wait_s(first[1]) == pytest.approx(b_s)
    s.schedule(request({"p2": 30}), first, NOW + 1.0 + b_s + 5.0)  # b overran its estimate
    assert s.lend_wait_s(first[1]) == 0.0
    # First come first served, the same books: the whole queue, and no pull.
    queued_fleet = [replace(n, lend_wait="queue") for n in first]
    assert s.lend_wait_s(queued_fleet[1]) == pytest.approx(s.queue_s(queued_fleet[1]))
    p = placed(s.schedule(request({"p2": 30}), queued_fleet, NOW))
    assert (p.prefill, p.migration) == ("p1", None)


def test_a_planned_lend_waits_on_the_holders_queue_until_its_pull_ends() -> None:
    """A holder that lends through its engine spends a one-token step on each lend,
    ahead of its waiting prefills: an assigned pull books that step on the holder's
    queue (a prefill placed there later waits for it, and a later lend waits behind it,
    first come first served) until the pull ends. Holders that read their pool for a
    lend (the embedded engine) book nothing."""
    s = Scheduler(config(policy=Policy.KV_ADAPTIVE))
    fleet = [
        node("p1", kv_family="vllm", lend_wait="running"),
        node("p2", kv_family="vllm", lend_wait="running"),
        node("d1", "decode"),
    ]
    holder = fleet[1]
    for rid, tokens in (("a", 200), ("b", 4800)):  # a runs on the holder, b waits
        queued = request(prompt=tokens, rid=rid)
        s.on_assigned(queued, placed(s.schedule(queued, [holder, fleet[2]], NOW)), NOW)
    running_s = s.lend_wait_s(holder)
    queue_s = s.queue_s(holder)
    step_s = s.prefill_model(NodeId("p2")).estimate(1, 0)
    assert step_s > 0
    assert s.lend_s(holder) == pytest.approx(step_s)
    pull = request({"p2": 30}, rid="pull-1")
    p = placed(s.schedule(pull, fleet, NOW))
    assert (p.prefill, p.prefix_blocks) == ("p1", 30)
    assert p.migration is not None
    assert p.migration.lend_s == pytest.approx(step_s)
    s.on_assigned(pull, p, NOW)
    assert s.queue_s(holder) == pytest.approx(queue_s + step_s)
    assert s.lend_wait_s(holder) == pytest.approx(running_s + step_s)
    # The next pull from it is charged the first lend too.
    nxt = placed(s.schedule(request({"p2": 30}, rid="pull-2"), fleet, NOW))
    assert nxt.migration is not None
    assert nxt.migration.transfer_s == pytest.approx(p.migration.transfer_s + step_s)
    s.on_pulled("pull-1", NodeId("p2"))
    s.on_pulled("pull-1", NodeId("p2"))  # idempotent
    assert s.queue_s(holder) == pytest.approx(queue_s)
    assert s.lend_wait_s(holder) == pytest.approx(running_s)
    # A holder that lends from its pool: nothing to book.
    direct = [replace(n, lend_wait="none") for n in fleet]
    assert s.lend_s(direct[1]) == 0.0
    p = placed(s.schedule(request({"p2": 30}, rid="pull-3"), direct, NOW))
    assert p.migration is not None
    assert p.migration.lend_s == 0.0
    s.on_assigned(request({"p2": 30}, rid="pull-3"), p, NOW)
    assert s.queue_s(direct[1]) == pytest.approx(queue_s)


# ---------------------------------------------------------------- capacity before work


def test_a_warm_decode_pool_full_of_evictable_blocks_has_room() -> None:
    """Reproduction: a warm decode cache (nothing strictly free, all evictable) was refused
    with no_decode_node even with admission off; allocatable blocks are what count."""
    s = Scheduler(config(admission=Admission.NONE))
    warm = node("d1", "decode", free_blocks=0, allocatable_blocks=10_000)
    p = placed(s.schedule(request(), [node("p1"), warm], NOW))
    assert p.decode == "d1"
    full = node("d1", "decode", free_blocks=0, allocatable_blocks=0)
    r = s.schedule(request(), [node("p1"), full], NOW)
    assert isinstance(r, Rejection)
    assert r.reason == "no_decode_node"


def test_a_decode_node_without_a_free_generation_slot_is_not_chosen() -> None:
    """The agent would refuse the generation after the prefill: checked before any work."""
    s = Scheduler(config(admission=Admission.NONE))
    fleet = [
        node("p1"),
        node("d1", "decode", max_running_requests=2, running_requests=2),
        node("d2", "decode", max_running_requests=2, running_requests=1),
    ]
    assert placed(s.schedule(request(), fleet, NOW)).decode == "d2"
    # Our own placements count before the agent reports them.
    for i in range(2):
        req = request(rid=f"own{i}")
        s.on_assigned(req, placed(s.schedule(req, fleet[:1] + fleet[2:], NOW)), NOW)
    r = s.schedule(request(), fleet, NOW)
    assert isinstance(r, Rejection)
    assert r.reason == "no_decode_node"


# ---------------------------------------------------------------- estimates that stay sane


def test_one_slow_cold_start_does_not_lock_admission() -> None:
    """Reproduction: after one 0.8 s cold start of a 14-token prompt, a 1,377-token prompt
    got 429 ttft_slo on an idle cluster forever. Now it is served, and so are more."""
    s = Scheduler(SchedulerConfig())  # the shipped default priors, not measured
    fleet = [node("p1"), node("d1", "decode")]
    s.on_prefill_done("warm", NodeId("p1"), 14, 0, 0.8)
    for i in range(6):
        s.on_prefill_done(f"short{i}", NodeId("p1"), 14, 0, 0.05)
    for prompt in (1_377, 3_600, 8_000):
        req = request(prompt=prompt, ttft_s=30.0, tbt_s=0.2, rid=f"long{prompt}")
        assert isinstance(s.schedule(req, fleet, NOW), Placement), prompt


def test_an_idle_node_never_refuses_on_ttft() -> None:
    """A prompt slower than its SLO even on an idle node is served when the node is idle."""
    s = Scheduler(config())
    fleet = [node("p1"), node("d1", "decode")]
    assert isinstance(s.schedule(request(prompt=20_001, ttft_s=5.0), fleet, NOW), Placement)
    busy = [node("p1", queued_prefill_tokens=3_000), node("d1", "decode")]
    r = s.schedule(request(prompt=20_001, ttft_s=5.0), busy, NOW)
    assert isinstance(r, Rejection)
    assert r.reason == "ttft_slo"
    assert r.retry_after_s == pytest.approx(3.0)  # when the queue has drained


def test_admission_refuses_only_on_estimates_with_evidence() -> None:
    """An unmeasured prior far from any observation is a guess: no refusal on it."""
    s = Scheduler(config(priors_measured=False))
    fleet = [node("p1", queued_prefill_tokens=20_000), node("d1", "decode")]
    assert isinstance(s.schedule(request(ttft_s=5.0), fleet, NOW), Placement)
    for i in range(20):  # observations near this request's size
        s.on_prefill_done(f"o{i}", NodeId("p1"), 1025, 0, 1.025)
    r = s.schedule(request(ttft_s=5.0), fleet, NOW)
    assert isinstance(r, Rejection)
    assert r.reason == "ttft_slo"


def test_a_measured_node_prior_replaces_the_configured_one() -> None:
    s = Scheduler(config(priors_measured=False))
    fast = PrefillPrior(fixed_s=0.0, per_token_s=1e-6, per_token_context_s=0.0)
    s.set_measured_priors(NodeId("p1"), fast, None)
    model = s.prefill_model(NodeId("p1"))
    assert model.estimate(1025, 0) == pytest.approx(1025e-6)
    assert model.has_evidence(100_000, 0)
    assert not s.prefill_model(NodeId("p2")).has_evidence(100_000, 0)


# ---------------------------------------------------------------- learned output lengths


def _running_decodes(s: Scheduler, count: int, cap: int) -> None:
    for i in range(count):
        req = request(rid=f"run{i}", max_new=cap)
        p = Placement(
            prefill=NodeId("p1"), decode=NodeId("d1"), prefix_blocks=0, migration=None,
            queue_s=0, prefill_s=0, handoff_s=0, ttft_s=0, tbt_s=0.01,
        )  # fmt: skip
        s.on_assigned(req, p, NOW)
        s.on_decode_started(req.request_id, NodeId("d1"), NOW)


def test_predictive_admission_uses_learned_output_lengths() -> None:
    """Nine decodes with a 10k-token cap: whether they still run when the new prefill ends
    (~1 s, ~100 tokens later) depends on the lengths learned, not on a constant."""
    short = Scheduler(config(output_length_prior_tokens=256.0))
    long_ = Scheduler(config(output_length_prior_tokens=256.0))
    for _ in range(2_000):
        short.output_lengths.observe("", "", 20)  # this workload answers in ~20 tokens
        long_.output_lengths.observe("", "", 5_000)
    for s in (short, long_):
        _running_decodes(s, 9, cap=10_000)
    assert isinstance(short.schedule(request(tbt_s=0.1), FLEET, NOW), Placement)
    r = long_.schedule(request(tbt_s=0.1), FLEET, NOW)
    assert isinstance(r, Rejection)
    assert r.reason == "tbt_slo"


def test_finished_requests_teach_output_lengths_and_caps_are_lower_bounds() -> None:
    s = Scheduler(config(output_length_prior_tokens=50.0))
    for i in range(500):
        req = request(rid=f"f{i}", max_new=100)
        p = placed(s.schedule(req, FLEET, NOW))
        s.on_assigned(req, p, NOW)
        # Every one hit its 100-token cap: the true length is at least 100.
        s.on_finished(req.request_id, p.prefill, p.decode, output_tokens=100, stopped=False)
    assert s.output_lengths.distribution("", "").quantile(0.5) >= 100


def test_a_decode_running_past_its_typical_length_stays_in_the_forecast() -> None:
    s = Scheduler(config(output_length_prior_tokens=256.0))
    for _ in range(2_000):
        s.output_lengths.observe("", "", 20)
    _running_decodes(s, 1, cap=100_000)
    later = NOW + 10.0  # 1,000 tokens in: far past the typical 20
    d1 = node("d1", "decode")
    lengths = s.output_lengths.distribution("", "")
    assert s.forecast(d1, later, later, lengths).requests == 1.0
    assert s.forecast(d1, later + 1.0, later, lengths).requests > 0.0


def test_a_decode_learns_at_the_batch_it_ran_with_not_the_batch_at_its_end() -> None:
    """A mean gap over a decode's life pairs with the batch averaged over that life.

    Regression: pairing it with the batch at the end taught a flat, optimistic decode
    model (a long decode that ran through a burst ends alone), which admitted too much
    at high batch and had decode nodes refuse work after its prefill.
    """
    s = Scheduler(config())
    d1 = NodeId("d1")

    def start(rid: str, at: float, prompt: int = 1025) -> None:
        req = request(rid=rid, prompt=prompt)
        p = placed(s.schedule(req, FLEET, at))
        s.on_assigned(req, replace(p, decode=d1), at)
        s.on_decode_started(rid, d1, at)

    start("long", NOW)
    for i in range(9):  # a burst of nine beside it from +5 s to +6 s
        start(f"b{i}", NOW + 5.0)
    for i in range(9):
        assert s.observe_decode(f"b{i}", d1, 0.02, NOW + 6.0) is not None
        s.on_finished(f"b{i}", NodeId("p1"), d1, now_s=NOW + 6.0)
    learned = s.observe_decode("long", d1, 0.02, NOW + 10.0)
    assert learned is not None
    batch, context = learned
    assert batch == pytest.approx(1.0 + 9 * 1.0 / 10.0)  # not 1 (its end), not 10 (the burst)
    assert context > 1025  # its own prompt plus the burst's share
    # A decode that ran entirely beside another saw a batch of two.
    s = Scheduler(config())  # ``start`` uses the new scheduler from here on
    start("long", NOW)
    start("short", NOW + 5.0)
    learned = s.observe_decode("short", d1, 0.02, NOW + 6.0)
    assert learned is not None
    assert learned[0] == pytest.approx(2.0)
    # A decode that never started teaches nothing.
    req = request(rid="queued")
    s.on_assigned(req, replace(placed(s.schedule(req, FLEET, NOW)), decode=d1), NOW)
    assert s.observe_decode("queued", d1, 0.02, NOW + 1.0) is None


def test_a_queue_predicted_by_a_wrong_prior_shrinks_as_the_model_learns() -> None:
    """Pending prefills are re-estimated when the node's model learns, not kept stale."""
    s = Scheduler(config())
    p1 = NodeId("p1")
    for i in range(4):
        req = request(rid=f"q{i}", prompt=8193)
        s.on_assigned(req, replace(placed(s.schedule(req, FLEET, NOW)), prefill=p1), NOW)
    stale = s.queue_s(node("p1"))
    assert stale == pytest.approx(4 * s.prefill_model(p1).estimate(8193, 0))
    fast_s = stale / 4 / 10  # the engine is 10x faster than the prior says
    for _ in range(16):
        s.on_prefill_done("other", p1, 8193, 0, fast_s)
    learned = s.queue_s(node("p1"))
    assert learned < stale / 5
    assert learned == pytest.approx(4 * s.prefill_model(p1).estimate(8193, 0))


def test_an_affinity_hint_wins_within_its_slack_and_loses_beyond_it() -> None:
    """prompt_cache_key: the key's last node is preferred while its predicted TTFT is
    within the slack of the best node's; never when it costs more than that."""
    s = Scheduler(config())
    slightly_busy = [node("p1"), node("p2", queued_prefill_tokens=20), node("d1", "decode")]
    hinted = replace(request(), affinity=NodeId("p2"), affinity_slack_s=0.05)
    assert placed(s.schedule(request(), slightly_busy, NOW)).prefill == "p1"
    p = placed(s.schedule(hinted, slightly_busy, NOW))
    assert p.prefill == "p2"
    busy = [node("p1"), node("p2", queued_prefill_tokens=5000), node("d1", "decode")]
    assert placed(s.schedule(hinted, busy, NOW)).prefill == "p1"
    gone = replace(hinted, affinity=NodeId("p9"))  # a node no longer in the fleet
    assert placed(s.schedule(gone, slightly_busy, NOW)).prefill == "p1"
