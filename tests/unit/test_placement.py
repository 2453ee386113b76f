"""The shared placement loop, step by step (pure: a fake clock, no I/O)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conductor.core.placement import (
    FailureKind,
    InflightPrefixes,
    PlacementLoop,
    Refusal,
    RequestPlacement,
    Wait,
    fleet_view,
)
from conductor.core.policies import Policy
from conductor.core.prefix_index import NodeId
from conductor.core.scheduler import (
    Admission,
    Placement,
    Scheduler,
    ScheduleRequest,
    Slo,
)
from kvc.block_keys import BlockKey
from tests.scheduling_helpers import make_node, round_number_config

NOW = 100.0
KEYS = tuple(BlockKey(k) for k in range(1, 33))


def loop(**kw: object) -> PlacementLoop:
    max_waiting = int(kw.pop("max_waiting", 8))  # type: ignore[call-overload]
    return PlacementLoop(Scheduler(round_number_config(**kw)), max_waiting=max_waiting)


def node(name: str, role: str = "prefill", **kw: object) -> object:
    return make_node(name, role, block_size=32, kv_bytes_per_token=1000, **kw)


def request(rid: str = "r", prefix: dict[str, int] | None = None, **kw: object) -> ScheduleRequest:
    base = ScheduleRequest(
        request_id=rid,
        prompt_tokens=1025,
        prefix_blocks={NodeId(k): v for k, v in (prefix or {}).items()},
        max_new_tokens=100,
        slo=Slo(ttft_s=30.0, tbt_s=1.0),
    )
    return replace(base, **kw)  # type: ignore[arg-type]


FLEET = [node("p1"), node("p2"), node("d1", "decode")]


def test_a_capacity_refusal_excludes_the_node_and_the_loop_reschedules() -> None:
    lp = loop()
    rp = lp.begin(request(prefix={"p1": 10}), KEYS, NOW)
    first = rp.decide(FLEET, NOW)  # type: ignore[arg-type]
    assert isinstance(first, Placement)
    assert first.prefill == "p1"
    rp.failed(first.prefill, FailureKind.CAPACITY)
    assert lp.scheduler.queue_s(FLEET[0]) == 0.0  # type: ignore[arg-type]
    second = rp.decide(FLEET, NOW)  # type: ignore[arg-type]
    assert isinstance(second, Placement)
    assert second.prefill == "p2"
    rp.failed(second.prefill, FailureKind.BUSY)
    last = rp.decide(FLEET, NOW)  # type: ignore[arg-type]
    assert isinstance(last, Refusal)
    assert last.reason == "exhausted"
    assert last.last_failure == (NodeId("p2"), FailureKind.BUSY)
    rp.finished()
    assert lp.scheduler.active_decodes(NodeId("d1"), NOW + 100) == (0, 0)


def test_a_pulls_lend_is_booked_on_its_holder_until_the_pull_ends() -> None:
    """Whichever way the request goes on — the pull ends, the node refuses, the request
    ends before the pull does — the lend it booked on the holder is released once."""
    fleet = [
        node("p1", kv_family="vllm", lend_wait="running"),
        node("p2", kv_family="vllm", lend_wait="running"),
        node("d1", "decode"),
    ]
    holder = fleet[1]

    def busy_holder(lp: PlacementLoop) -> None:
        """A short prefill runs on the holder, a long one waits behind it."""
        for rid, tokens in (("a", 200), ("b", 4800)):
            rp = lp.begin(request(rid, prompt_tokens=tokens), KEYS, NOW)
            assert isinstance(rp.decide([holder, fleet[2]], NOW), Placement)  # type: ignore[list-item]

    def placed_pull(lp: PlacementLoop, rid: str) -> RequestPlacement:
        rp = lp.begin(request(rid, prefix={"p2": 30}), KEYS, NOW)
        step = rp.decide(fleet, NOW)  # type: ignore[arg-type]
        assert isinstance(step, Placement)
        assert step.migration is not None
        assert step.migration.source == "p2"
        assert step.migration.lend_s > 0
        return rp

    for end in ("pulled", "failed", "finished"):
        lp = loop(policy=Policy.KV_CENTRIC)
        busy_holder(lp)
        before = lp.scheduler.queue_s(holder)  # type: ignore[arg-type]
        rp = placed_pull(lp, end)
        lend_s = lp.scheduler.lend_s(holder)  # type: ignore[arg-type]
        assert lp.scheduler.queue_s(holder) == pytest.approx(before + lend_s)  # type: ignore[arg-type]
        if end == "pulled":
            rp.pulled()
        elif end == "failed":
            rp.failed(NodeId("p1"), FailureKind.UNREACHABLE)
        rp.finished()
        rp.pulled()
        assert lp.scheduler.queue_s(holder) == pytest.approx(before)  # type: ignore[arg-type]


def test_no_usable_node_is_unavailable() -> None:
    rp = loop().begin(request(), KEYS, NOW)
    fleet = [node("p1", healthy=False), node("d1", "decode", healthy=False)]
    refusal = rp.decide(fleet, NOW)  # type: ignore[arg-type]
    assert isinstance(refusal, Refusal)
    assert refusal.reason == "unavailable"


def test_a_role_with_no_usable_node_is_unavailable_not_a_wait() -> None:
    """Prefill nodes up, every decode node down: there is no capacity to wait for."""
    for fleet in (
        [node("p1"), node("d1", "decode", healthy=False)],
        [node("p1", healthy=False), node("d1", "decode")],
    ):
        rp = loop().begin(request(), KEYS, NOW)
        refusal = rp.decide(fleet, NOW)  # type: ignore[arg-type]
        assert isinstance(refusal, Refusal)
        assert refusal.reason == "unavailable"


def _busy_decode(lp: PlacementLoop, count: int, ends_after_s: float) -> None:
    """``count`` decodes on d1 running now that stop ``ends_after_s`` from now."""
    for i in range(count):
        step_s = 0.01
        req = request(rid=f"busy{i}", max_new_tokens=round(ends_after_s / step_s))
        p = Placement(
            prefill=NodeId("p1"), decode=NodeId("d1"), prefix_blocks=0, migration=None,
            queue_s=0, prefill_s=0, handoff_s=0, ttft_s=0, tbt_s=step_s,
        )  # fmt: skip
        lp.scheduler.on_assigned(req, p, NOW)
        lp.scheduler.on_decode_started(req.request_id, NodeId("d1"), NOW)


def test_a_request_waits_when_waiting_still_meets_its_slo_then_is_placed() -> None:
    lp = loop(admission=Admission.PREDICTIVE)
    _busy_decode(lp, 9, ends_after_s=3.0)  # TBT 0.11 s until they end
    rp = lp.begin(request(slo=Slo(ttft_s=30.0, tbt_s=0.1)), KEYS, NOW)
    step = rp.decide(FLEET, NOW)  # type: ignore[arg-type]
    assert isinstance(step, Wait)
    assert step.rejection.reason == "tbt_slo"
    assert NOW + 1.0 < step.until_s <= NOW + 5.0
    assert lp.waiting == 1
    later = rp.decide(FLEET, step.until_s)  # type: ignore[arg-type]
    assert isinstance(later, Placement)
    assert lp.waiting == 0


def test_waiting_is_bounded_and_never_for_a_ttft_refusal() -> None:
    lp = loop(admission=Admission.PREDICTIVE, max_waiting=1)
    _busy_decode(lp, 9, ends_after_s=3.0)
    first = lp.begin(request(rid="a", slo=Slo(ttft_s=30.0, tbt_s=0.1)), KEYS, NOW)
    assert isinstance(first.decide(FLEET, NOW), Wait)  # type: ignore[arg-type]
    second = lp.begin(request(rid="b", slo=Slo(ttft_s=30.0, tbt_s=0.1)), KEYS, NOW)
    refused = second.decide(FLEET, NOW)  # type: ignore[arg-type]
    assert isinstance(refused, Refusal)
    assert refused.reason == "tbt_slo"
    assert refused.queue_full  # it would have waited: the log says the queue was full
    first.finished()  # cancelled while waiting: its place in the queue is free again
    assert lp.waiting == 0
    # A TTFT refusal: waiting would not shorten the queue it waits for.
    busy = [node("p1", queued_prefill_tokens=40_000), node("d1", "decode")]
    third = lp.begin(request(rid="c", slo=Slo(ttft_s=5.0, tbt_s=1.0)), KEYS, NOW)
    refused = third.decide(busy, NOW)  # type: ignore[arg-type]
    assert isinstance(refused, Refusal)
    assert refused.reason == "ttft_slo"
    assert not refused.queue_full


def test_time_waited_counts_against_the_ttft_slo() -> None:
    lp = loop(admission=Admission.PREDICTIVE)
    _busy_decode(lp, 9, ends_after_s=100.0)  # would take longer than the SLO allows
    rp = lp.begin(request(slo=Slo(ttft_s=10.0, tbt_s=0.1)), KEYS, NOW)
    refused = rp.decide(FLEET, NOW)  # type: ignore[arg-type]
    assert isinstance(refused, Refusal)
    assert refused.reason == "tbt_slo"
    assert lp.waiting == 0


def test_inflight_prefixes_follow_allocate_commit_and_finish() -> None:
    lp = loop(policy=Policy.KV_ADAPTIVE)
    rp = lp.begin(request(), KEYS, NOW)
    placement = rp.decide(FLEET, NOW)  # type: ignore[arg-type]
    assert isinstance(placement, Placement)
    rp.allocated()
    assert lp.inflight.pending(KEYS, {}) == {placement.prefill: len(KEYS)}
    # A second request with the same prompt sees the prefix being computed there
    # (waiting for it ties with recomputing on an idle node, so p2 is made busy).
    other = lp.begin(request(rid="twin"), KEYS, NOW)
    busy_p2 = [node("p1"), node("p2", queued_prefill_tokens=2_000), node("d1", "decode")]
    again = other.decide(busy_p2, NOW)  # type: ignore[arg-type]
    assert isinstance(again, Placement)
    assert again.prefill == placement.prefill
    assert again.prefix_blocks == len(KEYS)
    rp.committed()
    assert lp.inflight.pending(KEYS, {}) == {}
    rp.finished(40, stopped=True)
    rp.finished(40, stopped=True)  # idempotent
    other.finished()
    assert len(lp.inflight) == 0


def test_would_have_hit_counts_the_recomputed_prefix_another_node_held() -> None:
    lp = loop(policy=Policy.LOCAL_PREFIX)
    fleet = [node("p1"), node("p2", queued_prefill_tokens=50_000), node("d1", "decode")]
    rp = lp.begin(request(prefix={"p2": 20}), KEYS, NOW)
    placement = rp.decide(fleet, NOW)  # type: ignore[arg-type]
    assert isinstance(placement, Placement)
    assert placement.prefill == "p1"
    assert rp.would_have_hit_blocks == 20


def test_inflight_counts_are_reference_counted() -> None:
    inflight = InflightPrefixes()
    a = NodeId("a")
    inflight.add(a, KEYS[:3])
    inflight.add(a, KEYS[:2])
    assert inflight.pending(KEYS, {}) == {a: 3}
    assert inflight.pending(KEYS, {a: 5}) == {a: 5}  # cached prefix, then in flight
    inflight.remove(a, KEYS[:3])
    assert inflight.pending(KEYS, {}) == {a: 2}
    inflight.remove(a, KEYS[:2])
    assert len(inflight) == 0


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [((32, 32), 32), ((16, 32), 16), ((), None)],
)
def test_fleet_view_picks_the_smallest_block_size_and_excludes(
    sizes: tuple[int, ...], expected: int | None
) -> None:
    fleet = [
        make_node(f"n{i}", "both", block_size=b, kv_bytes_per_token=1) for i, b in enumerate(sizes)
    ]
    block_size, view = fleet_view(fleet, frozenset({NodeId("n9")}))
    assert block_size == expected
    assert [n.healthy for n in view] == [n.block_size == expected for n in fleet]
    _, without = fleet_view(fleet, frozenset({NodeId("n0")}))
    assert NodeId("n0") not in {n.node_id for n in without}
