"""Output-length model: learning, censoring, prior, drift, tenants, tail, invariants."""

from __future__ import annotations

import dataclasses
import math
import random
from array import array
from collections.abc import Callable
from itertools import pairwise
from statistics import NormalDist

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.core.output_length import (
    MAX_TOKENS,
    TAIL_SURVIVAL,
    LengthDistribution,
    OutputLengthModel,
    SurvivalTable,
)

Sampler = Callable[[random.Random], int]


def geometric(mean: float) -> Sampler:
    p = 1.0 / mean

    def draw(rng: random.Random) -> int:
        return max(1, math.ceil(math.log(1.0 - rng.random()) / math.log(1.0 - p)))

    return draw


def lognormal(median: float, sigma: float) -> Sampler:
    def draw(rng: random.Random) -> int:
        return max(1, round(rng.lognormvariate(math.log(median), sigma)))

    return draw


def bimodal(low: float, high: float) -> Sampler:
    def draw(rng: random.Random) -> int:
        centre = low if rng.random() < 0.5 else high
        return max(1, round(rng.lognormvariate(math.log(centre), 0.15)))

    return draw


def lognormal_quantile(median: float, sigma: float, q: float) -> float:
    return median * math.exp(sigma * NormalDist().inv_cdf(q))


def sample_quantile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def learned(
    draw: Sampler, count: int, *, seed: int = 0, **knobs: float
) -> tuple[OutputLengthModel, list[int]]:
    rng = random.Random(seed)
    model = OutputLengthModel(**knobs)  # type: ignore[arg-type]
    values = [draw(rng) for _ in range(count)]
    for value in values:
        model.observe("m", "t", value)
    return model, values


def close(actual: float, expected: float, rel: float, abs_tokens: float = 1.0) -> bool:
    return abs(actual - expected) <= rel * expected + abs_tokens


# ------------------------------------------------------------------ learning


@pytest.mark.parametrize(
    ("draw", "quantiles"),
    [
        pytest.param(geometric(150), (0.1, 0.25, 0.5, 0.75, 0.9, 0.99), id="geometric-mean-150"),
        pytest.param(lognormal(300, 0.8), (0.1, 0.25, 0.5, 0.75, 0.9, 0.99), id="lognormal"),
        # The median falls in the gap between the modes: any point there is a median.
        pytest.param(bimodal(20, 800), (0.1, 0.25, 0.4, 0.6, 0.75, 0.9, 0.99), id="bimodal"),
    ],
)
def test_learns_quantiles_and_mean_from_5000_samples(
    draw: Sampler, quantiles: tuple[float, ...]
) -> None:
    model, values = learned(draw, 5_000)
    dist = model.distribution("m", "t")
    for q in quantiles:
        assert close(dist.quantile(q), sample_quantile(values, q), 0.10), q
    mean = sum(values) / len(values)
    assert close(dist.mean(), mean, 0.10, 0)
    cap = 500
    assert close(dist.mean(cap), sum(min(v, cap) for v in values) / len(values), 0.05, 0)
    assert model.samples == 5_000
    # Model-wide aged weight: sum of 2**(-i/2000) over 5,000 observations; the tenant's
    # adds its prior (20 pseudo-observations of the model-wide curve) at its data share.
    aged = (1 - 2 ** (-5_000 / 2_000)) / (1 - 2 ** (-1 / 2_000))
    assert model.distribution("m", "unseen").weight == pytest.approx(aged)
    assert dist.weight == pytest.approx(aged + 20 * aged / (aged + 20))


@pytest.mark.parametrize("tokens", [1, 2, 7, 8, 16, 20, 32, 64])
def test_lengths_at_bin_edges_are_exact(tokens: int) -> None:
    model = OutputLengthModel(prior_weight=1e-3)
    for _ in range(1_000):
        model.observe("m", "t", tokens)
    dist = model.distribution("m", "t")
    assert dist.quantile(0.5) == pytest.approx(tokens, rel=0.1, abs=1)
    assert dist.survival(tokens - 1) > 0.99  # P(L >= tokens)
    assert dist.survival(tokens * 1.3 + 1) < 0.01


def test_the_prior_has_its_mean_before_any_data() -> None:
    dist = OutputLengthModel(prior_mean_tokens=256).distribution("m", "t")
    assert dist.weight == 0
    assert dist.quantile(0.5) == pytest.approx(256 / math.sqrt(math.e), rel=0.05)  # median
    assert dist.mean(10_000) == pytest.approx(256, rel=0.05)
    assert dist.survival(0) == 1.0


