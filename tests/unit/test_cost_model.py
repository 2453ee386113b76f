"""Cost model: priors, Eq. (1) numbers for LLaMA3-70B, learning that stays sane, transfers."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.core.cost_model import DecodeTimeModel, PrefillTimeModel
from conductor.core.prefix_index import NodeId
from conductor.core.transfer_model import TransferModel
from kvc.priors import (
    DecodePrior,
    PrefillPrior,
    decode_features,
    fit_decode_prior,
    fit_prefill_prior,
    prefill_features,
)

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


TRUE_DECODE = DecodePrior(fixed_s=0.012, per_request_s=1.5e-4, per_context_token_s=2.0e-8)


def decode_truth(prior: DecodePrior, batch: float, context: float) -> float:
    return prior.fixed_s + prior.per_request_s * batch + prior.per_context_token_s * context


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


@settings(max_examples=200, deadline=None)
@given(
    total=st.integers(0, 10**9),
    cached=st.integers(0, 10**9),
    batch=st.one_of(st.integers(0, 10**6), st.floats(0, 1e6)),
    context=st.one_of(st.integers(0, 10**12), st.floats(0, 1e12)),
)
def test_prior_estimates_equal_the_features_formula_bit_for_bit(
    total: int, cached: int, batch: float, context: float
) -> None:
    """Without observations an estimate is the prior through the feature functions,
    the same float (what the scheduler's floors and estimates both start from)."""
    prefill = PrefillPrior(fixed_s=0.015, per_token_s=3.3e-5, per_token_context_s=7.7e-10)
    f1, f2 = prefill_features(total, cached)
    expected = prefill.fixed_s + prefill.per_token_s * f1 + prefill.per_token_context_s * f2
    assert PrefillTimeModel(prefill).estimate(total, cached) == expected
    decode = DecodePrior(fixed_s=0.012, per_request_s=1.5e-4, per_context_token_s=2.0e-8)
    b, c = decode_features(batch, context)
    expected = decode.fixed_s + decode.per_request_s * b + decode.per_context_token_s * c
    assert DecodeTimeModel(decode).estimate(batch, context) == expected


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
    "kwargs",
    [
        {"prior_weight": 0.0},
        {"prior_weight": -1.0},
        {"window": 0},
        {"bucket_window": 0},
        {"half_life": 0.0},
    ],
)
def test_models_reject_bad_knobs(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must"):
        PrefillTimeModel(TRUE_PREFILL, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must"):
        DecodeTimeModel(TRUE_DECODE, **kwargs)  # type: ignore[arg-type]


def test_negative_counts_are_rejected() -> None:
    model = PrefillTimeModel(TRUE_PREFILL)
    with pytest.raises(ValueError, match="total_tokens"):
        model.estimate(-1, 0)
    with pytest.raises(ValueError, match="cached_tokens"):
        model.observe(10, -1, 1.0)
    decode = DecodeTimeModel(DecodePrior(0.01, 1e-4, 1e-8))
    with pytest.raises(ValueError, match="batch_requests"):
        decode.estimate(-1, 0)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -0.5, True, "3"])
def test_bad_decode_amounts_are_rejected(bad: object) -> None:
    """The features' fast path for plain numbers lets nothing else through."""
    decode = DecodeTimeModel(DecodePrior(0.01, 1e-4, 1e-8))
    with pytest.raises(ValueError, match="batch_requests"):
        decode.estimate(bad, 10.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="context_tokens"):
        decode.estimate(2, bad)  # type: ignore[arg-type]
    assert decode.estimate(2, 10) == decode.estimate(2.0, 10.0) > 0


