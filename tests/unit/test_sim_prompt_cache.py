"""Prompt-cache breakpoints in the simulator: the agentic workload, its trace field, and
the cluster passing breakpoints to the pools as retentions (issue 16)."""

from __future__ import annotations

import csv
import itertools
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from conductor.core.prefix_index import NodeId
from conductor.core.scheduler import Slo
from kvc.block_keys import BlockKey
from kvc_sim.agentic import AgenticSpec, AgenticTurn, generate, generate_turns, hit_ratio_by_kind
from kvc_sim.cluster import Cluster
from kvc_sim.cluster_config import ClusterConfig
from kvc_sim.flight import Flight
from kvc_sim.metrics import RetentionCounts, SimResult
from kvc_sim.profile import Profile, load_profile
from kvc_sim.replay import ReplayOptions, run_scenario
from kvc_sim.scenario import load_scenario
from kvc_sim.trace import TraceError, TraceRequest, read_trace, write_trace
from kvc_sim.workload import SyntheticSpec
from kvc_sim.workload import generate as generate_synthetic
from node_agent.blocks.types import Retention
from tests.unit.test_sim_cluster import check_consistent, sched

SLO = Slo(ttft_s=30.0, tbt_s=0.1)
NODE = NodeId("prefill-00")
BT = 512
SPEC = AgenticSpec(sessions=40, session_rate_per_s=0.5, apps=4, oneshot_rate_per_s=0.2)


def profile() -> Profile:
    return load_profile("llama3-70b-8xa800")


def run(reqs: list[TraceRequest], **config: Any) -> tuple[Cluster, SimResult]:
    p = profile()
    cluster_config = ClusterConfig(
        **{"prefill_instances": 1, "decode_instances": 1, "output_tokens": 1, **config}
    )
    cluster = Cluster(p, cluster_config, sched(p), SLO, reqs)
    return cluster, cluster.run(reqs)


# ------------------------------------------------------------------ the workload


def sessions(turns: list[AgenticTurn]) -> dict[int, list[AgenticTurn]]:
    out: dict[int, list[AgenticTurn]] = {}
    for t in turns:
        if t.kind != "oneshot":
            out.setdefault(t.session, []).append(t)
    return out


def test_the_workload_is_deterministic_by_seed() -> None:
    assert generate_turns(SPEC) == generate_turns(SPEC)
    assert generate(SPEC) == [t.request for t in generate_turns(SPEC)]
    assert generate(replace(SPEC, seed=1)) != generate(SPEC)


