"""Output-length distributions learned online, per (model, tenant), for decode forecasts.

Predictive admission (``scheduler.py``) asks, for every running decode, "is it still
running when the new request's prefill ends?". A constant "expected output tokens" is
right for one trace only; this module learns the whole distribution of output lengths
``L`` (tokens) from finished requests and answers survival questions about it. Pure: no
clock, no I/O; observations come in as numbers.

Bins
    Fixed log-spaced bins, about four per octave, from 1 to ``MAX_TOKENS = 2**20``: the
    integer edges ``a_j = ceil(2**(j/4))`` deduplicated (1, 2, ..., 8, 10, 12, 14, 16,
    20, 23, 27, 32, ...; 75 bins), so small counts are exact and large ones are kept to
    ~19% resolution. Bin ``k`` holds the integer lengths ``a_k <= L < a_{k+1}``; longer
    observations are clamped into the last bin. On the real line the survival
    ``S(t) = P(L > t)`` is known at the knots ``x_k = a_k - 1`` (``S(x_k) = P(L >= a_k)``,
    ``x_0 = 0`` where ``S = 1``) and linear between them (lengths uniform within a bin).

Counts, aging, censoring
    Per key, three weighted counts per bin: exact lengths ``d_k``; censored ones ``c_k``
    (a request cut by its ``max_tokens`` or cancelled after ``n`` tokens tells only
    ``L >= n``); and the censored ones' unobserved share of their bin ``u_k`` (censored at
    ``n`` inside bin ``k`` it was watched for ``f = (n - a_k) / (a_{k+1} - a_k)`` of the bin,
    so ``u_k += w * (1 - f)``). Aging is exponential in observations: every observation of
    a key multiplies the weight of that key's older ones by ``2**(-1/half_life)``. Done
    lazily: the ``i``-th observation is stored with weight ``g**i`` (``g = 2**(1/half_life)``)
    and true weights are stored ones divided by ``g**(n-1)``, rescaled once the factor
    passes 1e100 (every ~330 half-lives). Kaplan-Meier on the binned counts (the
    actuarial form: a censored observation is at risk for the part of its bin it was
    watched)::

        N_k = sum_{j >= k} (d_j + c_j)           weight still running at the start of bin k
        h_k = d_k / (N_k - u_k)                  hazard of bin k (0 when nobody is at risk)
        S(x_{k+1}) = S(x_k) * (1 - h_k)

    so a workload where most requests hit ``max_tokens`` keeps its upper quantiles
    (treating those as exact lengths would pile them up at the cap).

Prior and tenants
    The model-wide distribution of ``model`` (all its tenants' observations) adds to its
    own exact counts ``prior_weight`` pseudo-observations from a log-normal with mean
    ``prior_mean_tokens`` and ``sigma = 1`` (``mu = ln(mean) - 1/2``), binned. They are
    not aged, so they fade as data arrives: ``prior_weight / (prior_weight + W)`` of the
    mass, ``W`` the aged data weight (at most ``~1.44 * half_life``). A prior 4x too
    short still pulls the model-wide median ~7% low after 300 observations and ~4% after
    500; a tenant's (whose prior is the model-wide curve) is within ~1% after 300.
    A tenant's distribution uses the model-wide one as its prior, with ``kappa`` pseudo-
    observations::

        kappa = max(min_tenant_weight - W_tenant, prior_weight)

    A tenant with little aged weight ``W_tenant`` reads mostly the model-wide distribution
    (5 observations against ``kappa = 45`` at the defaults); from ``min_tenant_weight``
    on, its own data with the model-wide distribution as a ``prior_weight`` prior. A
    tenant never observed reads the model-wide distribution; a model never observed,
    the prior.

Tail
    A decode that has run past nearly all of the observed mass must stay in forecasts
    (the data cannot say when it will end, not that it has already ended). From the point
    ``t*`` where the Kaplan-Meier survival falls to ``TAIL_SURVIVAL = 1e-3`` on, survival
    continues as a Pareto tail of index 1::

        S(t) = TAIL_SURVIVAL * t* / t        (t >= t*)
        P(L > target | L > done) = done / target     (t* <= done <= target)

    ``mean`` and ``quantile`` without a cap are those of ``min(L, MAX_TOKENS)`` (index 1
    has no finite mean; no model generates 2**20 tokens).

Worked example (defaults)
    2,000 observations of 20 tokens for tenant ``t`` of model ``m``: aged weight
    ``W = 1,443`` (the half-life is 2,000). Model-wide, the prior keeps 20 / 1,463 = 1.4%
    of the mass, log-normal around 155 tokens: ``S`` falls from ~1 to 0.013 across the bin
    [20, 23) (``quantile(0.5) = 21``: linear within the bin), then follows the prior's
    share down to 1e-3 at ``t* = 670``; there a decode 1,000 tokens in is still running
    at 2,000 with probability 1000 / 2000 = 0.5 (the fit alone would say ~0). Tenant
    ``t`` (``W >= min_tenant_weight``) reads its own 1,443 plus ``kappa = 20``
    pseudo-observations of that model-wide curve, so its fitted mass ends right after
    its data (``t* = 22``, ``S(t) = 0.022 / t`` beyond) and the same decode keeps 0.5
    there too. Uncapped means carry the tail's ``1e-3 * t* * ln(2**20 / t*)`` (model-wide:
    28.2 tokens against 23.5 capped at 1,000). Capped lengths: with ``max_tokens = 200``
    for half of the requests, the ones cut at 200 are at risk in bin [182, 216) for
    (200 - 182) / 34 = 53% of it and then leave; above it only the uncapped half is at
    risk, so ``S`` beyond 200 is theirs, not 0.

Complexity
    ``observe`` O(1) amortised (three bin updates, a rescale every ~330 half-lives, LRU
    move); ``distribution`` O(1) when cached, one O(bins) rebuild after the key (or, for
    a tenant, its model) saw new observations; ``survival``, ``conditional_survival``,
    ``quantile`` and ``mean`` O(log bins). Memory O(bins) per key, at most ``max_keys``
    keys (tenant and model-wide together; least recently used dropped first).
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, NamedTuple

import numpy as np
import numpy.typing as npt

from kvc import native

__all__ = [
    "MAX_TOKENS",
    "TAIL_SURVIVAL",
    "LengthDistribution",
    "OutputLengthModel",
    "SurvivalEntries",
    "SurvivalTable",
]

MAX_TOKENS: Final = 2**20  # lengths are binned up to here; longer ones land in the last bin
TAIL_SURVIVAL: Final = 1e-3  # where the Pareto tail takes over from the fitted survival
PRIOR_SIGMA: Final = 1.0  # log-normal shape of the prior
_BINS_PER_OCTAVE: Final = 4
_RESCALE_ABOVE: Final = 1e100  # lazy-aging factor at which stored weights are rescaled


def _bin_edges() -> tuple[int, ...]:
    edges: list[int] = []
    octaves = MAX_TOKENS.bit_length() - 1
    for j in range(_BINS_PER_OCTAVE * octaves + 1):
        edge = math.ceil(2.0 ** (j / _BINS_PER_OCTAVE))
        if not edges or edge > edges[-1]:
            edges.append(edge)
    edges[-1] = MAX_TOKENS + 1  # the last bin holds MAX_TOKENS itself
    return tuple(edges)


_EDGES: Final = _bin_edges()  # a_0 = 1 < a_1 < ... < a_K = MAX_TOKENS + 1
_N_BINS: Final = len(_EDGES) - 1
_KNOTS: Final = tuple(float(edge - 1) for edge in _EDGES)  # x_k = a_k - 1; x_0 = 0


def _bin_of(tokens: int) -> int:
    """Index ``k`` with ``a_k <= tokens < a_{k+1}`` (``tokens`` already in [1, MAX_TOKENS])."""
    return bisect_right(_EDGES, tokens) - 1


def _lognormal_pmf(mean_tokens: float, sigma: float) -> list[float]:
    """Mass of a log-normal with mean ``mean_tokens`` per bin (beyond MAX_TOKENS: last bin)."""
    mu = math.log(mean_tokens) - sigma * sigma / 2

    def cdf(x: float) -> float:
        if x <= 0:
            return 0.0
        return 0.5 * (1.0 + math.erf((math.log(x) - mu) / (sigma * math.sqrt(2.0))))

    cdfs = [cdf(x) for x in _KNOTS]
    pmf = [max(0.0, cdfs[k + 1] - cdfs[k]) for k in range(_N_BINS)]
    pmf[-1] += max(0.0, 1.0 - cdfs[-1])
    total = sum(pmf)
    return [p / total for p in pmf]


# ------------------------------------------------------------------ distribution


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """Immutable snapshot of an output-length distribution (module docstring).

    ``knot_survival[k]`` is the Kaplan-Meier ``S(x_k)`` at the knots ``x_k = a_k - 1``;
    ``knot_area[k]`` the integral of ``S`` from 0 to ``x_k``; from ``tail_start_tokens``
    (``t*``, inside the segment ending at knot ``tail_index``) on, ``S(t) =
    tail_survival * t* / t``. ``weight``: aged observation weight behind it, prior
    excluded (a tenant's borrowed model-wide pseudo-observations count at their data
    share).
    """

    knot_survival: tuple[float, ...] = field(repr=False)
    knot_area: tuple[float, ...] = field(repr=False)
    tail_index: int
    tail_start_tokens: float
    tail_survival: float
    tail_area: float  # integral of S from 0 to t*
    weight: float
    # ``knot_survival`` as a read-only array (for forecasts over many decodes at once).
    knot_array: npt.NDArray[np.float64] = field(repr=False, compare=False)

    def survival(self, tokens: float) -> float:
        """``P(L > tokens)``: 1 at 0, non-increasing, > 0 everywhere (the tail)."""
        if tokens <= 0:
            return 1.0
        if tokens >= self.tail_start_tokens:
            return self.tail_survival * self.tail_start_tokens / tokens
        j = bisect_right(_KNOTS, tokens, 1, self.tail_index + 1)  # x_{j-1} <= t < x_j
        x0, x1 = _KNOTS[j - 1], _KNOTS[j]
        s0, s1 = self.knot_survival[j - 1], self.knot_survival[j]
        return s0 + (s1 - s0) * (tokens - x0) / (x1 - x0)

    def survivals(self, tokens: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """``survival`` of each of ``tokens``, in the same operations (bit for bit)."""
        t = np.maximum(tokens, 0.0)
        # bisect_right(_KNOTS, t, 1, tail_index + 1), never past the last knot (only
        # points in the tail reach it, and they take the tail's formula).
        j = np.searchsorted(_KNOTS_ARRAY, t, side="right")
        # np.clip's result, without its wrapper's cost (a fifth of this function's).
        np.minimum(np.maximum(j, 1, out=j), min(self.tail_index + 1, len(_KNOTS) - 1), out=j)
        x0, x1 = _KNOTS_ARRAY.take(j - 1), _KNOTS_ARRAY.take(j)
        s0, s1 = self.knot_array.take(j - 1), self.knot_array.take(j)
        inner = s0 + (s1 - s0) * (t - x0) / (x1 - x0)
        start = self.tail_start_tokens
        tail = self.tail_survival * start / np.maximum(t, start)  # t where it is used
        return np.where(tokens <= 0, 1.0, np.where(t >= start, tail, inner))

    def conditional_survival(self, done: float, target: float) -> float:
        """``P(L > target | L > done)``; 1 when ``target <= done``.

        Past the tail start ``t*`` this is ``done / target`` (Pareto, index 1): a decode
        far beyond every observed length keeps a real chance of running on.
        """
        if target <= done:
            return 1.0
        alive = self.survival(done)
        if alive <= 0.0:  # only at done = inf, excluded above
            return 0.0
        return min(1.0, self.survival(target) / alive)

    def quantile(self, q: float, cap: int | None = None) -> int:
        """The ``q``-quantile of ``min(L, cap)`` (``cap`` None: ``MAX_TOKENS``), in tokens.

        The smallest integer ``n`` with ``S(n) <= 1 - q`` (exact in the one-token bins,
        interpolated within wider ones). Monotone in ``q``; never above the cap.
        """
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must lie in [0, 1], got {q!r}")
        limit = MAX_TOKENS if cap is None else max(0, cap)
        p = 1.0 - q
        if p >= 1.0:
            return 0
        if p <= 0.0:
            return limit
        if p <= self.tail_survival:
            tokens = self.tail_start_tokens * self.tail_survival / p
        else:
            # First knot with S <= p; S is non-increasing, so -S is sorted.
            j = bisect_left(self.knot_survival, -p, 1, self.tail_index + 1, key=lambda s: -s)
            s0, s1 = self.knot_survival[j - 1], self.knot_survival[j]
            x0, x1 = _KNOTS[j - 1], _KNOTS[j]
            tokens = x0 + (s0 - p) / (s0 - s1) * (x1 - x0)
        if tokens >= limit:
            return limit
        return min(limit, math.ceil(tokens - 1e-9))

    def mean(self, cap: int | None = None) -> float:
        """``E[min(L, cap)]`` (``cap`` None: ``MAX_TOKENS``) = the integral of ``S`` to the cap."""
        limit = float(MAX_TOKENS if cap is None else cap)
        if limit <= 0:
            return 0.0
        t_star = self.tail_start_tokens
        if limit >= t_star:
            return self.tail_area + self.tail_survival * t_star * math.log(limit / t_star)
        j = bisect_right(_KNOTS, limit, 1, self.tail_index + 1)
        x0 = _KNOTS[j - 1]
        return (
            self.knot_area[j - 1]
            + (self.knot_survival[j - 1] + self.survival(limit)) * (limit - x0) / 2
        )


_KNOTS_ARRAY: Final = np.array(_KNOTS)
_KNOTS_ARRAY.flags.writeable = False
_KNOT_SPANS: Final = np.diff(_KNOTS_ARRAY)  # x_{k+1} - x_k, exact (small integers)


class SurvivalTable:
    """``LengthDistribution.survival`` and ``conditional_survival`` of many decodes at
    once, each under its own distribution.

    The table holds distributions as rows (``row`` adds one the first time it is seen);
    ``entries`` turns the rows of a set of decodes into what the evaluations read, and
    entries of different sets concatenate (``SurvivalEntries.join``), so one pass can
    evaluate the decodes of many nodes. ``reset`` keeps only the given distributions
    (renumbering rows, and moving ``epoch`` so callers know their entries are stale).

    The same IEEE operations in the same order as the scalar methods, element by
    element, so every result is bit-for-bit the scalar one (checked by a hypothesis
    test). Evaluations O(n log bins) in NumPy for ``n`` entries; ``row`` O(bins) for a
    new distribution (amortised: the arrays double when full).
    """

    __slots__ = (
        "_dists",
        "_index",
        "_j_max",
        "_rise",
        "_stack",
        "_tail_scale",
        "_tail_start",
        "epoch",
    )

    def __init__(self) -> None:
        self.epoch = 0
        self._allocate(64)

    def _allocate(self, capacity: int) -> None:
        self._index: dict[int, int] = {}  # id of a held distribution -> its row
        self._dists: list[LengthDistribution] = []  # held: their ids stay theirs
        self._stack = np.zeros((capacity, len(_KNOTS)))  # S at the knots, per row
        # S(x_{k+1}) - S(x_k) as the scalar method computes it (the last column: unused)
        self._rise = np.zeros((capacity, len(_KNOTS)))
        self._j_max = np.zeros(capacity, dtype=np.intp)
        self._tail_start = np.zeros(capacity)
        self._tail_scale = np.zeros(capacity)

    def __len__(self) -> int:
        return len(self._dists)

    def row(self, dist: LengthDistribution) -> int:
        """``dist``'s row (added if new)."""
        row = self._index.get(id(dist))
        if row is not None:
            return row
        row = len(self._dists)
        if row == len(self._j_max):
            self._grow()
        self._index[id(dist)] = row
        self._dists.append(dist)
        knots = dist.knot_array
        self._stack[row] = knots
        self._rise[row, :-1] = knots[1:] - knots[:-1]
        # bisect's ``hi``; never past the last knot (only entries in the tail reach it).
        self._j_max[row] = min(dist.tail_index + 1, len(_KNOTS) - 1)
        self._tail_start[row] = dist.tail_start_tokens
        self._tail_scale[row] = dist.tail_survival * dist.tail_start_tokens
        return row

    def _grow(self) -> None:
        old = (self._stack, self._rise, self._j_max, self._tail_start, self._tail_scale)
        index, dists = self._index, self._dists
        self._allocate(2 * len(self._j_max))
        self._index, self._dists = index, dists
        for new, held in zip(
            (self._stack, self._rise, self._j_max, self._tail_start, self._tail_scale),
            old,
            strict=True,
        ):
            new[: len(held)] = held

    def reset(self, keep: Iterable[LengthDistribution]) -> None:
        """Hold only ``keep`` (rows renumbered; ``epoch`` moves on)."""
        self.epoch += 1
        self._allocate(64)
        for dist in keep:
            self.row(dist)

    def entries(self, rows: npt.NDArray[np.intp]) -> SurvivalEntries:
        """What the evaluations read for decodes under ``rows`` (valid for this epoch)."""
        return SurvivalEntries(
            start=rows * len(_KNOTS),
            j_max=self._j_max.take(rows),
            tail_start=self._tail_start.take(rows),
            tail_scale=self._tail_scale.take(rows),
        )

    def survival(
        self, tokens: npt.NDArray[np.float64], entries: SurvivalEntries
    ) -> npt.NDArray[np.float64]:
        """``survival(tokens[i])`` under entry ``i``'s distribution."""
        # S = 1 at t <= 0; at t = 0 the first segment's formula gives exactly 1.0.
        t = np.maximum(tokens, 0.0)
        # bisect_right(_KNOTS, t, 1, tail_index + 1) (>= 1: x_0 = 0 <= t), clipped.
        j = np.searchsorted(_KNOTS_ARRAY, t, side="right")
        np.minimum(j, entries.j_max, out=j)
        j -= 1  # x_j <= t < x_{j+1}: the segment's first knot
        first = entries.start + j
        rise = self._rise.reshape(-1).take(first) * (t - _KNOTS_ARRAY.take(j))
        inner = self._stack.reshape(-1).take(first) + rise / _KNOT_SPANS.take(j)
        beyond = t >= entries.tail_start
        tail = entries.tail_scale / np.maximum(t, entries.tail_start)  # t where it is used
        return np.where(beyond, tail, inner)

    def conditional_survival(
        self,
        done: npt.NDArray[np.float64],
        target: npt.NDArray[np.float64],
        twice: SurvivalEntries,
    ) -> npt.NDArray[np.float64]:
        """``conditional_survival(done[i], target[i])`` under entry ``i``'s
        distribution; ``twice``: the entries, twice over (``SurvivalEntries.twice``)."""
        both = self.survival(np.concatenate((done, target)), twice)
        alive, ahead = both[: len(done)], both[len(done) :]
        ratio = np.divide(ahead, alive, out=np.zeros(len(done)), where=alive > 0.0)
        return np.where(target <= done, 1.0, np.minimum(1.0, ratio))


