"""The simulator against closed forms and the trace's published cache figures.

* One prefill instance and no prefix reuse is a single-server FIFO queue: deterministic
  arrivals give TTFT = service time exactly; Poisson arrivals give the Pollaczek-Khinchine
  mean wait ``W = lambda E[S^2] / (2 (1 - rho))`` (M/D/1 and M/G/1).
* One decode instance with one request is a sum of known step times.
* With an unbounded cache the hit ratio is the trace's theoretical maximum (65.1% of the
  input tokens of ../shared/traces/synthetic_trace.jsonl); with one LRU cache of 3M/10M
  tokens it is the REFERENCE.md figures 31.5%/57.7%.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from conductor.core.policies import Policy
from conductor.core.scheduler import Admission, SchedulerConfig, Slo
from kvc_sim.cluster import simulate
from kvc_sim.cluster_config import ClusterConfig
from kvc_sim.metrics import RequestRecord, SimResult, summarize, top_decile_mean
from kvc_sim.profile import Profile, load_profile
from kvc_sim.trace import TraceRequest, read_trace, theoretical_hit_ratio
from kvc_sim.workload import SyntheticSpec, generate

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO.parent / "shared" / "traces" / "synthetic_trace.jsonl"
SLO = Slo(ttft_s=30.0, tbt_s=0.1)


def profile() -> Profile:
    return load_profile("llama3-70b-8xa800")


def sched(p: Profile, policy: Policy = Policy.KV_CENTRIC) -> SchedulerConfig:
    return SchedulerConfig(
        policy=policy,
        admission=Admission.NONE,
        prefill_prior=p.prefill_prior(),
        decode_prior=p.decode_prior(),
        transfer_bandwidth_bytes_per_s=p.network.nic_bytes_per_s,
        transfer_latency_s=p.network.latency_s,
    )


def unique_requests(arrivals: list[float], lengths: list[int]) -> list[TraceRequest]:
    """Requests sharing no block with each other: no prefix reuse possible."""
    out = []
    next_id = 0
    for i, (t, n) in enumerate(zip(arrivals, lengths, strict=True)):
        blocks = math.ceil(n / 512)
        out.append(TraceRequest(f"q{i:06d}", t, n, 1, tuple(range(next_id, next_id + blocks))))
        next_id += blocks
    return out


def one_prefill(**kw: object) -> ClusterConfig:
    base: dict[str, object] = {
        "prefill_instances": 1,
        "decode_instances": 1,
        "output_tokens": 1,
        "load_sample_s": 1e6,
    }
    base.update(kw)
    return ClusterConfig(**base)  # type: ignore[arg-type]


def served(result: SimResult) -> list[RequestRecord]:
    assert all(r.outcome == "completed" for r in result.records)
    return list(result.records)


def test_deterministic_arrivals_never_queue() -> None:
    p = profile()
    n = 8192
    service = p.prefill_compute_s(n, 0)
    reqs = unique_requests([i * (service + 0.5) for i in range(50)], [n] * 50)
    result = simulate(p, one_prefill(), sched(p), SLO, reqs)
    for record in served(result):
        assert record.ttft_s == pytest.approx(service, rel=1e-9)
        assert record.cached_tokens == 0
        assert record.prefill_s == pytest.approx(service, rel=1e-9)


@pytest.mark.parametrize(
    ("lengths", "probs"),
    [
        ((8192,), (1.0,)),  # M/D/1
        ((4096, 32768), (0.8, 0.2)),  # M/G/1: two prompt sizes
    ],
)
def test_poisson_arrivals_match_lindley_and_pollaczek_khinchine(
    lengths: tuple[int, ...], probs: tuple[float, ...]
) -> None:
    p = profile()
    rho = 0.4
    services = {n: p.prefill_compute_s(n, 0) for n in lengths}
    mean_s = sum(q * services[n] for n, q in zip(lengths, probs, strict=True))
    second = sum(q * services[n] ** 2 for n, q in zip(lengths, probs, strict=True))
    lam = rho / mean_s
    rng = random.Random(7)
    n_req = 4000
    t = 0.0
    arrivals = []
    for _ in range(n_req):
        t += rng.expovariate(lam)
        arrivals.append(t)
    sizes = rng.choices(lengths, weights=probs, k=n_req)
    result = simulate(p, one_prefill(), sched(p), SLO, unique_requests(arrivals, sizes))
    records = served(result)
    # Sample path: Lindley's recursion W[k+1] = max(0, W[k] + S[k] - (A[k+1] - A[k])).
    wait = 0.0
    for k, record in enumerate(records):
        if k:
            gap = arrivals[k] - arrivals[k - 1]
            wait = max(0.0, wait + services[sizes[k - 1]] - gap)
        assert record.ttft_s == pytest.approx(wait + services[sizes[k]], rel=1e-9, abs=1e-9)
    # Mean: Pollaczek-Khinchine, W = lambda E[S^2] / (2 (1 - rho)) (fixed seed; 4000 draws).
    steady = records[200:]
    mean_wait = sum((r.ttft_s or 0.0) - r.prefill_s for r in steady) / len(steady)
    assert mean_wait == pytest.approx(lam * second / (2 * (1 - rho)), rel=0.1)


def test_one_decode_request_is_a_sum_of_step_times() -> None:
    p = profile()
    n, out = 10_000, 21
    req = TraceRequest("solo", 0.0, n, out, tuple(range(math.ceil(n / 512))))
    config = ClusterConfig(prefill_instances=1, decode_instances=1, load_sample_s=1e6)
    (record,) = simulate(p, config, sched(p), SLO, [req]).records
    prefill = p.prefill_compute_s(n, 0)
    assert record.ttft_s == pytest.approx(prefill + p.network.latency_s, rel=1e-9)
    steps = [p.tbt_s(1, n + 1 + i) for i in range(out - 1)]
    assert record.finish_s == pytest.approx(prefill + p.network.latency_s + sum(steps), rel=1e-9)
    assert record.tbt_s == pytest.approx(top_decile_mean(steps), rel=1e-9)
    assert top_decile_mean([1.0, 2.0, 3.0]) == 3.0
    assert top_decile_mean([float(i) for i in range(20)]) == 18.5


def test_unbounded_cache_reaches_the_theoretical_hit_ratio_on_a_synthetic_workload() -> None:
    p = profile()
    reqs = generate(SyntheticSpec(requests=300, rate_per_s=50.0, seed=1))
    want = theoretical_hit_ratio(reqs)
    for block_tokens in (512, 256):
        config = one_prefill(unbounded_cache=True, block_tokens=block_tokens)
        result = simulate(p, config, sched(p), SLO, reqs)
        got = summarize(result, 30.0, 0.1, [0.1]).hit_ratio
        assert got == pytest.approx(want, abs=1e-12)


needs_trace = pytest.mark.skipif(
    not TRACE.exists(), reason=f"the shared Mooncake trace is not checked out at {TRACE}"
)


@needs_trace
def test_unbounded_cache_hit_ratio_on_the_mooncake_trace_is_65_1_percent() -> None:
    p = profile()
    reqs = read_trace(TRACE)
    assert len(reqs) == 3993
    want = theoretical_hit_ratio(reqs)
    assert round(want, 3) == 0.651
    result = simulate(p, one_prefill(unbounded_cache=True), sched(p), SLO, reqs)
    got = summarize(result, 30.0, 0.1, [0.1]).hit_ratio
    assert got == pytest.approx(want, abs=1e-12)


@needs_trace
@pytest.mark.parametrize(("cache_tokens", "want"), [(3_000_000, 0.315), (10_000_000, 0.577)])
def test_one_lru_cache_matches_the_reference_figures(cache_tokens: int, want: float) -> None:
    p = profile()
    reqs = read_trace(TRACE)
    # A slow replay: no queueing, so the cache sees the requests one after another.
    config = one_prefill(cache_tokens=cache_tokens)
    result = simulate(p, config, sched(p), SLO, reqs, speed=0.01)
    got = summarize(result, 30.0, 0.1, [0.1]).hit_ratio
    assert isinstance(got, float)
    assert round(got, 3) == want