# ------------------------------------------------------------------ censoring


def test_capped_lengths_do_not_bias_quantiles_down() -> None:
    """Half the requests have max_tokens 200: those longer stop at 200, censored."""
    median, sigma, cap = 150.0, 0.8, 200
    rng = random.Random(1)
    draw = lognormal(median, sigma)
    censored, naive = OutputLengthModel(), OutputLengthModel()
    for i in range(5_000):
        length = draw(rng)
        hit_cap = i % 2 == 0 and length > cap
        censored.observe("m", "t", cap if hit_cap else length, censored=hit_cap)
        naive.observe("m", "t", cap if hit_cap else length)
    km, exact = censored.distribution("m", "t"), naive.distribution("m", "t")
    for q in (0.5, 0.75, 0.9, 0.95):
        truth = lognormal_quantile(median, sigma, q)
        assert close(km.quantile(q), truth, 0.10), q
    for q in (0.75, 0.9, 0.95):  # treating the capped ones as exact pulls these down
        truth = lognormal_quantile(median, sigma, q)
        assert exact.quantile(q) < 0.85 * truth, q
    rng = random.Random(2)
    true_capped_mean = sum(min(draw(rng), 1_000) for _ in range(20_000)) / 20_000
    assert close(km.mean(1_000), true_capped_mean, 0.05, 0)
    assert exact.mean(1_000) < 0.9 * true_capped_mean


def test_requests_that_all_hit_the_cap_read_as_at_least_the_cap() -> None:
    model = OutputLengthModel(prior_mean_tokens=50)
    for _ in range(500):
        model.observe("m", "t", 100, censored=True)
    dist = model.distribution("m", "t")
    assert dist.quantile(0.5) >= 100
    assert dist.survival(99) > 0.9


@pytest.mark.parametrize("tokens", [0, 1])
def test_censored_at_the_start_tells_nothing(tokens: int) -> None:
    model = OutputLengthModel()
    before = model.distribution("m", "t")
    for _ in range(100):
        model.observe("m", "t", tokens, censored=True)
    after = model.distribution("m", "t")
    assert after.knot_survival == pytest.approx(before.knot_survival)


# ------------------------------------------------------------------ prior, drift


@pytest.mark.parametrize(
    ("count", "tenant", "rel"),
    [
        (300, "t", 0.05),  # the tenant the data came from (the model-wide curve is its prior)
        (500, "other", 0.10),  # model-wide: 20 prior pseudo-observations of 520
    ],
)
def test_a_prior_4x_too_short_is_recovered_from(count: int, tenant: str, rel: float) -> None:
    truth_mean, sigma = 256.0, 1.0
    draw = lognormal(truth_mean / math.exp(sigma * sigma / 2), sigma)
    assert OutputLengthModel(prior_mean_tokens=64).distribution("m", "t").mean(4_096) < 80
    model, values = learned(draw, count, seed=3, prior_mean_tokens=64)
    dist = model.distribution("m", tenant)
    assert close(dist.quantile(0.5), sample_quantile(values, 0.5), rel)
    capped = sum(min(v, 4_096) for v in values) / count
    assert close(dist.mean(4_096), capped, rel, 0)


def test_drift_is_followed_within_a_few_half_lives() -> None:
    half_life = 200
    model, _ = learned(lognormal(100, 0.5), 2_000, half_life=half_life)
    assert close(model.distribution("m", "t").quantile(0.5), 100, 0.10)
    rng = random.Random(9)
    medians = []
    for _ in range(4):  # four half-lives of the new regime
        for _ in range(half_life):
            model.observe("m", "t", lognormal(400, 0.5)(rng))
        medians.append(model.distribution("m", "t").quantile(0.5))
    assert 120 < medians[0] < 380  # one half-life: half old, half new
    assert medians[0] < medians[1] < medians[-1]
    assert close(medians[-1], 400, 0.10)