class SurvivalEntries(NamedTuple):
    """Per decode: its distribution's row start in a ``SurvivalTable`` and parameters."""

    start: npt.NDArray[np.intp]
    j_max: npt.NDArray[np.intp]
    tail_start: npt.NDArray[np.float64]
    tail_scale: npt.NDArray[np.float64]

    @staticmethod
    def join(parts: Sequence[SurvivalEntries]) -> SurvivalEntries:
        """The entries of ``parts`` one after another."""
        return SurvivalEntries(*(np.concatenate(field) for field in zip(*parts, strict=True)))

    def twice(self) -> SurvivalEntries:
        """Each entry twice over (``conditional_survival`` evaluates two points each)."""
        return SurvivalEntries.join((self, self))


# The rebuilds below run once per decision that follows an observation (every finished
# request is one), so they are written as whole-array operations: NumPy's accumulate
# and element-wise operations perform the same IEEE operations in the same order as the
# per-bin recurrences in the docstrings (tests/unit/test_output_length.py compares them
# bit for bit with those loops).
_KNOT_WIDTHS: Final = np.diff(np.array(_KNOTS))  # x_{k+1} - x_k


_Counts = Sequence[float] | npt.NDArray[np.float64]


def _kaplan_meier(
    exact: _Counts, censored: _Counts, unwatched: _Counts, scale: float, pseudo: _Counts
) -> list[float]:
    """``_kaplan_meier_numpy``, in C where ``kvc/_native.c`` was built (the same floats,
    ~1 µs instead of ~15: it runs twice after every observation)."""
    if native.kaplan_meier is None:
        return _kaplan_meier_numpy(exact, censored, unwatched, scale, pseudo)
    return native.kaplan_meier(
        _doubles(exact), _doubles(censored), _doubles(unwatched), float(scale), _doubles(pseudo)
    )