@pytest.mark.parametrize("bad", [-1, 2.0, True, "3"])
def test_bad_prefill_counts_are_rejected(bad: object) -> None:
    model = PrefillTimeModel(TRUE_PREFILL)
    with pytest.raises(ValueError, match="total_tokens"):
        model.estimate(bad, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cached_tokens"):
        model.estimate(100, bad)  # type: ignore[arg-type]


# --------------------------------------------------------- sane learned estimates

DEMO_PRIOR = PrefillPrior(fixed_s=0.002, per_token_s=2e-5, per_token_context_s=1e-9)


def test_one_cold_start_does_not_lock_out_long_prompts() -> None:
    """Issue reproduction: a cold 0.8 s prefill of 14 tokens, then a 1,377-token prompt.

    The old least-squares fit predicted 288 s (and 235 s after six more fast short
    prefills) and admission refused the prompt forever on an idle demo."""
    model = PrefillTimeModel(DEMO_PRIOR)
    assert model.estimate(1377, 0) == pytest.approx(0.0314, rel=2e-3)
    model.observe(14, 0, 0.8)
    after_cold = model.estimate(1377, 0)
    assert 0.02 <= after_cold <= 5.0  # the embedded engine took 1.2 s
    assert not model.has_evidence(1377, 0)
    for _ in range(6):
        model.observe(14, 0, 0.05)
    healed = model.estimate(1377, 0)
    assert 0.02 <= healed <= 3.0
    assert healed <= after_cold
    assert model.estimate(14, 0) == pytest.approx(0.05, rel=0.15)  # the cold start is gone


def test_a_fast_short_prompt_does_not_extrapolate_to_minutes() -> None:
    """After one ``observe(14, 0, 0.05)`` the old fit said 17 s for 1,377 tokens, 577 s
    for 8,000."""
    model = PrefillTimeModel(DEMO_PRIOR)
    model.observe(14, 0, 0.05)
    assert 0.02 <= model.estimate(1377, 0) <= 3.0
    assert 0.1 <= model.estimate(8000, 0) <= 20.0


def _noisy(rng: random.Random, truth: float, sigma: float, outlier_share: float) -> float:
    value = truth * math.exp(rng.gauss(0.0, sigma))
    if rng.random() < outlier_share:
        value *= 20.0  # cold start, page fault, stall
    return value


def _probe_errors(model: PrefillTimeModel, truth: PrefillPrior, rng: random.Random) -> list[float]:
    probes = [(t, c) for t, c in random_prefills(rng, 400) if t - c > 64][:200]
    return sorted(abs(model.estimate(t, c) / prefill_truth(truth, t, c) - 1) for t, c in probes)


@pytest.mark.parametrize("scale", [10.0, 0.1])
def test_a_prior_off_by_10x_converges_despite_noise_and_outliers(scale: float) -> None:
    truth = PrefillPrior(*(c * scale for c in TRUE_PREFILL.coefficients))
    model = PrefillTimeModel(TRUE_PREFILL)
    rng = random.Random(17)
    for count, bound in ((50, 0.20), (200, 0.10)):
        while model.sample_count < count:
            total, cached = random_prefills(rng, 1)[0]
            model.observe(
                total, cached, _noisy(rng, prefill_truth(truth, total, cached), 0.2, 0.05)
            )
        errors = _probe_errors(model, truth, rng)
        assert errors[len(errors) // 2] < bound  # the median probe
        assert errors[int(len(errors) * 0.9)] < 2 * bound  # and nine in ten


def test_a_differently_shaped_engine_is_learned_per_size() -> None:
    """A CPU engine with a 50 ms per-call overhead the prior does not know about: short
    prompts run 10x over the prior, long ones about 1.5x; both are learned."""
    truth = PrefillPrior(0.05, TRUE_PREFILL.per_token_s * 1.5, TRUE_PREFILL.per_token_context_s)
    model = PrefillTimeModel(TRUE_PREFILL)
    rng = random.Random(23)
    for _ in range(400):
        total = int(2 ** rng.uniform(4, 17))
        model.observe(total, 0, _noisy(rng, prefill_truth(truth, total, 0), 0.1, 0.0))
    for total in (32, 256, 2048, 16_384, 100_000):
        assert model.estimate(total, 0) == pytest.approx(prefill_truth(truth, total, 0), rel=0.2)


def test_old_observations_age_out_when_the_engine_slows_down() -> None:
    model = PrefillTimeModel(TRUE_PREFILL)
    rng = random.Random(5)
    slow = PrefillPrior(*(c * 3 for c in TRUE_PREFILL.coefficients))
    for regime in (TRUE_PREFILL, slow):
        for total, cached in random_prefills(rng, 200):
            model.observe(total, cached, prefill_truth(regime, total, cached))
    errors = _probe_errors(model, slow, rng)
    assert errors[len(errors) // 2] < 0.2


def test_evidence_needs_a_measured_prior_or_nearby_observations() -> None:
    model = PrefillTimeModel(DEMO_PRIOR)
    assert not model.has_evidence(1000, 0)
    model.observe(1000, 0, 0.5)
    assert not model.has_evidence(1000, 0)  # one sample may be a cold start
    model.observe(1100, 0, 0.5)
    assert model.has_evidence(1000, 0)
    assert model.has_evidence(2000, 0)  # within 4x of the observed prior time
    assert not model.has_evidence(50_000, 0)
    assert not model.has_evidence(10, 0)
    model.set_prior(DEMO_PRIOR, measured=True)
    assert model.prior_measured
    assert model.sample_count == 0  # a new prior restarts the learned factors
    assert model.has_evidence(50_000, 0)


def test_non_finite_or_non_positive_durations_are_ignored() -> None:
    model = PrefillTimeModel(TRUE_PREFILL)
    for duration in (math.nan, math.inf, -1.0, 0.0):
        model.observe(100, 0, duration)
    assert model.sample_count == 0
    assert model.coefficients is TRUE_PREFILL


def test_coefficients_scale_the_prior_by_the_learned_factor() -> None:
    model = PrefillTimeModel(TRUE_PREFILL)
    assert model.per_token_s == TRUE_PREFILL.per_token_s
    rng = random.Random(9)
    truth = PrefillPrior(*(c * 4 for c in TRUE_PREFILL.coefficients))
    for total, cached in random_prefills(rng, 100):
        model.observe(total, cached, prefill_truth(truth, total, cached))
    for got, want in zip(model.coefficients.coefficients, truth.coefficients, strict=True):
        assert got == pytest.approx(want, rel=0.05)
    assert model.per_token_s == model.coefficients.per_token_s  # the same, not near


def test_estimates_stay_monotone_on_adversarial_data() -> None:
    """Durations that *fall* with uncached tokens: estimates still never decrease."""
    model = PrefillTimeModel(PrefillPrior(0.0, 1e-6, 1e-12))
    for uncached in range(0, 10_000, 100):
        model.observe(10_000, 10_000 - uncached, 5.0 - uncached * 4e-4)
    estimates = [model.estimate(10_000, 10_000 - u) for u in range(0, 10_001, 250)]
    assert estimates == sorted(estimates)
    assert all(e >= 0 for e in estimates)


# ------------------------------------------------------------------ calibration


def test_fit_prefill_prior_recovers_coefficients_from_noiseless_samples() -> None:
    samples = [
        (total, cached, prefill_truth(TRUE_PREFILL, total, cached))
        for total, cached in [(16, 0), (512, 0), (2048, 0), (8192, 0), (8192, 4096), (32_768, 0)]
    ]
    fitted = fit_prefill_prior(samples)
    for got, want in zip(fitted.coefficients, TRUE_PREFILL.coefficients, strict=True):
        assert got == pytest.approx(want, rel=1e-4)


def test_fit_decode_prior_recovers_coefficients_with_noise() -> None:
    rng = random.Random(3)
    samples = []
    for batch in (1, 2, 4, 8, 16, 32):
        for context_per in (256, 4096, 16_384):
            context = batch * context_per
            truth = decode_truth(TRUE_DECODE, batch, context)
            samples.append((float(batch), float(context), truth * (1 + rng.gauss(0, 0.01))))
    fitted = fit_decode_prior(samples)
    for got, want in zip(fitted.coefficients, TRUE_DECODE.coefficients, strict=True):
        assert got == pytest.approx(want, rel=0.1)


def test_fits_refuse_samples_without_a_duration() -> None:
    with pytest.raises(ValueError, match="duration"):
        fit_prefill_prior([(100, 0, 0.0), (200, 0, math.nan)])
    with pytest.raises(ValueError, match="tbt_s"):
        fit_decode_prior([])


# Prefill observations (total, cached, seconds), some of them invalid (ignored).
PREFILL_OBSERVATIONS = st.lists(
    st.tuples(
        st.integers(0, 200_000),
        st.integers(0, 200_000),
        st.floats(0, 1e4, allow_nan=False),
    ),
    max_size=40,
)


@settings(max_examples=80, deadline=None)
@given(observations=PREFILL_OBSERVATIONS, total=st.integers(0, 10**9))
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


@settings(max_examples=150, deadline=None)
@given(
    observations=PREFILL_OBSERVATIONS,
    total=st.integers(0, 10**7),
    cached=st.integers(0, 10**7),
)
def test_the_prefill_floor_is_below_the_estimate_at_every_size(
    observations: list[tuple[int, int, float]], total: int, cached: int
) -> None:
    """The scheduler passes over a node whose floor exceeds the best TTFT found: the
    floor must never exceed the estimate, for this prompt or one with more cached."""
    model = PrefillTimeModel(TRUE_PREFILL, prior_weight=1.0)
    assert model.estimate_floor(total, cached) == model.estimate(total, cached)  # the prior
    for n, p, duration_s in observations:
        model.observe(n, p, duration_s)
    floor = model.estimate_floor(total, cached)
    assert 0 <= floor <= model.estimate(total, cached) * (1 + 1e-12)
    assert floor <= model.estimate(total, max(0, cached - 1000)) * (1 + 1e-12)


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


def test_decode_prior_only_then_learned() -> None:
    prior = DecodePrior(fixed_s=0.02, per_request_s=3e-4, per_context_token_s=4e-8)
    model = DecodeTimeModel(prior)
    assert model.coefficients is prior
    assert model.estimate(32, 100_000) == decode_truth(prior, 32, 100_000)
    assert model.estimate(2.5, 1000.5) == pytest.approx(decode_truth(prior, 2.5, 1000.5))
    rng = random.Random(2)
    for _ in range(300):
        batch = rng.randint(1, 256)
        context = batch * rng.randint(100, 8000)
        model.observe(batch, context, decode_truth(TRUE_DECODE, batch, context))
    for batch in (1, 16, 128):
        truth = decode_truth(TRUE_DECODE, batch, batch * 2000)
        assert model.estimate(batch, batch * 2000) == pytest.approx(truth, rel=0.1)
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


def test_transfer_bounds_pairs() -> None:
    model = TransferModel(1e9, 0.0, max_pairs=2)
    nodes = [NodeId(f"n{i}") for i in range(3)]
    model.observe(nodes[0], nodes[1], 1000, 1.0)
    model.observe(nodes[1], nodes[2], 1000, 1.0)
    model.observe(nodes[0], nodes[1], 1000, 1.0)  # refreshes (n0, n1)
    model.observe(nodes[2], nodes[0], 1000, 1.0)  # evicts (n1, n2)
    assert model.estimate(nodes[1], nodes[2], 1000) == pytest.approx(1e-6)
    assert model.estimate(nodes[0], nodes[1], 1000) > 0.5


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