def test_lazy_aging_survives_rescaling_and_matches_eager_weights() -> None:
    # half_life 1: the stored weights pass 1e100 every ~330 observations.
    model = OutputLengthModel(half_life=1.0, prior_weight=1e-3)
    for _ in range(5_000):
        model.observe("m", "t", 50)
    for _ in range(60):
        model.observe("m", "t", 500)
    dist = model.distribution("m", "t")
    assert model.distribution("m", "x").weight == pytest.approx(2.0)  # 1 + 1/2 + 1/4 + ...
    assert all(math.isfinite(s) for s in dist.knot_survival)
    assert close(dist.quantile(0.5), 500, 0.10)
    no_aging = OutputLengthModel(half_life=math.inf)
    for _ in range(10):
        no_aging.observe("m", "t", 50)
    assert no_aging.distribution("m", "x").weight == pytest.approx(10)


# ------------------------------------------------------------------ tenants, cache


@pytest.mark.parametrize(("own_samples", "reads_own"), [(5, False), (1_000, True)])
def test_a_tenant_reads_its_own_distribution_once_it_has_enough_weight(
    own_samples: int, reads_own: bool
) -> None:
    rng = random.Random(4)
    model = OutputLengthModel()
    for _ in range(3_000):
        model.observe("m", "big", lognormal(100, 0.5)(rng))
    for _ in range(own_samples):
        model.observe("m", "small", lognormal(1_000, 0.5)(rng))
    small = model.distribution("m", "small").quantile(0.5)
    wide = model.distribution("m", "never-seen").quantile(0.5)
    if reads_own:
        assert close(small, 1_000, 0.10)
    else:
        assert close(small, wide, 0.25)
        assert small < 300


def test_an_unseen_tenant_reads_the_model_wide_and_an_unseen_model_the_prior() -> None:
    model = OutputLengthModel()
    assert model.distribution("m", "t") is model.prior
    model.observe("m", "a", 40)
    assert model.distribution("m", "b") is model.distribution("m", "c")
    assert model.distribution("other", "a") is model.prior
    assert model.key_count == 2  # reading creates no keys


def test_tenant_weight_counts_borrowed_model_wide_data() -> None:
    model = OutputLengthModel(half_life=math.inf)
    for _ in range(100):
        model.observe("m", "a", 40)
    for _ in range(5):
        model.observe("m", "b", 40)
    share = 105 / (105 + 20)  # data share of the model-wide distribution
    assert model.distribution("m", "b").weight == pytest.approx(5 + 45 * share)
    assert model.distribution("m", "a").weight == pytest.approx(100 + 20 * share)
    assert model.distribution("m", "x").weight == pytest.approx(105)


def test_snapshots_are_cached_until_new_observations() -> None:
    model = OutputLengthModel()
    model.observe("m", "a", 40)
    first = model.distribution("m", "a")
    assert model.distribution("m", "a") is first
    model.observe("m", "b", 400)  # the model-wide distribution (a's prior) changed
    second = model.distribution("m", "a")
    assert second is not first
    assert model.distribution("m", "a") is second
    model.observe("m", "a", 40)
    assert model.distribution("m", "a") is not second
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.weight = 3.0  # type: ignore[misc]


def test_least_recently_used_keys_are_dropped() -> None:
    model = OutputLengthModel(max_keys=3)
    model.observe("m", "a", 40)  # keys: (m, a), (m, *)
    model.observe("m", "b", 40)  # (m, a) dropped
    assert model.key_count == 3
    model.distribution("m", "b")
    model.observe("n", "c", 40)  # two more keys: (m, b) and (m, *) are the oldest left
    assert model.key_count == 3
    assert model.samples == 3


# ------------------------------------------------------------------ tail


