"""The simulator's building blocks: event loop, profile truth, trace files, workloads."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from kvc_sim.engine import EventLoop
from kvc_sim.profile import SimConfigError, bundled_profiles, load_profile
from kvc_sim.trace import (
    TraceError,
    TraceRequest,
    cached_tokens,
    read_trace,
    theoretical_hit_ratio,
    trace_stats,
    write_trace,
)
from kvc_sim.workload import SyntheticSpec, generate

PROFILE = "llama3-70b-8xa800"


def test_event_loop_runs_in_time_order_and_fifo_within_an_instant() -> None:
    loop = EventLoop()
    seen: list[str] = []
    loop.at(2.0, lambda: seen.append("c"))
    loop.at(1.0, lambda: seen.append("a"))
    loop.at(1.0, lambda: seen.append("b"))
    loop.at(1.5, lambda: loop.after(0.0, lambda: seen.append("b2")))
    loop.run()
    assert seen == ["a", "b", "b2", "c"]
    assert loop.now_s == 2.0
    assert loop.events_run == 5


def test_event_loop_never_goes_back_in_time_and_stops_at_until() -> None:
    loop = EventLoop()
    times: list[float] = []
    loop.at(5.0, lambda: loop.at(1.0, lambda: times.append(loop.now_s)))
    loop.at(9.0, lambda: times.append(loop.now_s))
    loop.run(until_s=6.0)
    assert times == [5.0]
    assert loop.now_s == 6.0
    loop.run()
    assert times == [5.0, 9.0]


def test_profile_matches_the_paper_table_1() -> None:
    assert PROFILE in bundled_profiles()
    p = load_profile(PROFILE)
    assert p.kv_bytes_per_token == 320 * 1024  # §2.2: 320 KB per token
    # Eq. (1) for 8k tokens: 1.14 PFLOP -> 0.458 s at 8x312 TFLOPS (cost_model docstring).
    assert p.model.flops(8192) == pytest.approx(1.1425e15, rel=1e-3)
    at_full_mfu = load_profile(PROFILE, {"prefill": {"mfu": 1.0, "chunk_overhead_s": 0.0}})
    assert at_full_mfu.prefill_compute_s(8192, 0) == pytest.approx(0.458, abs=1e-3)
    # Reusing c tokens removes flops(c); chunks add their overhead.
    chunks = math.ceil((8192 - 4096) / p.prefill.chunk_tokens)
    expected = (p.model.flops(8192) - p.model.flops(4096)) / p.prefill_flops_per_s
    assert p.prefill_compute_s(8192, 4096) == pytest.approx(
        expected + chunks * p.prefill.chunk_overhead_s
    )
    assert p.prefill_compute_s(100, 100) == 0.0


def test_profile_priors_are_the_truth_model_for_the_scheduler() -> None:
    p = load_profile(PROFILE)
    prior = p.prefill_prior()
    truth = p.prefill_compute_s(20_000, 5_000) - p.prefill.chunk_overhead_s * 2
    u, n, c = 15_000, 20_000, 5_000
    estimate = prior.per_token_s * u + prior.per_token_context_s * u * (n + c)
    assert estimate == pytest.approx(truth, rel=1e-9)
    assert p.decode_prior().coefficients == (
        p.decode.fixed_s,
        p.decode.per_request_s,
        p.decode.per_context_token_s,
    )


def test_profile_errors_are_reported() -> None:
    with pytest.raises(SimConfigError, match="no profile"):
        load_profile("no-such-profile")
    with pytest.raises(SimConfigError, match="mfu"):
        load_profile(PROFILE, {"prefill": {"mfu": 1.5}})
    with pytest.raises(SimConfigError, match=r"(?i)unexpected"):
        load_profile(PROFILE, {"decode": {"typo_s": 1.0}})


def _line(ts: int, n_in: int, n_out: int, ids: list[int]) -> str:
    return json.dumps(
        {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}
    )


def test_trace_round_trip_sorting_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(_line(2000, 600, 5, [1, 2]) + "\n\n" + _line(1000, 100, 1, [3]) + "\n")
    reqs = read_trace(path)
    assert [r.arrival_s for r in reqs] == [1.0, 2.0]
    assert reqs[1].hash_ids == (1, 2)
    out = tmp_path / "o.jsonl"
    write_trace(out, reqs)

    def fields(r: TraceRequest) -> tuple[float, int, int, tuple[int, ...]]:
        return (r.arrival_s, r.input_tokens, r.output_tokens, r.hash_ids)

    assert [fields(r) for r in read_trace(out)] == [fields(r) for r in reqs]
    assert len(read_trace(path, limit=1)) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(_line(0, 10, 1, [1, 1]) + "\n")
    with pytest.raises(TraceError, match="repeat"):
        read_trace(bad)
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(TraceError, match="line 1"):
        read_trace(bad)


def test_theoretical_hit_ratio_by_hand() -> None:
    reqs = [
        TraceRequest("a", 0.0, 1024, 1, (1, 2)),  # nothing cached
        TraceRequest("b", 1.0, 1500, 1, (1, 2, 3)),  # 2 blocks = 1024 tokens
        TraceRequest("c", 2.0, 1024, 1, (1, 2)),  # fully cached: 1023 (one is computed)
        TraceRequest("d", 3.0, 700, 1, (9, 2)),  # a different first block: no reuse
    ]
    assert cached_tokens(2, 1024, 512) == 1023
    assert theoretical_hit_ratio(reqs) == pytest.approx((0 + 1024 + 1023 + 0) / 4248)


def test_synthetic_workload_is_prefix_chained_poisson_and_deterministic() -> None:
    spec = SyntheticSpec(requests=600, rate_per_s=4.0, seed=3)
    reqs = generate(spec)
    assert reqs == generate(spec)
    assert len(reqs) == 600
    assert all(len(r.hash_ids) == math.ceil(r.input_tokens / 512) for r in reqs)
    # Prefix chaining: an id determines its whole prefix (same id -> same predecessors).
    parent: dict[int, int | None] = {}
    for r in reqs:
        prev: int | None = None
        for h in r.hash_ids:
            assert parent.setdefault(h, prev) == prev
            prev = h
    stats = trace_stats(reqs)
    assert stats.duration_s == pytest.approx(600 / 4.0, rel=0.15)  # Poisson at 4 req/s
    assert 0.3 < stats.theoretical_hit_ratio < 0.9  # shared prompts, sessions, documents
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(reqs)]
    mean = sum(gaps) / len(gaps)
    var = sum((g - mean) ** 2 for g in gaps) / len(gaps)
    assert math.sqrt(var) / mean == pytest.approx(1.0, abs=0.15)  # exponential gaps: CV 1