def _doubles(values: _Counts) -> object:
    """``values`` as a buffer of float64 (an ``array('d')`` as it is)."""
    if type(values) is array:
        return values
    return np.ascontiguousarray(values, dtype=np.float64)


def _kaplan_meier_numpy(
    exact: _Counts, censored: _Counts, unwatched: _Counts, scale: float, pseudo: _Counts
) -> list[float]:
    """Binned actuarial Kaplan-Meier: ``S`` at the knots (stored counts / ``scale``).

    Per bin, from the top, ``N_k = N_{k+1} + (d_k + c_k) / scale + pseudo_k``; then
    from the bottom ``S_{k+1} = S_k * max(0, 1 - min(1, deaths_k / exposed_k))`` where
    ``deaths_k = d_k / scale + pseudo_k > 0`` and ``exposed_k = N_k - u_k / scale > 0``
    (else ``S_{k+1} = S_k``), ``S_0 = 1``.
    """
    d = np.asarray(exact, dtype=np.float64)
    pseudo_a = np.asarray(pseudo, dtype=np.float64)
    arrivals = (d + np.asarray(censored, dtype=np.float64)) / scale + pseudo_a
    at_risk = np.add.accumulate(arrivals[::-1])[::-1]
    deaths = d / scale + pseudo_a
    exposed = at_risk - np.asarray(unwatched, dtype=np.float64) / scale
    dying = (deaths > 0.0) & (exposed > 0.0)
    hazard = np.divide(deaths, exposed, out=np.zeros(_N_BINS), where=dying)
    # ``max(0, 1 - min(1, hazard))``, in place; 1 exactly where not ``dying`` (hazard 0).
    factor = np.maximum(np.subtract(1.0, np.minimum(hazard, 1.0, out=hazard), out=hazard), 0.0)
    survival: list[float] = [1.0]
    survival.extend(np.multiply.accumulate(factor).tolist())
    return survival


