"""The scheduler additions the simulator compares: ``kv_adaptive`` and ``prefill_only``.

Same round numbers as tests/unit/test_scheduler.py: 1 ms per uncached token, 1 GB/s,
1000 B of KV per token, 32-token blocks.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from conductor.core.policies import Policy
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
from kvc.priors import DecodePrior, PrefillPrior
from tests.scheduling_helpers import make_node

BS = 32
NOW = 10.0


def config(**kw: object) -> SchedulerConfig:
    base = SchedulerConfig(
        policy=Policy.KV_ADAPTIVE,
        admission=Admission.NONE,
        prefill_prior=PrefillPrior(fixed_s=0.0, per_token_s=0.001, per_token_context_s=0.0),
        decode_prior=DecodePrior(fixed_s=0.01, per_request_s=0.01, per_context_token_s=0.0),
        transfer_bandwidth_bytes_per_s=1e9,
        transfer_latency_s=0.0,
        priors_measured=True,  # as if calibrated: admission may act on the priors
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def node(name: str, role: str = "prefill", **kw: object) -> NodeState:
    return make_node(name, role, block_size=BS, kv_bytes_per_token=1000, **kw)


def request(
    prefix: dict[str, int], pending: dict[str, int] | None = None, tbt_s: float = 1.0
) -> ScheduleRequest:
    return ScheduleRequest(
        request_id="r",
        prompt_tokens=1025,
        prefix_blocks={NodeId(k): v for k, v in prefix.items()},
        max_new_tokens=100,
        slo=Slo(ttft_s=30.0, tbt_s=tbt_s),
        pending_blocks={NodeId(k): v for k, v in (pending or {}).items()},
    )


def placed(decision: Placement | Rejection) -> Placement:
    assert isinstance(decision, Placement), decision
    return decision


def test_break_even_pulls_when_the_transfer_beats_recomputing_below_the_threshold() -> None:
    """p1 holds 20 blocks, p2 (busy) 30: 30/20 = 1.5 <= 2, so kv_centric recomputes 10
    blocks (0.32 s); pulling them takes 0.32 MB at 1 GB/s = 0.3 ms: kv_adaptive pulls."""
    fleet = [node("p1"), node("p2", queued_prefill_tokens=5000), node("d1", "decode")]
    req = request({"p1": 20, "p2": 30})
    assert (
        placed(Scheduler(config(policy=Policy.KV_CENTRIC)).schedule(req, fleet, NOW)).migration
        is None
    )
    p = placed(Scheduler(config()).schedule(req, fleet, NOW))
    assert p.prefill == "p1"
    assert p.migration is not None
    assert p.migration.source == "p2"
    assert p.prefix_blocks == 30
    assert p.prefill_s == pytest.approx(0.065)


def test_break_even_recomputes_when_the_link_is_too_slow() -> None:
    """At 1 MB/s the same 10 blocks take 0.32 s to pull + 0.065 s > 0.385 s to compute."""
    fleet = [node("p1"), node("p2", queued_prefill_tokens=5000), node("d1", "decode")]
    p = placed(
        Scheduler(config(transfer_bandwidth_bytes_per_s=1e6)).schedule(
            request({"p1": 20, "p2": 30}), fleet, NOW
        )
    )
    assert p.prefill == "p1"
    assert p.migration is None
    assert p.prefix_blocks == 20


def test_blocks_being_computed_on_a_node_count_as_its_prefix() -> None:
    """Nobody has committed the prefix, but p2's queue is computing 30 of its blocks: a
    FIFO prefill behind them finds them cached. kv_centric sees nothing and goes to p1."""
    fleet = [node("p1"), node("p2", queued_prefill_tokens=500), node("d1", "decode")]
    req = request({}, pending={"p2": 30})
    blind = placed(Scheduler(config(policy=Policy.KV_CENTRIC)).schedule(req, fleet, NOW))
    assert blind.prefill == "p1"
    assert blind.prefix_blocks == 0
    p = placed(Scheduler(config()).schedule(req, fleet, NOW))
    assert p.prefill == "p2"  # 0.5 s queue + 0.065 s < 1.025 s from scratch
    assert p.prefix_blocks == 30
    assert p.migration is None  # nothing committed to pull from anywhere


def test_prefill_only_admission_checks_ttft_but_leaves_decode_to_the_decode_node() -> None:
    fleet = [node("p1"), node("d1", "decode", running_requests=200)]
    req = request({}, tbt_s=0.05)  # 200 running: predicted TBT ~2 s
    early = Scheduler(config(policy=Policy.KV_CENTRIC, admission=Admission.EARLY))
    rejection = early.schedule(req, fleet, NOW)
    assert isinstance(rejection, Rejection)
    assert rejection.reason == "tbt_slo"
    staged = Scheduler(config(policy=Policy.KV_CENTRIC, admission=Admission.PREFILL_ONLY))
    assert isinstance(staged.schedule(req, fleet, NOW), Placement)
    slow = [node("p1", queued_prefill_tokens=40_000), node("d1", "decode")]
    rejection = staged.schedule(req, slow, NOW)
    assert isinstance(rejection, Rejection)
    assert rejection.reason == "ttft_slo"