def test_a_decode_past_the_observed_tail_stays_in_the_forecast() -> None:
    model = OutputLengthModel()
    for _ in range(2_000):
        model.observe("m", "t", 20)
    for dist in (model.distribution("m", "t"), model.distribution("m", "other")):
        assert dist.quantile(0.5) in (20, 21)
        assert dist.survival(1_000) < 0.01
        assert dist.tail_start_tokens <= 1_000
        assert dist.conditional_survival(1_000, 2_000) == pytest.approx(0.5)  # done / target
        assert dist.conditional_survival(1_000, 1_000) == 1.0
        assert dist.conditional_survival(5_000, 1e7) == pytest.approx(5e-4)
        assert dist.survival(dist.tail_start_tokens) == pytest.approx(TAIL_SURVIVAL)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prior_mean_tokens": 0.0}, "prior_mean_tokens"),
        ({"prior_mean_tokens": math.inf}, "prior_mean_tokens"),
        ({"prior_weight": 0.0}, "prior_weight"),
        ({"half_life": 0.0}, "half_life"),
        ({"min_tenant_weight": -1.0}, "min_tenant_weight"),
        ({"max_keys": 0}, "max_keys"),
    ],
)
def test_bad_knobs_are_refused(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OutputLengthModel(**kwargs)  # type: ignore[arg-type]


def test_bad_queries_are_refused() -> None:
    model = OutputLengthModel()
    with pytest.raises(ValueError, match="output_tokens"):
        model.observe("m", "t", -1)
    for q in (-0.1, 1.1):
        with pytest.raises(ValueError, match="q must"):
            model.prior.quantile(q)


# ------------------------------------------------------------------ invariants

observations = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.one_of(st.integers(0, 2_000), st.integers(0, 3 * MAX_TOKENS)),
        st.booleans(),
    ),
    max_size=60,
)
knobs = st.fixed_dictionaries(
    {
        "prior_mean_tokens": st.floats(1.0, 1e6),
        "prior_weight": st.floats(0.01, 100.0),
        "half_life": st.one_of(st.floats(0.5, 1e4), st.just(math.inf)),
        "min_tenant_weight": st.floats(0.0, 200.0),
    }
)
points = st.floats(0.0, 4.0 * MAX_TOKENS, allow_nan=False)


def build(kw: dict[str, float], obs: list[tuple[str, int, bool]]) -> LengthDistribution:
    model = OutputLengthModel(**kw)  # type: ignore[arg-type]
    for tenant, tokens, cens in obs:
        model.observe("m", tenant, tokens, censored=cens)
    return model.distribution("m", "a")


@settings(max_examples=60, deadline=None)
@given(knobs, observations, st.lists(points, min_size=1, max_size=20))
def test_survival_is_a_survival_function(
    kw: dict[str, float], obs: list[tuple[str, int, bool]], ts: list[float]
) -> None:
    dist = build(kw, obs)
    assert dist.survival(0) == 1.0
    values = [dist.survival(t) for t in sorted(ts)]
    assert all(0.0 <= v <= 1.0 for v in values)
    assert all(a >= b - 1e-12 for a, b in pairwise(values))
    assert all(v > 0 for v in values)  # the tail never reaches 0


@settings(max_examples=60, deadline=None)
@given(knobs, observations, points, points)
def test_conditional_survival_is_a_probability(
    kw: dict[str, float], obs: list[tuple[str, int, bool]], a: float, b: float
) -> None:
    dist = build(kw, obs)
    done, target = min(a, b), max(a, b)
    p = dist.conditional_survival(done, target)
    assert 0.0 < p <= 1.0
    assert dist.conditional_survival(done, done) == 1.0
    past = max(done, dist.tail_start_tokens)  # a decode past the observed tail
    assert dist.conditional_survival(past, past + target + 1) > 0.0
    assert dist.conditional_survival(past, 2 * past) == pytest.approx(0.5)


@settings(max_examples=60, deadline=None)
@given(
    knobs,
    observations,
    st.lists(st.floats(0.0, 1.0), min_size=1, max_size=10),
    st.one_of(st.none(), st.integers(0, 2 * MAX_TOKENS)),
)
def test_quantile_is_monotone_and_capped(
    kw: dict[str, float], obs: list[tuple[str, int, bool]], qs: list[float], cap: int | None
) -> None:
    dist = build(kw, obs)
    limit = MAX_TOKENS if cap is None else cap
    values = [dist.quantile(q, cap) for q in sorted(qs)]
    assert all(0 <= v <= limit for v in values)
    assert values == sorted(values)
    for q, v in zip(sorted(qs), values, strict=True):
        if v < limit:
            assert dist.survival(v) <= 1.0 - q + 1e-9  # P(L > quantile) <= 1 - q
    assert 0.0 <= dist.mean(cap) <= limit
    assert dist.mean(cap) <= dist.mean(None if cap is None else cap + 1000)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 6),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.booleans()), max_size=80),
)
def test_max_keys_bound_holds(max_keys: int, ops: list[tuple[int, int, bool]]) -> None:
    model = OutputLengthModel(max_keys=max_keys)
    for model_id, tenant_id, read in ops:
        if read:
            model.distribution(f"m{model_id}", f"t{tenant_id}")
        else:
            model.observe(f"m{model_id}", f"t{tenant_id}", 10 + tenant_id)
        assert model.key_count <= max_keys


# ------------------------------------------------- the rebuilds against their definitions