def _snapshot(knot_survival: list[float], weight: float) -> LengthDistribution:
    """Areas and the tail start for a knot survival curve; O(bins).

    ``area_{k+1} = area_k + (S_k + S_{k+1}) * (x_{k+1} - x_k) / 2``, ``area_0 = 0``; the
    tail starts in the first segment whose end has ``S <= TAIL_SURVIVAL``. The areas and
    that segment come from ``kvc/_native.c`` where it was built (``_areas_numpy`` is
    their specification and the fallback: the same floats, ~1 µs instead of ~6; two
    snapshots follow every observation).
    """
    s = np.array(knot_survival)
    s.flags.writeable = False
    if native.survival_areas is not None and type(knot_survival) is list:
        area, crossing = native.survival_areas(knot_survival, _KNOT_WIDTHS, TAIL_SURVIVAL)
    else:
        area, crossing = _areas_numpy(s)
    tail_index = _N_BINS
    t_star, s_star, tail_area = _KNOTS[-1], knot_survival[-1], area[-1]
    if crossing <= _N_BINS:
        k = crossing
        s0, s1 = knot_survival[k - 1], knot_survival[k]
        x0, x1 = _KNOTS[k - 1], _KNOTS[k]
        t_star = x0 + (s0 - TAIL_SURVIVAL) / (s0 - s1) * (x1 - x0)
        s_star = TAIL_SURVIVAL
        tail_area = area[k - 1] + (s0 + TAIL_SURVIVAL) * (t_star - x0) / 2
        tail_index = k
    # Never at knot 0 (S = 1 there), so t* > 0; s_star > 0 unless the last knot is 0,
    # and then a crossing was found with s_star = TAIL_SURVIVAL.
    return LengthDistribution(
        knot_survival=tuple(knot_survival),
        knot_area=tuple(area),
        tail_index=tail_index,
        tail_start_tokens=t_star,
        tail_survival=s_star,
        tail_area=tail_area,
        weight=weight,
        knot_array=s,
    )