def test_the_workload_has_the_documented_structure() -> None:
    turns = generate_turns(SPEC)
    reqs = [t.request for t in turns]
    assert [r.request_id for r in reqs] == [f"a{i:06d}" for i in range(len(reqs))]
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    by_session = sessions(turns)
    assert len(by_session) == SPEC.sessions
    assert {t.kind for t in turns} == {"user", "tool", "oneshot"}
    assert {t.dynamic for t in turns if t.kind != "oneshot"} == {True, False}
    assert [SPEC.is_dynamic(a) for a in range(4)] == [False, False, True, False]  # 3/8 of 4
    statics: dict[int, tuple[int, ...]] = {}
    for session in by_session.values():
        app, first = session[0].app, session[0]
        assert first.kind == "user"
        assert first.turn == 1
        assert [t.turn for t in session] == list(range(1, len(session) + 1))
        assert SPEC.turns[0] <= len(session) <= SPEC.turns[1]
        n_static = first.static_tokens // BT
        for prev, cur in itertools.pairwise(session):
            r0, r1 = prev.request, cur.request
            # The conversation grows by the answer and the new content, after think time.
            if not cur.dynamic:
                assert r1.input_tokens > r0.input_tokens + r0.output_tokens
            gap = r1.arrival_s - r0.arrival_s
            assert gap >= r0.output_tokens * SPEC.answer_s_per_token - 1e-3
            if cur.kind == "user":
                assert gap >= SPEC.user_think_s[0]
            full = r0.input_tokens // BT
            if cur.dynamic:  # only the static prefix is shared: the middle is new
                assert r1.hash_ids[:n_static] == r0.hash_ids[:n_static]
                assert r1.hash_ids[n_static] != r0.hash_ids[n_static]
            else:  # the whole conversation so far is re-sent, block for block
                assert r1.hash_ids[:full] == r0.hash_ids[:full]
        for t in session:  # sessions of one app share system prompt + tools
            assert t.app == app
            static_ids = t.request.hash_ids[:n_static]
            assert statics.setdefault(app, static_ids) == static_ids
            expected = [(n_static, SPEC.static_ttl_s)]
            if not t.dynamic and t.request.input_tokens // BT > n_static:
                expected.append((t.request.input_tokens // BT, SPEC.conversation_ttl_s))
            assert list(t.request.breakpoints) == expected
    seen: dict[int, int] = {}
    for t in turns:
        for h in t.request.hash_ids:
            seen[h] = seen.get(h, 0) + 1
    for t in turns:  # one-shot prompts: no breakpoints, nothing shared
        if t.kind == "oneshot":
            assert t.request.breakpoints == ()
            assert all(seen[h] == 1 for h in t.request.hash_ids)
    # A client that marks the conversation in dynamic apps anyway.
    marked = generate_turns(replace(SPEC, conversation_breakpoint_in_dynamic_apps=True))
    dynamic = [t for t in marked if t.dynamic]
    assert dynamic
    for t in dynamic:
        two = t.request.input_tokens // BT > t.static_tokens // BT
        assert len(t.request.breakpoints) == (2 if two else 1)


def test_spec_errors() -> None:
    with pytest.raises(ValueError, match="sessions"):
        AgenticSpec(sessions=0)
    with pytest.raises(ValueError, match="ranges"):
        AgenticSpec(turns=(3, 2))
    with pytest.raises(ValueError, match="share"):
        AgenticSpec(tool_share=1.5)


# ------------------------------------------------------------------ the trace field


def test_breakpoints_round_trip_and_mooncake_lines_stay_mooncake(tmp_path: Path) -> None:
    reqs = generate(SPEC)[:50]
    path = tmp_path / "a.jsonl"
    write_trace(path, reqs)
    back = read_trace(path)
    assert [(r.arrival_s, r.hash_ids, r.breakpoints) for r in back] == [
        (r.arrival_s, r.hash_ids, r.breakpoints) for r in reqs
    ]
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row, r in zip(rows, reqs, strict=True):
        assert ("breakpoints" in row) == bool(r.breakpoints)
    plain = generate_synthetic(SyntheticSpec(requests=5))
    write_trace(path, plain)
    assert all(
        set(json.loads(line)) == {"timestamp", "input_length", "output_length", "hash_ids"}
        for line in path.read_text().splitlines()
    )
    assert all(r.breakpoints == () for r in read_trace(path))


@pytest.mark.parametrize(
    ("breakpoints", "match"),
    [
        ({"a": 1}, "list"),
        ([[1]], "blocks, ttl_s"),
        ([[0, 300]], "blocks must lie"),
        ([[3, 300]], "blocks must lie"),
        ([[True, 300]], "blocks must lie"),
        ([[1, 0]], "ttl_s"),
        ([[1, "300"]], "ttl_s"),
    ],
)
def test_malformed_breakpoints_are_trace_errors(
    tmp_path: Path, breakpoints: object, match: str
) -> None:
    path = tmp_path / "bad.jsonl"
    row = {"timestamp": 0, "input_length": 900, "output_length": 1, "hash_ids": [1, 2]}
    path.write_text(json.dumps({**row, "breakpoints": breakpoints}) + "\n")
    with pytest.raises(TraceError, match=match):
        read_trace(path)


# ------------------------------------------------------------------ the simulator


def flood_then_return(breakpoint_blocks: int = 6) -> list[TraceRequest]:
    """A session request (10 blocks, a 1-hour breakpoint after its first 6), a flood of
    ten unique 10-block prompts (100 blocks through a 40-block pool), then the session's
    next request: the same 6-block system prompt and new content."""
    session = tuple(range(10))
    reqs = [TraceRequest("s1", 0.0, 10 * BT, 1, session, ((breakpoint_blocks, 3600.0),))]
    for i in range(10):
        ids = tuple(range(1000 + 10 * i, 1010 + 10 * i))
        reqs.append(TraceRequest(f"f{i:02d}", 10.0 + 10 * i, 10 * BT, 1, ids))
    back = (*session[:6], 2000, 2001, 2002, 2003)
    reqs.append(TraceRequest("s2", 200.0, 10 * BT, 1, back, ((6, 3600.0),)))
    return reqs


def cached_of(result: SimResult, request_id: str) -> int:
    return next(r.cached_tokens for r in result.records if r.request_id == request_id)


def test_breakpoints_keep_the_system_prompt_through_a_flood_that_lru_evicts() -> None:
    reqs = flood_then_return()
    cache = 40 * BT
    lru_cluster, lru = run(reqs, cache_tokens=cache)
    assert lru.retention is None
    assert cached_of(lru, "s2") == 0  # LRU: the flood took the system prompt
    assert lru_cluster.prefill[NODE].evicted_blocks >= 60
    check_consistent(lru_cluster)

    cluster, ttl = run(reqs, cache_tokens=cache, retention=True)
    assert cached_of(ttl, "s2") == 6 * BT  # retained: the system prompt survived
    assert ttl.retention is not None
    assert (ttl.retention.requests, ttl.retention.granted) == (2, 2)
    assert ttl.retention.node_full == ttl.retention.over_budget == 0
    pool = cluster.prefill[NODE].pool
    assert {key for key, _ in pool.retained_keys()} == {BlockKey(h) for h in range(6)}
    assert ttl.retention.retained_ratio_max == pytest.approx(6 / 40)
    # Every request was served; the flood merely ran in the other 34 blocks.
    assert all(r.outcome == "completed" for r in ttl.records)
    check_consistent(cluster)  # BlockRetained left the shadow's stream gap-free


def test_refused_retentions_are_counted_and_cache_nothing_more() -> None:
    reqs = flood_then_return()
    _, capped = run(reqs, cache_tokens=40 * BT, retention=True, max_retained_blocks=4)
    assert capped.retention == RetentionCounts(
        requests=2, granted=0, node_full=2, retained_ratio_mean=0.0, retained_ratio_max=0.0
    )
    assert cached_of(capped, "s2") == 0  # refused: ordinary LRU caching
    _, budget = run(reqs, cache_tokens=40 * BT, retention=True, retention_budget_block_s=3600.0)
    assert budget.retention is not None
    assert (budget.retention.granted, budget.retention.over_budget) == (0, 2)
    # A TTL filter: honour only breakpoints of at least two hours here, i.e. none.
    _, filtered = run(reqs, cache_tokens=40 * BT, retention=True, retention_min_ttl_s=7200)
    assert filtered.retention == RetentionCounts()
    assert cached_of(filtered, "s2") == 0


def test_breakpoints_scale_to_the_pools_blocks_and_ttls_to_its_cap() -> None:
    p = profile()
    req = TraceRequest("x", 0.0, 3 * BT - 100, 1, (1, 2, 3), ((2, 300.0), (3, 7200.0)))
    config = ClusterConfig(
        prefill_instances=1, decode_instances=1, block_tokens=256, retention=True
    )
    cluster = Cluster(p, config, sched(p), SLO, [req])
    inst = cluster.prefill[NODE]
    flight = Flight(req, cluster.keys_of(req), 1)
    assert len(flight.keys) == 6  # the last trace block is partly filled
    assert cluster.retain_of(flight, inst) == (Retention(4, 300.0), Retention(6, 3600.0))
    off = Cluster(p, replace(config, retention=False), sched(p), SLO, [req])
    assert off.retain_of(flight, off.prefill[NODE]) == ()


def test_without_the_flag_breakpoints_change_nothing() -> None:
    """Retention off: a trace with breakpoints replays exactly as without them, and a
    trace without breakpoints replays exactly the same with the flag on."""
    reqs = generate(replace(SPEC, sessions=25))
    bare = [replace(r, breakpoints=()) for r in reqs]
    config: dict[str, Any] = {"prefill_instances": 2, "cache_tokens": 200 * BT}
    _, with_breakpoints = run(reqs, **config)
    _, without = run(bare, **config)
    _, flag_on_bare = run(bare, **config, retention=True)
    _, flag_on = run(reqs, **config, retention=True)
    assert with_breakpoints.records == without.records == flag_on_bare.records
    assert with_breakpoints.samples == without.samples
    assert flag_on_bare.retention == RetentionCounts(
        retained_ratio_mean=0.0, retained_ratio_max=0.0
    )
    assert flag_on.records != without.records  # and on, they do count
    plain = generate_synthetic(SyntheticSpec(requests=120, rate_per_s=2.0, seed=3))
    _, a = run(plain, **config)
    _, b = run(plain, **config, retention=True)
    assert a.records == b.records


def test_the_scenario_reports_retention_and_the_breakdown_splits_by_kind(
    tmp_path: Path,
) -> None:
    scenario = load_scenario("prompt-cache-ttl")
    assert {r.name for r in scenario.runs} >= {"lru_500k", "ttl_500k", "lru_1m", "ttl_1m"}
    small_cluster = {"prefill_instances": 2, "cache_tokens": 200 * BT}
    data = {
        "name": "tiny-ttl", "description": "-", "paper": "-",
        "cluster": {"decode_instances": 1, "output_tokens": 1, **small_cluster},
        "baseline": "lru",
        "runs": [
            {"name": "lru", "policy": "kv_centric"},
            {"name": "ttl", "policy": "kv_centric", "cluster_overrides": {"retention": True}},
        ],
    }  # fmt: skip
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(data))
    turns = generate_turns(replace(SPEC, sessions=15))
    trace = tmp_path / "agentic.jsonl"
    write_trace(trace, [t.request for t in turns])
    out = tmp_path / "out"
    summary = run_scenario(
        load_scenario(str(path)), read_trace(trace), out, ReplayOptions("t", plots=False)
    )
    assert "retention" not in summary["policies"]["lru"]
    counts = summary["policies"]["ttl"]["retention"]
    assert counts["requests"] == counts["granted"] + counts["node_full"] + counts["over_budget"]
    assert counts["requests"] == sum(1 for t in turns if t.request.breakpoints)
    with (out / "requests_ttl.csv").open() as fh:
        ratios = hit_ratio_by_kind(turns, csv.DictReader(fh))
    assert set(ratios) == {"static_app", "dynamic_app", "oneshot"}
    assert ratios["oneshot"] == 0.0
    assert 0 < ratios["dynamic_app"] < ratios["static_app"] < 1