def _kaplan_meier_by_bin(
    exact: list[float], censored: list[float], unwatched: list[float], scale: float,
    pseudo: list[float],
) -> list[float]:  # fmt: skip
    """The actuarial Kaplan-Meier recurrence, one bin at a time (the definition)."""
    n = len(exact)
    at_risk = [0.0] * n
    running = 0.0
    for k in range(n - 1, -1, -1):
        running += (exact[k] + censored[k]) / scale + pseudo[k]
        at_risk[k] = running
    survival = [1.0] * (n + 1)
    s = 1.0
    for k in range(n):
        deaths = exact[k] / scale + pseudo[k]
        exposed = at_risk[k] - unwatched[k] / scale
        if deaths > 0.0 and exposed > 0.0:
            s *= max(0.0, 1.0 - min(1.0, deaths / exposed))
        survival[k + 1] = s
    return survival


def _areas_by_bin(survival: list[float], knots: tuple[float, ...]) -> list[float]:
    area = [0.0] * len(survival)
    for k in range(len(survival) - 1):
        area[k + 1] = area[k] + (survival[k] + survival[k + 1]) * (knots[k + 1] - knots[k]) / 2
    return area


_COUNT = st.one_of(st.just(0.0), st.floats(1e-6, 1e6))


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.tuples(_COUNT, _COUNT, _COUNT, _COUNT), min_size=1, max_size=8),
    scale=st.floats(1e-3, 1e100),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_rebuilds_equal_their_per_bin_definitions_bit_for_bit(
    counts: list[tuple[float, float, float, float]], scale: float, seed: int
) -> None:
    """The distribution is rebuilt with whole-array operations; every float must be the
    one the per-bin recurrences give, or decisions would drift from the definitions."""
    from conductor.core import output_length as ol

    rng = random.Random(seed)
    bins = ol._N_BINS
    rows = [counts[rng.randrange(len(counts))] for _ in range(bins)]
    for k in rng.sample(range(bins), bins // 2):  # sparse, as real counts are
        rows[k] = (0.0, 0.0, 0.0, rows[k][3])
    exact, censored, pseudo = ([r[i] for r in rows] for i in (0, 1, 3))
    unwatched = [min(r[1], r[2]) for r in rows]  # never more than the censored weight
    expected = _kaplan_meier_by_bin(exact, censored, unwatched, scale, pseudo)
    survival = ol._kaplan_meier(exact, censored, unwatched, scale, pseudo)  # C where built
    assert survival == expected
    assert ol._kaplan_meier_numpy(exact, censored, unwatched, scale, pseudo) == expected
    d, c, u = (array("d", values) for values in (exact, censored, unwatched))  # as kept
    assert ol._kaplan_meier(d, c, u, scale, np.array(pseudo)) == expected
    snap = ol._snapshot(survival, 1.0)  # C where built
    areas = _areas_by_bin(expected, ol._KNOTS)
    assert list(snap.knot_area) == areas
    tail = next((k for k in range(1, bins + 1) if expected[k] <= TAIL_SURVIVAL), bins)
    assert snap.tail_index == tail
    crossing = next((k for k in range(1, bins + 1) if expected[k] <= TAIL_SURVIVAL), bins + 1)
    assert ol._areas_numpy(np.array(expected)) == (areas, crossing)
    pmf = [max(0.0, expected[k] - expected[k + 1]) for k in range(bins)]
    pmf[-1] += max(0.0, expected[-1])
    assert ol._pmf_numpy(snap).tolist() == pmf
    kappa = rng.uniform(0.5, 100.0)
    assert list(ol._scaled_pmf(snap, kappa)) == [kappa * p for p in pmf]  # C where built


# ------------------------------------------------------------------ many at once

special_points = st.one_of(
    points,
    st.sampled_from([-1.0, 0.0, 0.5, 1.0, 7.0, 8.0, 19.0, 20.0, 22.5, float(MAX_TOKENS)]),
)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(knobs, observations), min_size=1, max_size=4),
    st.lists(st.tuples(st.integers(0, 3), special_points, special_points), max_size=40),
)
def test_a_survival_table_equals_the_scalar_methods_bit_for_bit(
    models: list[tuple[dict[str, float], list[tuple[str, int, bool]]]],
    entries: list[tuple[int, float, float]],
) -> None:
    dists = [build(kw, obs) for kw, obs in models]
    rows = [row % len(dists) for row, _, _ in entries]
    a = np.array([x for _, x, _ in entries], dtype=np.float64)
    b = np.array([y for _, _, y in entries], dtype=np.float64)
    # Points exactly at each entry's tail start, where the formula changes.
    starts = np.array([dists[r].tail_start_tokens for r in rows], dtype=np.float64)
    table = SurvivalTable()
    table.row(dists[-1])  # rows need not follow the distributions' order
    at = table.entries(np.array([table.row(dists[r]) for r in rows], dtype=np.intp))
    for tokens in (a, b, starts):
        got = table.survival(tokens, at).tolist()
        want = [dists[r].survival(t) for r, t in zip(rows, tokens.tolist(), strict=True)]
        assert [v.hex() for v in got] == [v.hex() for v in want]
    done, target = np.minimum(a, b), np.maximum(a, b)
    for d, t in ((done, target), (a, b), (starts, target)):
        got = table.conditional_survival(d, t, at.twice()).tolist()
        want = [
            dists[r].conditional_survival(x, y)
            for r, x, y in zip(rows, d.tolist(), t.tolist(), strict=True)
        ]
        assert [v.hex() for v in got] == [v.hex() for v in want]