def _areas_numpy(s: npt.NDArray[np.float64]) -> tuple[list[float], int]:
    """The areas under the knot survival ``s`` (``_snapshot``'s recurrence) and the
    first knot ``k >= 1`` with ``S_k <= TAIL_SURVIVAL`` (``_N_BINS + 1``: none)."""
    area: list[float] = [0.0]
    area.extend(np.add.accumulate((s[:-1] + s[1:]) * _KNOT_WIDTHS / 2).tolist())
    below = s[1:] <= TAIL_SURVIVAL
    first = int(below.argmax())  # the first True (0 also when there is none)
    return area, first + 1 if below[first] else _N_BINS + 1


def _scaled_pmf(dist: LengthDistribution, scale: float) -> _Counts:
    """``scale * _pmf_numpy(dist)`` as a float64 buffer: in C where built (the same
    floats), else with NumPy."""
    if native.survival_pmf is None:
        return scale * _pmf_numpy(dist)
    out = array("d", bytes(8 * _N_BINS))
    native.survival_pmf(dist.knot_survival, scale, out)
    return out


def _pmf_numpy(dist: LengthDistribution) -> npt.NDArray[np.float64]:
    """Per-bin mass of a snapshot's fitted survival (for use as pseudo-observations):
    ``max(0, S_k - S_{k+1})``, the last bin also ``max(0, S_K)``."""
    s = np.array(dist.knot_survival)
    pmf: npt.NDArray[np.float64] = np.maximum(0.0, s[:-1] - s[1:])
    pmf[-1] += max(0.0, dist.knot_survival[-1])
    return pmf


