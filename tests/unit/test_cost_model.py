"""Cost model: priors, Eq. (1) numbers for LLaMA3-70B, fitting, monotonicity, transfers."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.core.cost_model import (
    DecodePrior,
    DecodeTimeModel,
    PrefillPrior,
    PrefillTimeModel,
    TransferModel,
)
from conductor.core.prefix_index import NodeId

SRC, DST = NodeId("p0"), NodeId("d0")

# Mooncake Table 1: LLaMA3-70B on 8xA800.
LAYERS, HIDDEN, A_COEF, B_COEF, GQA, ELEM_BYTES = 80, 8192, 4.0, 22.0, 8, 2
PEAK_FLOPS = 8 * 312e12


def paper_flops(n: int) -> float:
    """Eq. (1): flops(n) = l * (a*n^2*d + b*n*d^2)."""
    return LAYERS * (A_COEF * n * n * HIDDEN + B_COEF * n * HIDDEN * HIDDEN)


def prefill_truth(prior: PrefillPrior, total: int, cached: int) -> float:
    uncached = total - cached
    return (
        prior.fixed_s
        + prior.per_token_s * uncached
        + prior.per_token_context_s * uncached * (total + cached)
    )


TRUE_PREFILL = PrefillPrior.from_flops(
    layers=LAYERS, hidden=HIDDEN, peak_flops=PEAK_FLOPS, mfu=0.5, fixed_s=0.02
)


def random_prefills(rng: random.Random, count: int) -> list[tuple[int, int]]:
    out = []
    for _ in range(count):
        total = rng.randint(1, 131_072)
        out.append((total, rng.randint(0, total)))
    return out


# ------------------------------------------------------------------------ priors


@pytest.mark.parametrize(
    ("total", "cached"), [(0, 0), (1, 0), (8192, 0), (8192, 4096), (8192, 8192), (131_072, 7)]
)
def test_prefill_without_observations_is_exactly_the_prior(total: int, cached: int) -> None:
    prior = PrefillPrior(fixed_s=0.015, per_token_s=3.3e-5, per_token_context_s=7.7e-10)
    model = PrefillTimeModel(prior)
    assert model.coefficients is prior
    assert model.estimate(total, cached) == prefill_truth(prior, total, cached)


def test_cached_beyond_total_counts_as_fully_cached() -> None:
    prior = PrefillPrior(fixed_s=0.01, per_token_s=1e-5, per_token_context_s=1e-9)
    model = PrefillTimeModel(prior)
    assert model.estimate(100, 500) == model.estimate(100, 100) == 0.01


def test_from_flops_llama3_70b_matches_the_papers_numbers() -> None:
    """Eq. (1) with Table 1 (LLaMA3-70B, 8xA800) at mfu=1.

    * per-token coefficients: l*b*d^2/G = 47.3 us, l*a*d/G = 1.05 ns;
    * an 8k-token prefill from scratch is 1.14 PFLOP -> 0.458 s at peak (0.92 s at a
      realistic 50% MFU): the linear (MLP/projection) part 0.388 s, attention 0.070 s;
    * Eq. (2), §2.2: recomputing an 8k prefix takes as long as loading its KV
      (p*l*2d/gqa*s = 2.68 GB) at 5.9 GB/s — the paper's "minimum required B of 6 GB/s";
    * §7.4.3: at 128k tokens, a 95% cached prefix cuts prefill time by 91.5% here; the
      paper measured a 92% reduction.
    """
    peak = PrefillPrior.from_flops(layers=LAYERS, hidden=HIDDEN, peak_flops=PEAK_FLOPS, mfu=1.0)
    assert peak.fixed_s == 0.0
    assert peak.per_token_s == pytest.approx(47.3e-6, rel=1e-3)
    assert peak.per_token_context_s == pytest.approx(1.05e-9, rel=1e-3)
    model = PrefillTimeModel(peak)
    full_8k_s = model.estimate(8192, 0)
    assert paper_flops(8192) == pytest.approx(1.143e15, rel=1e-3)
    assert full_8k_s == pytest.approx(paper_flops(8192) / PEAK_FLOPS, rel=1e-12)
    assert full_8k_s == pytest.approx(0.458, abs=1e-3)
    half_mfu = PrefillTimeModel(
        PrefillPrior.from_flops(
            layers=LAYERS, hidden=HIDDEN, peak_flops=PEAK_FLOPS, mfu=0.5, fixed_s=0.0
        )
    )
    assert half_mfu.estimate(8192, 0) == pytest.approx(2 * full_8k_s, rel=1e-12)
    # Cached-prefix savings are exactly flops(n) - flops(p) (§2.2).
    assert model.estimate(8192, 2048) == pytest.approx(
        (paper_flops(8192) - paper_flops(2048)) / PEAK_FLOPS, rel=1e-12
    )
    # Eq. (2) break-even bandwidth for an 8k prefix.
    kv_bytes = 8192 * LAYERS * (2 * HIDDEN / GQA) * ELEM_BYTES
    assert kv_bytes == pytest.approx(2.68e9, rel=1e-2)
    assert kv_bytes / full_8k_s == pytest.approx(6e9, rel=0.05)
    # §7.4.3 / Fig. 22: 128k prompt, 95% prefix cache ratio.
    n = 131_072
    cut = 1 - model.estimate(n, int(0.95 * n)) / model.estimate(n, 0)
    assert cut == pytest.approx(0.92, abs=0.01)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"layers": 0, "hidden": 1, "peak_flops": 1.0, "mfu": 0.5},
        {"layers": 1, "hidden": 1, "peak_flops": 0.0, "mfu": 0.5},
        {"layers": 1, "hidden": 1, "peak_flops": 1.0, "mfu": 0.0},
        {"layers": 1, "hidden": 1, "peak_flops": 1.0, "mfu": 1.5},
        {"layers": 1, "hidden": 1, "peak_flops": math.inf, "mfu": 0.5},
    ],
)
def test_from_flops_rejects_nonsense(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must"):
        PrefillPrior.from_flops(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "coefficients", [(-1.0, 0.0, 0.0), (0.0, math.nan, 0.0), (0.0, 0.0, math.inf)]
)
def test_priors_reject_negative_or_non_finite(coefficients: tuple[float, float, float]) -> None:
    with pytest.raises(ValueError, match="finite"):
        PrefillPrior(*coefficients)
    with pytest.raises(ValueError, match="finite"):
        DecodePrior(*coefficients)


@pytest.mark.parametrize(
    "kwargs", [{"prior_weight": 0.0}, {"prior_weight": -1.0}, {"max_samples": 0}]
)
def test_models_reject_bad_knobs(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must"):
        PrefillTimeModel(TRUE_PREFILL, **kwargs)  # type: ignore[arg-type]


def test_negative_counts_are_rejected() -> None:
    model = PrefillTimeModel(TRUE_PREFILL)
    with pytest.raises(ValueError, match="total_tokens"):
        model.estimate(-1, 0)
    with pytest.raises(ValueError, match="cached_tokens"):
        model.observe(10, -1, 1.0)
    decode = DecodeTimeModel(DecodePrior(0.01, 1e-4, 1e-8))
    with pytest.raises(ValueError, match="batch_requests"):
        decode.estimate(-1, 0)


# ----------------------------------------------------------------------- fitting


@pytest.mark.parametrize("prior_scale", [0.25, 0.5, 2.0, 2.5])
def test_prefill_fit_recovers_coefficients_from_noiseless_data(prior_scale: float) -> None:
    """1024 samples against 8 pseudo-observations: the prior keeps 8/1032 = 0.8% of its
    pull, so a prior off by up to 2.5x leaves < 1.2% error (one 10x off would need ~4k)."""
    prior = PrefillPrior(
        TRUE_PREFILL.fixed_s * prior_scale,
        TRUE_PREFILL.per_token_s * prior_scale,
        TRUE_PREFILL.per_token_context_s * prior_scale,
    )
    model = PrefillTimeModel(prior, prior_weight=8.0, max_samples=1024)
    rng = random.Random(7)
    for total, cached in random_prefills(rng, 1024):
        model.observe(total, cached, prefill_truth(TRUE_PREFILL, total, cached))
    fitted = model.coefficients
    for got, want in zip(
        (fitted.fixed_s, fitted.per_token_s, fitted.per_token_context_s),
        (TRUE_PREFILL.fixed_s, TRUE_PREFILL.per_token_s, TRUE_PREFILL.per_token_context_s),
        strict=True,
    ):
        assert got == pytest.approx(want, rel=0.02)
    for total, cached in random_prefills(rng, 50):
        truth = prefill_truth(TRUE_PREFILL, total, cached)
        assert model.estimate(total, cached) == pytest.approx(truth, rel=0.02, abs=1e-3)


def test_prior_fades_as_samples_arrive() -> None:
    """With few samples the estimate stays near the prior; with many it follows the data."""
    prior = PrefillPrior(0.0, TRUE_PREFILL.per_token_s * 2, TRUE_PREFILL.per_token_context_s * 2)
    model = PrefillTimeModel(prior, prior_weight=8.0, max_samples=256)
    rng = random.Random(3)
    probe = (65_536, 16_384)
    truth = prefill_truth(TRUE_PREFILL, *probe)
    errors = []
    for count in (1, 8, 64, 256):
        while model.sample_count < count:
            total, cached = random_prefills(rng, 1)[0]
            model.observe(total, cached, prefill_truth(TRUE_PREFILL, total, cached))
        errors.append(abs(model.estimate(*probe) / truth - 1))
    assert errors[0] > 0.5  # one sample against 8 pseudo-observations: mostly prior
    assert errors == sorted(errors, reverse=True)
    assert errors[-1] < 0.05  # 256 vs 8: about 8/264 of the prior's 2x error left


def test_prefill_fit_with_noise_predicts_within_a_few_percent() -> None:
    model = PrefillTimeModel(
        PrefillPrior(0.05, TRUE_PREFILL.per_token_s / 2, TRUE_PREFILL.per_token_context_s / 2)
    )
    rng = random.Random(11)
    for total, cached in random_prefills(rng, 256):
        noisy = prefill_truth(TRUE_PREFILL, total, cached) * (1 + rng.gauss(0, 0.05))
        model.observe(total, cached, max(noisy, 0.0))
    ratios = sorted(
        model.estimate(total, cached) / prefill_truth(TRUE_PREFILL, total, cached)
        for total, cached in random_prefills(rng, 200)
        if total - cached > 1024
    )
    median = ratios[len(ratios) // 2]
    assert median == pytest.approx(1.0, abs=0.03)
    assert all(0.85 < r < 1.15 for r in ratios)


def test_ring_forgets_old_regime() -> None:
    """Only the last ``max_samples`` observations count: the fit follows a slowdown."""
    model = PrefillTimeModel(TRUE_PREFILL, max_samples=64)
    rng = random.Random(5)
    slow = PrefillPrior(0.02, TRUE_PREFILL.per_token_s * 3, TRUE_PREFILL.per_token_context_s * 3)
    for total, cached in random_prefills(rng, 64):
        model.observe(total, cached, prefill_truth(TRUE_PREFILL, total, cached))
    for total, cached in random_prefills(rng, 64):
        model.observe(total, cached, prefill_truth(slow, total, cached))
    assert model.sample_count == 64
    probe = prefill_truth(slow, 32_768, 0)
    # The prior (the old regime) still holds 8/(64+8) of its pull.
    assert model.estimate(32_768, 0) == pytest.approx(probe, rel=0.25)
    assert model.estimate(32_768, 0) > 2 * prefill_truth(TRUE_PREFILL, 32_768, 0)


def test_non_finite_or_negative_durations_are_ignored() -> None:
    model = PrefillTimeModel(TRUE_PREFILL)
    for duration in (math.nan, math.inf, -1.0):
        model.observe(100, 0, duration)
    assert model.sample_count == 0
    assert model.coefficients is TRUE_PREFILL


def test_fit_clamps_coefficients_and_stays_monotone_on_adversarial_data() -> None:
    """Durations that *fall* with uncached tokens would give a negative slope: clamped."""
    model = PrefillTimeModel(PrefillPrior(0.0, 1e-6, 1e-12), prior_weight=0.01)
    for uncached in range(0, 10_000, 100):
        model.observe(10_000, 10_000 - uncached, 5.0 - uncached * 4e-4)
    coefficients = model.coefficients
    assert min(coefficients.fixed_s, coefficients.per_token_s) >= 0
    assert coefficients.per_token_context_s >= 0
    estimates = [model.estimate(10_000, 10_000 - u) for u in range(0, 10_001, 250)]
    assert estimates == sorted(estimates)
    assert all(e >= 0 for e in estimates)


@settings(max_examples=60, deadline=None)
@given(
    observations=st.lists(
        st.tuples(
            st.integers(0, 200_000),
            st.integers(0, 200_000),
            st.floats(0, 1e4, allow_nan=False),
        ),
        max_size=40,
    ),
    total=st.integers(0, 10**9),
)
def test_prefill_estimate_is_monotone_in_uncached_tokens(
    observations: list[tuple[int, int, float]], total: int
) -> None:
    model = PrefillTimeModel(TRUE_PREFILL, prior_weight=1.0)
    for n, p, duration_s in observations:
        model.observe(n, p, duration_s)
    previous = -1.0
    for fraction in (1.0, 0.9, 0.5, 0.25, 0.1, 0.0):  # cached share falls: more uncached
        estimate = model.estimate(total, int(total * fraction))
        assert math.isfinite(estimate)
        assert estimate >= previous
        previous = estimate


@settings(max_examples=80, deadline=None)
@given(
    observations=st.lists(
        st.tuples(
            st.integers(0, 10**7),
            st.integers(0, 10**7),
            st.floats(0, 1e6, allow_nan=False),
        ),
        max_size=20,
    ),
    a=st.integers(0, 10**12),
    b=st.integers(0, 10**12),
)
def test_estimates_are_finite_and_non_negative(
    observations: list[tuple[int, int, float]], a: int, b: int
) -> None:
    prefill = PrefillTimeModel(TRUE_PREFILL)
    decode = DecodeTimeModel(DecodePrior(0.02, 1e-4, 1e-8))
    transfer = TransferModel(10e9, 1e-3)
    for x, y, t in observations:
        prefill.observe(x, y, t)
        decode.observe(x, y, t)
        transfer.observe(SRC, DST, x, t)
    for value in (
        prefill.estimate(a, b),
        decode.estimate(a, b),
        transfer.estimate(SRC, DST, a),
        transfer.estimate(DST, SRC, b),
    ):
        assert math.isfinite(value)
        assert value >= 0


# ------------------------------------------------------------------------ decode

TRUE_DECODE = DecodePrior(fixed_s=0.012, per_request_s=1.5e-4, per_context_token_s=2.0e-8)


def decode_truth(prior: DecodePrior, batch: int, context: int) -> float:
    return prior.fixed_s + prior.per_request_s * batch + prior.per_context_token_s * context


def test_decode_prior_only_and_fit() -> None:
    prior = DecodePrior(fixed_s=0.02, per_request_s=3e-4, per_context_token_s=4e-8)
    model = DecodeTimeModel(prior, max_samples=1024)
    assert model.coefficients is prior
    assert model.estimate(32, 100_000) == decode_truth(prior, 32, 100_000)
    rng = random.Random(2)
    for _ in range(1024):
        batch = rng.randint(1, 256)
        context = batch * rng.randint(100, 8000)
        model.observe(batch, context, decode_truth(TRUE_DECODE, batch, context))
    fitted = model.coefficients
    assert fitted.fixed_s == pytest.approx(TRUE_DECODE.fixed_s, rel=0.02)
    assert fitted.per_request_s == pytest.approx(TRUE_DECODE.per_request_s, rel=0.02)
    assert fitted.per_context_token_s == pytest.approx(TRUE_DECODE.per_context_token_s, rel=0.02)
    estimates = [model.estimate(b, b * 2000) for b in range(0, 300, 10)]
    assert estimates == sorted(estimates)


def test_decode_ignores_bad_observations() -> None:
    model = DecodeTimeModel(TRUE_DECODE)
    model.observe(4, 100, math.nan)
    model.observe(4, 100, -0.5)
    assert model.sample_count == 0


# ---------------------------------------------------------------------- transfer


def test_transfer_defaults_for_unknown_pairs() -> None:
    model = TransferModel(default_bandwidth_bytes_per_s=12.5e9, default_latency_s=0.002)
    assert model.estimate(SRC, DST, 0) == 0.002
    assert model.estimate(SRC, DST, 12_500_000_000) == pytest.approx(1.002)
    assert model.estimate(SRC, DST, -5) == 0.002
    assert model.bandwidth_bytes_per_s(SRC, DST) == pytest.approx(12.5e9)
    assert model.latency_s(SRC, DST) == 0.002


@pytest.mark.parametrize(
    ("default_bw", "default_latency_s"),
    [(1e9, 0.0), (100e9, 0.0), (10e9, 0.1), (1e12, 1e-5)],
)
def test_transfer_converges_to_true_latency_and_bandwidth(
    default_bw: float, default_latency_s: float
) -> None:
    true_bw, true_latency_s = 10e9, 0.002
    model = TransferModel(default_bw, default_latency_s, alpha=0.2)
    rng = random.Random(1)
    for _ in range(200):
        nbytes = 2 ** rng.randint(10, 31)
        model.observe(SRC, DST, nbytes, true_latency_s + nbytes / true_bw)
    assert model.bandwidth_bytes_per_s(SRC, DST) == pytest.approx(true_bw, rel=0.01)
    assert model.latency_s(SRC, DST) == pytest.approx(true_latency_s, rel=0.01)
    assert model.estimate(SRC, DST, 2_680_000_000) == pytest.approx(0.270, rel=0.01)
    # Direction matters: the reverse pair was never observed.
    assert model.bandwidth_bytes_per_s(DST, SRC) == pytest.approx(default_bw)


def test_transfer_tracks_a_slowdown_with_noise() -> None:
    model = TransferModel(10e9, 0.001, alpha=0.2)
    rng = random.Random(4)
    for bw in (10e9, 2e9):  # congestion: the link drops to a fifth
        for _ in range(60):
            nbytes = rng.choice([1 << 20, 1 << 26, 1 << 30])
            model.observe(SRC, DST, nbytes, (0.001 + nbytes / bw) * (1 + rng.gauss(0, 0.02)))
    assert model.bandwidth_bytes_per_s(SRC, DST) == pytest.approx(2e9, rel=0.1)
    assert model.estimate(SRC, DST, 1 << 30) == pytest.approx(0.001 + (1 << 30) / 2e9, rel=0.05)


def test_transfer_with_one_size_predicts_that_size() -> None:
    model = TransferModel(1e9, 0.0)
    for _ in range(30):
        model.observe(SRC, DST, 1 << 28, 0.05)  # the default says 0.27 s
    assert model.estimate(SRC, DST, 1 << 28) == pytest.approx(0.05, rel=5e-3)


@pytest.mark.parametrize(
    ("nbytes", "duration_s"), [(0, 1.0), (-10, 1.0), (100, 0.0), (100, -1.0), (100, math.nan)]
)
def test_transfer_ignores_degenerate_observations(nbytes: int, duration_s: float) -> None:
    model = TransferModel(1e9, 0.001)
    model.observe(SRC, DST, nbytes, duration_s)
    assert model.estimate(SRC, DST, 1_000_000) == pytest.approx(0.002)


def test_transfer_bounds_pairs_and_forgets_nodes() -> None:
    model = TransferModel(1e9, 0.0, max_pairs=2)
    nodes = [NodeId(f"n{i}") for i in range(3)]
    model.observe(nodes[0], nodes[1], 1000, 1.0)
    model.observe(nodes[1], nodes[2], 1000, 1.0)
    model.observe(nodes[0], nodes[1], 1000, 1.0)  # refreshes (n0, n1)
    model.observe(nodes[2], nodes[0], 1000, 1.0)  # evicts (n1, n2)
    assert model.estimate(nodes[1], nodes[2], 1000) == pytest.approx(1e-6)
    assert model.estimate(nodes[0], nodes[1], 1000) > 0.5
    model.forget_node(nodes[0])
    assert model.estimate(nodes[0], nodes[1], 1000) == pytest.approx(1e-6)
    assert model.estimate(nodes[2], nodes[0], 1000) == pytest.approx(1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"default_bandwidth_bytes_per_s": 0.0, "default_latency_s": 0.0},
        {"default_bandwidth_bytes_per_s": 1.0, "default_latency_s": -1.0},
        {"default_bandwidth_bytes_per_s": 1.0, "default_latency_s": 0.0, "alpha": 0.0},
        {"default_bandwidth_bytes_per_s": 1.0, "default_latency_s": 0.0, "max_pairs": 0},
    ],
)
def test_transfer_rejects_bad_knobs(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must"):
        TransferModel(**kwargs)  # type: ignore[arg-type]