def test_the_compiled_rebuild_refuses_buffers_of_other_lengths() -> None:
    from kvc import native

    if native.kaplan_meier is None:
        pytest.skip("kvc._native was not built here (tests/unit/test_block_keys.py says why)")
    ok, zeros, short = array("d", [1.0, 0.0]), array("d", [0.0, 0.0]), array("d", [1.0])
    censored = array("d", [2.0, 0.0])  # 3 at risk in the first bin, 1 dies: S = 2/3
    assert native.kaplan_meier(ok, censored, zeros, 1.0, zeros) == [1.0, 1 - 1 / 3, 1 - 1 / 3]
    with pytest.raises(ValueError, match="pseudo holds 8 bytes, expected 16"):
        native.kaplan_meier(ok, ok, ok, 1.0, short)
    with pytest.raises(ValueError, match="exact must hold one or more float64 values"):
        native.kaplan_meier(array("d"), ok, ok, 1.0, ok)


def test_the_compiled_snapshot_parts_equal_their_numpy_twins_at_the_edges() -> None:
    """A tail that starts at the last knot, none at all, NaN, a rise: the C areas and
    masses are NumPy's floats (the fallback's). (A survival of -0.0 cannot arise, and
    NumPy's maximum picks between signed zeros by its SIMD operand order.)"""
    from conductor.core import output_length as ol
    from kvc import native

    if native.survival_areas is None or native.survival_pmf is None:
        pytest.skip("kvc._native was not built here (tests/unit/test_block_keys.py says why)")
    n = ol._N_BINS
    flat = [1.0] * (n + 1)
    last = [1.0] * n + [TAIL_SURVIVAL]
    steep = [1.0] + [TAIL_SURVIVAL / 2] * n
    odd = [1.0, float("nan"), 0.5, 0.0, 0.0] + [0.25] * (n - 4)
    for curve in (flat, last, steep, odd):
        got_area, got_crossing = native.survival_areas(curve, ol._KNOT_WIDTHS, TAIL_SURVIVAL)
        want_area, want_crossing = ol._areas_numpy(np.array(curve))
        assert [v.hex() for v in got_area] == [v.hex() for v in want_area]
        assert got_crossing == want_crossing
        dist = ol._snapshot(list(curve), 1.0)
        out = array("d", bytes(8 * n))
        native.survival_pmf(tuple(curve), 3.0, out)
        assert [v.hex() for v in out] == [v.hex() for v in (3.0 * ol._pmf_numpy(dist)).tolist()]
    assert native.survival_areas(flat, ol._KNOT_WIDTHS, TAIL_SURVIVAL)[1] == n + 1
    assert native.survival_areas(last, ol._KNOT_WIDTHS, TAIL_SURVIVAL)[1] == n
    with pytest.raises(ValueError, match="list or tuple of"):
        native.survival_areas(flat[:-1], ol._KNOT_WIDTHS, TAIL_SURVIVAL)
    with pytest.raises(ValueError, match="floats only"):
        native.survival_areas([1] * (n + 1), ol._KNOT_WIDTHS, TAIL_SURVIVAL)
    with pytest.raises(ValueError, match="out must hold"):
        native.survival_pmf(flat, 1.0, array("d"))