# ------------------------------------------------------------------ model


@dataclass(slots=True)
class _KeyCounts:
    """Weighted bin counts of one key, stored un-aged (true weight = stored / ``unit``)."""

    exact: array[float] = field(default_factory=lambda: array("d", bytes(8 * _N_BINS)))
    censored: array[float] = field(default_factory=lambda: array("d", bytes(8 * _N_BINS)))
    unwatched: array[float] = field(default_factory=lambda: array("d", bytes(8 * _N_BINS)))
    total: float = 0.0  # stored weight of all observations
    unit: float = 0.0  # stored weight of the newest observation (0: none yet)
    version: int = 0  # model-wide observation counter at the last change
    cached: LengthDistribution | None = None
    cached_parent: int = -1  # the parent's version the cached snapshot was built with

    @property
    def weight(self) -> float:
        return self.total / self.unit if self.unit > 0 else 0.0

    def add(self, tokens: int, censored: bool, growth: float, version: int) -> None:
        weight = 1.0 if self.unit == 0.0 else self.unit * growth
        if weight > _RESCALE_ABOVE:  # O(bins), once per ~330 half-lives
            for counts in (self.exact, self.censored, self.unwatched):
                for k in range(_N_BINS):
                    counts[k] /= self.unit
            self.total /= self.unit
            weight = growth
        self.unit = weight
        tokens = min(max(tokens, 1), MAX_TOKENS)
        k = _bin_of(tokens)
        if censored:
            watched = (tokens - _EDGES[k]) / (_EDGES[k + 1] - _EDGES[k])
            self.censored[k] += weight
            self.unwatched[k] += weight * (1.0 - watched)
        else:
            self.exact[k] += weight
        self.total += weight
        self.version = version
        self.cached = None


_ModelKey = tuple[str, None]
_TenantKey = tuple[str, str]


class OutputLengthModel:
    """Output-length distributions per (model, tenant), learned online (module docstring).

    Knobs: ``prior_mean_tokens`` (log-normal prior mean), ``prior_weight`` (its pseudo-
    observations), ``half_life`` (observations of a key after which an observation
    weighs half; ``math.inf`` for no aging), ``min_tenant_weight`` (aged weight from which
    a tenant reads its own data), ``max_keys`` (tenant and model-wide keys kept).
    """

    def __init__(
        self,
        prior_mean_tokens: float = 256.0,
        prior_weight: float = 20.0,
        half_life: float = 2000.0,
        min_tenant_weight: float = 50.0,
        max_keys: int = 4096,
    ) -> None:
        if not (math.isfinite(prior_mean_tokens) and prior_mean_tokens > 0):
            raise ValueError(f"prior_mean_tokens must be finite and > 0, got {prior_mean_tokens!r}")
        if not (math.isfinite(prior_weight) and prior_weight > 0):
            raise ValueError(f"prior_weight must be finite and > 0, got {prior_weight!r}")
        if not half_life > 0:
            raise ValueError(f"half_life must be > 0, got {half_life!r}")
        if not (math.isfinite(min_tenant_weight) and min_tenant_weight >= 0):
            raise ValueError(
                f"min_tenant_weight must be finite and >= 0, got {min_tenant_weight!r}"
            )
        if isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys < 1:
            raise ValueError(f"max_keys must be an int >= 1, got {max_keys!r}")
        self.prior_mean_tokens = prior_mean_tokens
        self.prior_weight = prior_weight
        self.half_life = half_life
        self.min_tenant_weight = min_tenant_weight
        self.max_keys = max_keys
        self._growth = 2.0 ** (1.0 / half_life)
        # As the float64 buffer every model-wide rebuild passes on (no conversion there).
        self._prior_counts = array(
            "d", [prior_weight * p for p in _lognormal_pmf(prior_mean_tokens, PRIOR_SIGMA)]
        )
        zeros = [0.0] * _N_BINS
        self._prior = _snapshot(_kaplan_meier(zeros, zeros, zeros, 1.0, self._prior_counts), 0.0)
        self._keys: OrderedDict[_ModelKey | _TenantKey, _KeyCounts] = OrderedDict()
        self._samples = 0

    @property
    def samples(self) -> int:
        """Observations taken so far (all keys, including dropped ones)."""
        return self._samples

    @property
    def key_count(self) -> int:
        """Keys held now (tenant and model-wide), at most ``max_keys``."""
        return len(self._keys)

    @property
    def prior(self) -> LengthDistribution:
        """The distribution before any observation."""
        return self._prior

    def observe(
        self, model: str, tenant: str, output_tokens: int, *, censored: bool = False
    ) -> None:
        """One finished request: ``output_tokens`` produced; ``censored``: only ``L >= that``.

        ``censored`` is for requests stopped by their ``max_tokens`` cap or cancelled.
        Updates the tenant's and the model-wide counts. O(1) amortised.
        """
        if output_tokens < 0:
            raise ValueError(f"output_tokens must be >= 0, got {output_tokens!r}")
        self._samples += 1
        for key in ((model, tenant), (model, None)):
            counts = self._keys.get(key)
            if counts is None:
                counts = self._keys[key] = _KeyCounts()
            else:
                self._keys.move_to_end(key)
            counts.add(output_tokens, censored, self._growth, self._samples)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def distribution(self, model: str, tenant: str) -> LengthDistribution:
        """The length distribution for a request of ``tenant`` on ``model`` (a snapshot).

        O(1) when nothing changed since the last call for this key; else one O(bins)
        rebuild (of the model-wide snapshot and/or the tenant's).
        """
        parent_counts = self._keys.get((model, None))
        if parent_counts is None:
            parent, parent_version = self._prior, -1
        else:
            self._keys.move_to_end((model, None))
            parent, parent_version = self._model_wide(parent_counts), parent_counts.version
        counts = self._keys.get((model, tenant))
        if counts is None:
            return parent
        self._keys.move_to_end((model, tenant))
        if counts.cached is not None and counts.cached_parent == parent_version:
            return counts.cached
        own = counts.weight
        kappa = max(self.min_tenant_weight - own, self.prior_weight)
        parent_share = parent.weight / (parent.weight + self.prior_weight)
        pseudo = _scaled_pmf(parent, kappa)
        dist = _snapshot(
            _kaplan_meier(counts.exact, counts.censored, counts.unwatched, counts.unit, pseudo),
            own + kappa * parent_share,
        )
        counts.cached, counts.cached_parent = dist, parent_version
        return dist

    def _model_wide(self, counts: _KeyCounts) -> LengthDistribution:
        if counts.cached is None:
            counts.cached = _snapshot(
                _kaplan_meier(
                    counts.exact, counts.censored, counts.unwatched, counts.unit, self._prior_counts
                ),
                counts.weight,
            )
        return counts.cached
