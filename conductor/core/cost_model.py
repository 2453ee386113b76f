"""Time estimates for KV-centric scheduling (Mooncake Algorithm 1, §4.1-§4.3).

Algorithm 1 needs three numbers per candidate: how long a prefill of ``n`` tokens with
``p`` of them cached takes (``EstimatePrefillExecutionTime``), how long moving a KV
prefix between two nodes takes (``EstimateKVCacheTransferTime``, ``transfer_model.py``),
and the time between tokens a decode instance will run at (``SelectDecodingInstance``,
early rejection). This module holds the prefill and decode models.
Every model starts from a prior and learns from observations; nothing here reads a
clock or does I/O: durations come in as numbers.

Prefill (``PrefillPrior``, ``PrefillTimeModel``)
    With ``n`` = total tokens, ``p`` = cached tokens and ``u = n - p`` uncached::

        T_prefill(n, p) = fixed_s + per_token_s * u + per_token_context_s * u * (n + p)

    Derivation from the paper's Eq. (1), ``flops(n) = l * (a*n^2*d + b*n*d^2)``. Reusing a
    cached prefix of ``p`` tokens saves ``flops(p)`` (§2.2), so the work left is::

        flops(n) - flops(p) = l*b*d^2 * (n - p)  +  l*a*d * (n^2 - p^2)
                            = l*b*d^2 * u        +  l*a*d * u*(n + p)

    The linear part (projections, MLP) is per new token; the quadratic part is attention,
    and ``u*(n + p)`` is exactly the causal-attention work of the ``u`` new tokens (token
    ``i`` attends to ``i`` earlier tokens; ``sum_{i=p}^{n} i ~ (n^2 - p^2)/2``). Dividing by the
    delivered throughput ``peak_flops * mfu`` gives (``PrefillPrior.from_flops``)::

        per_token_s         = l * b * d^2 / (peak_flops * mfu)
        per_token_context_s = l * a * d   / (peak_flops * mfu)

    For a full prefill (``p = 0``) the context feature is ``n^2``, i.e. Eq. (1) exactly.
    (Writing the context feature as ``u * n`` would agree for a full prefill but
    under-count a long cached prefix's attention by up to 2x: at 128k tokens with 95%
    cached, Eq. (1) predicts a 91.5% cut in prefill time — the paper measured 92%, §7.4.3
    — while ``u * n`` would predict 95%.) Worked example, LLaMA3-70B on 8xA800 (Table 1:
    l=80, d=8192, a=4, b=22, 8x312 TFLOPS) at mfu=1: ``per_token_s = 47.3 us``,
    ``per_token_context_s = 1.05 ns``; 8k tokens from scratch = 1.14 PFLOP = 0.388 s
    (linear) + 0.070 s (attention) = 0.458 s (0.92 s at mfu=0.5). Recomputing that 8k
    prefix takes as long as loading its 2.68 GB of KV at 5.9 GB/s: the paper's "minimum
    required B of 6 GB/s" (Eq. 2, §2.2).

Decode (``DecodePrior``, ``DecodeTimeModel``)
    ``TBT(batch, ctx) = fixed_s + per_request_s * batch + per_context_token_s * ctx``,
    ``ctx`` = KV tokens of the whole batch: weights are read once per step (``fixed_s``),
    per-sequence work grows with the batch, and attention reads every cached KV token.

Learning (``_LogRatioCorrection``, one implementation for both models)
    The prior gives the *shape* (physics: how time grows with tokens, batch and
    context); observations give the *scale*, learned as a log factor so an estimate can
    never run away from the data. ``estimate(x) = prior(x) * exp(c(t))`` with
    ``t = log2(prior(x) / 1 us)``, the work size in doublings:

    * a global factor ``g``: the median of the last ``window`` (64) observed log ratios
      ``log(actual / prior)``, shrunk toward 0 by ``prior_weight`` (0.25)
      pseudo-observations (``g * N / (N + w)``, ``N`` every observation so far). A
      median, not a mean: cold starts and stalls (the first prefill on a cold engine
      is often 10-20x slow) move it by one rank, not by their size;
    * a per-size shape: each bucket ``round(t)`` keeps the median of its last
      ``bucket_window`` (9) log ratios, pulled toward ``g`` by 2 pseudo-observations
      and aged with ``half_life`` (512 observations of the model) so old regimes fade;
      between buckets with data ``c`` is interpolated; beyond the data it fades to
      ``g`` within two doublings — one slow short prompt never decides the estimate
      of a long one (the lock-up: one cold 14-token prefill of 0.8 s made a linear
      least-squares fit predict 288 s for 1,377 tokens; here 3.4 s, and 0.62 s after
      six fast ones — the engine took 1.2 s — and one observation is no evidence);
    * monotone by construction: ``log estimate = t*ln2 + c(t)`` is replaced by its
      running maximum over the knots below ``t``, so more uncached tokens, a larger
      batch or more context never predict less time (the prior's coefficients are
      non-negative, so ``t`` grows with each of them).

    ``has_evidence(x)``: the prior was measured on the node (start-up calibration,
    ``prior_measured``), or the node's engine has been observed 8 times (of any size:
    the global factor is then a median robust to a few cold starts), or at least 2
    observations lie within 4x of ``x``'s prior time. Admission rejects only on
    estimates with evidence (``scheduler.py``).
    ``set_prior`` replaces the prior (a node's calibration arrives) and restarts the
    learned factors. Start-up calibration fits a prior by non-negative least squares
    in relative error (``fit_prefill_prior``, ``fit_decode_prior``).

Complexity
    prefill/decode ``observe`` O(1); ``estimate`` O(log buckets) (at most ~120
    buckets), plus one O(window log window + buckets * bucket_window) refresh on the
    first call after new observations. Memory O(window + buckets * bucket_window) per
    model.
"""

from __future__ import annotations

import math
from bisect import bisect_right, insort
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from kvc.priors import (
    DecodePrior,
    PrefillPrior,
    decode_features,
    prefill_features,
)

__all__ = [
    "DecodeTimeModel",
    "PrefillTimeModel",
    "decode_floors",
    "prefill_floors",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# ------------------------------------------------------------ learned correction

_LOG2: Final = math.log(2.0)
_POSITION_UNIT_S: Final = 1e-6  # bucket 0 is a prior estimate of 1 us; bucket k is 2^k us
_MIN_BUCKET: Final = -40
_MAX_BUCKET: Final = 80
_BUCKET_PRIOR_WEIGHT: Final = 2.0  # pseudo-observations pulling a bucket to the global
_EVIDENCE_RADIUS: Final = 2  # buckets (4x either way) whose data counts as evidence
_EVIDENCE_MIN_OBSERVATIONS: Final = 2  # one (possibly cold-start) sample is not evidence
# Observations of any size after which the global factor is evidence of the engine's
# speed (a median of 8: up to 3 cold starts or stalls cannot move it far).
_EVIDENCE_GLOBAL_OBSERVATIONS: Final = 8
_EDGE_FADE_BUCKETS: Final = 2.0  # beyond the data, the local shape fades to the global
_MAX_LOG_ESTIMATE: Final = 700.0  # exp() stays finite
_MAX_ESTIMATE_S: Final = _POSITION_UNIT_S * math.exp(_MAX_LOG_ESTIMATE)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[mid]
    return 0.5 * (ordered[mid - 1] + ordered[mid])


@dataclass(slots=True)
class _Bucket:
    log_ratios: deque[float]
    last_seen: int  # the correction's observation count when this bucket last got one
    median: float = 0.0  # of ``log_ratios``, kept at each observation (one bucket changes)


class _LogRatioCorrection:
    """``log(actual / prior)`` learned as a function of the prior's own estimate.

    See "Learning" in the module docstring. Positions are ``t = log2(prior_s / 1 us)``;
    a bucket is an integer ``t``. Knots (buckets with data) are rebuilt lazily after
    new observations; ``estimate`` is O(log buckets).
    """

    __slots__ = (
        "_bucket_keys",
        "_bucket_window",
        "_buckets",
        "_dirty",
        "_floor_factor",
        "_global",
        "_global_correction",
        "_half_life",
        "_knot_c",
        "_knot_h_max",
        "_knot_t",
        "_prior_weight",
        "_seen",
    )

    def __init__(
        self, prior_weight: float, window: int, bucket_window: int, half_life: float
    ) -> None:
        if not (math.isfinite(prior_weight) and prior_weight > 0):
            raise ValueError(f"prior_weight must be finite and > 0, got {prior_weight!r}")
        for name, value in (("window", window), ("bucket_window", bucket_window)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not (math.isfinite(half_life) and half_life > 0):
            raise ValueError(f"half_life must be finite and > 0, got {half_life!r}")
        self._prior_weight = float(prior_weight)
        self._bucket_window = bucket_window
        self._half_life = float(half_life)
        self._global: deque[float] = deque(maxlen=window)
        self._buckets: dict[int, _Bucket] = {}
        self._bucket_keys: list[int] = []  # sorted
        self._seen = 0
        self._dirty = False
        self._global_correction = 0.0
        self._floor_factor = 1.0
        self._knot_t: list[float] = []
        self._knot_c: list[float] = []
        self._knot_h_max: list[float] = []

    @property
    def seen(self) -> int:
        return self._seen

    @property
    def global_correction(self) -> float:
        """The size-independent log factor (0 before any observation)."""
        self._refresh()
        return self._global_correction

    @staticmethod
    def position(prior_s: float) -> float:
        return math.log2(prior_s / _POSITION_UNIT_S)

    @staticmethod
    def _bucket_of(position: float) -> int:
        return min(_MAX_BUCKET, max(_MIN_BUCKET, round(position)))

    def observe(self, prior_s: float, actual_s: float) -> None:
        if not (0 < prior_s < math.inf and 0 < actual_s < math.inf):
            return
        log_ratio = math.log(actual_s) - math.log(prior_s)
        self._seen += 1
        self._global.append(log_ratio)
        key = self._bucket_of(self.position(prior_s))
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(deque(maxlen=self._bucket_window), 0)
            insort(self._bucket_keys, key)
        bucket.log_ratios.append(log_ratio)
        bucket.median = _median(bucket.log_ratios)
        bucket.last_seen = self._seen
        self._dirty = True

    def _refresh(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        g = 0.0
        if self._global:  # the prior's pull fades with every observation ever made
            g = _median(self._global) * self._seen / (self._seen + self._prior_weight)
        self._global_correction = g
        # One pass over the buckets (their medians are kept by ``observe``): the refresh
        # follows every observation, so once per decision on a node that just reported.
        knot_t: list[float] = []
        knot_c: list[float] = []
        knot_h_max: list[float] = []
        h_max = -math.inf
        buckets, seen, half_life = self._buckets, self._seen, self._half_life
        for key in self._bucket_keys:
            bucket = buckets[key]
            weight = len(bucket.log_ratios) * math.pow(0.5, (seen - bucket.last_seen) / half_life)
            c = g + weight / (weight + _BUCKET_PRIOR_WEIGHT) * (bucket.median - g)
            h = key * _LOG2 + c
            if h > h_max:
                h_max = h
            knot_t.append(float(key))
            knot_c.append(c)
            knot_h_max.append(h_max)
        self._knot_t, self._knot_c, self._knot_h_max = knot_t, knot_c, knot_h_max
        # Every c(t) lies between knots' c or between a knot's and g (``_shape``).
        self._floor_factor = math.exp(min(g, *knot_c)) if knot_c else math.exp(g)

    def _shape(self, position: float) -> tuple[float, int]:
        """The log correction at ``position`` and the index of the last knot <= it."""
        knots = self._knot_t
        if not knots:
            return self._global_correction, -1
        right = bisect_right(knots, position)
        if right == 0:  # below the data: fade from the first knot to the global, slowly
            # enough that ``log estimate`` keeps rising (|dc/dt| <= ln2 / 2).
            span = max(
                _EDGE_FADE_BUCKETS, abs(self._global_correction - self._knot_c[0]) / (0.5 * _LOG2)
            )
            fade = min(1.0, (knots[0] - position) / span)
            c = self._knot_c[0] + fade * (self._global_correction - self._knot_c[0])
            return c, -1
        if right == len(knots):  # above the data
            fade = min(1.0, (position - knots[-1]) / _EDGE_FADE_BUCKETS)
            c = self._knot_c[-1] + fade * (self._global_correction - self._knot_c[-1])
            return c, right - 1
        t0, t1 = knots[right - 1], knots[right]
        share = (position - t0) / (t1 - t0)
        c0, c1 = self._knot_c[right - 1], self._knot_c[right]
        return c0 + share * (c1 - c0), right - 1

    def estimate(self, prior_s: float) -> float:
        """The corrected estimate; its log ``h`` (in 1 us units) is non-decreasing in
        ``prior_s``. One flat body: the scheduler asks this ~100 times per decision."""
        if not prior_s > 0:
            return 0.0
        if self._seen == 0:
            return prior_s
        if self._dirty:
            self._refresh()
        position = math.log2(prior_s / _POSITION_UNIT_S)
        c, last_knot = self._shape(position)
        h = position * _LOG2 + c
        if last_knot >= 0:
            h = max(h, self._knot_h_max[last_knot])
        if not math.isfinite(h):  # prior_s itself infinite
            return prior_s
        return _POSITION_UNIT_S * math.exp(min(h, _MAX_LOG_ESTIMATE))

    def floor(self, prior_s: float) -> float:
        """A lower bound of ``estimate(prior_s)``: the prior times the smallest factor
        the correction applies at any size (``c(t)`` never goes below its knots' and
        the global factor; the running maximum only raises it). O(1) between
        observations: what lets the scheduler pass over nodes that cannot win."""
        if not (prior_s > 0 and self._seen):  # the estimate is then the prior (or 0)
            return prior_s if prior_s > 0 else 0.0
        return min(prior_s * self.floor_factor(), _MAX_ESTIMATE_S)

    def floor_factor(self) -> float:
        """What ``floor`` multiplies a positive prior estimate by, before its cap (1
        before any observation: ``floor`` is then the prior itself)."""
        if not self._seen:
            return 1.0
        if self._dirty:
            self._refresh()
        return self._floor_factor

    def has_evidence(self, prior_s: float) -> bool:
        """Enough observations in all, or a few within 4x of ``prior_s``."""
        if not prior_s > 0 or not self._buckets:
            return False
        if len(self._global) >= _EVIDENCE_GLOBAL_OBSERVATIONS:
            return True
        key = self._bucket_of(self.position(prior_s))
        near = 0
        for k in range(key - _EVIDENCE_RADIUS, key + _EVIDENCE_RADIUS + 1):
            bucket = self._buckets.get(k)
            if bucket is not None:
                near += len(bucket.log_ratios)
        return near >= _EVIDENCE_MIN_OBSERVATIONS


_P = TypeVar("_P", PrefillPrior, DecodePrior)


class _CorrectedModel(Generic[_P]):
    """Shared parts of the prefill and decode models: a prior times a learned factor."""

    __slots__ = ("_bucket_window", "_correction", "_floor_row", "_half_life", "_on_change",
                 "_prior", "_prior_measured", "_prior_weight", "_version", "_window")  # fmt: skip

    def __init__(
        self,
        prior: _P,
        *,
        prior_measured: bool = False,
        prior_weight: float = 0.25,
        window: int = 64,
        bucket_window: int = 9,
        half_life: float = 512.0,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        """``on_change`` is called whenever ``version`` changes after construction (a
        new prior or observation), e.g. to refresh what a caller keeps of the estimates."""
        self._on_change: Callable[[], None] | None = None
        self._prior: _P = prior
        self._prior_measured = bool(prior_measured)
        self._prior_weight = prior_weight
        self._window = window
        self._bucket_window = bucket_window
        self._half_life = half_life
        self._version = 0
        self._correction = self._fresh_correction()
        self._floor_row: tuple[int, tuple[float, float, float, float]] | None = None
        self._on_change = on_change

    def _changed(self) -> None:
        self._version += 1
        if self._on_change is not None:
            self._on_change()

    @property
    def version(self) -> int:
        """Changes whenever an estimate may have changed (a new prior or observation)."""
        return self._version

    def _fresh_correction(self) -> _LogRatioCorrection:
        self._changed()
        return _LogRatioCorrection(
            self._prior_weight, self._window, self._bucket_window, self._half_life
        )

    @property
    def prior_measured(self) -> bool:
        """The prior was measured on this node's engine (start-up calibration)."""
        return self._prior_measured

    @property
    def sample_count(self) -> int:
        """Observations learned from since the prior was (re)set."""
        return self._correction.seen

    def _has_evidence(self, prior_s: float) -> bool:
        return self._prior_measured or self._correction.has_evidence(prior_s)

    def floor_factor(self) -> float:
        """The smallest factor the learned correction applies to the prior at any size
        (1 before any observation); see ``_LogRatioCorrection.floor``."""
        return self._correction.floor_factor()

    def floor_row(self) -> tuple[float, float, float, float]:
        """The prior's three coefficients and ``floor_factor``: one row of the terms
        ``prefill_floors`` and ``decode_floors`` evaluate over arrays (the scheduler keeps
        them per node, ``node_columns``), remembered until the model changes."""
        memo = self._floor_row
        if memo is not None and memo[0] == self._version:
            return memo[1]
        row = (*self._prior.coefficients, self.floor_factor())
        self._floor_row = (self._version, row)
        return row

    @property
    def prior(self) -> _P:
        return self._prior

    def set_prior(self, prior: _P, *, measured: bool) -> None:
        """Replace the prior (e.g. by the node's calibration); learned factors restart."""
        self._prior = prior
        self._prior_measured = bool(measured)
        self._correction = self._fresh_correction()


# ---------------------------------------------------------------------- prefill


class PrefillTimeModel(_CorrectedModel[PrefillPrior]):
    """Predicted prefill seconds from total and cached tokens; learns from observations.

    ``estimate = prior(n, p) * learned factor`` (module docstring, "Learning").
    """

    __slots__ = ()

    @property
    def coefficients(self) -> PrefillPrior:
        """The prior scaled by the size-independent learned factor (the prior itself
        until the first observation); estimates also apply the per-size shape."""
        if self._correction.seen == 0:
            return self._prior
        factor = math.exp(self._correction.global_correction)
        return PrefillPrior(*(c * factor for c in self._prior.coefficients))

    @property
    def per_token_s(self) -> float:
        """``coefficients.per_token_s`` without building the scaled prior (the queue
        estimate asks it per prefill node per decision)."""
        if self._correction.seen == 0:
            return self._prior.per_token_s
        return self._prior.per_token_s * math.exp(self._correction.global_correction)

    def _prior_s(self, total_tokens: int, cached_tokens: int) -> float:
        f1, f2 = prefill_features(total_tokens, cached_tokens)
        prior = self._prior
        return prior.fixed_s + prior.per_token_s * f1 + prior.per_token_context_s * f2

    def observe(self, total_tokens: int, cached_tokens: int, duration_s: float) -> None:
        """Record one measured prefill; non-finite or non-positive durations are ignored."""
        prior_s = self._prior_s(total_tokens, cached_tokens)
        self._correction.observe(prior_s, duration_s)
        self._changed()

    def estimate(self, total_tokens: int, cached_tokens: int) -> float:
        """Predicted seconds (>= 0) to prefill ``total_tokens`` with ``cached_tokens`` reused."""
        return self._correction.estimate(self._prior_s(total_tokens, cached_tokens))

    def estimate_floor(self, total_tokens: int, cached_tokens: int) -> float:
        """A lower bound of ``estimate(total_tokens, cached_tokens)`` (O(1))."""
        return self._correction.floor(self._prior_s(total_tokens, cached_tokens))

    def has_evidence(self, total_tokens: int, cached_tokens: int) -> bool:
        """The estimate rests on a measured prior or on observations of similar size."""
        return self._has_evidence(self._prior_s(total_tokens, cached_tokens))


# ----------------------------------------------------------------------- decode


class DecodeTimeModel(_CorrectedModel[DecodePrior]):
    """Predicted time between tokens from batch size and batch KV tokens."""

    __slots__ = ()

    @property
    def coefficients(self) -> DecodePrior:
        """The prior scaled by the size-independent learned factor (module docstring)."""
        if self._correction.seen == 0:
            return self._prior
        factor = math.exp(self._correction.global_correction)
        return DecodePrior(*(c * factor for c in self._prior.coefficients))

    def _prior_s(self, batch_requests: float, context_tokens: float) -> float:
        batch, context = decode_features(batch_requests, context_tokens)
        prior = self._prior
        return prior.fixed_s + prior.per_request_s * batch + prior.per_context_token_s * context

    def observe(self, batch_requests: float, context_tokens: float, tbt_s: float) -> None:
        """Record one measured step; non-finite or non-positive times are ignored."""
        self._correction.observe(self._prior_s(batch_requests, context_tokens), tbt_s)
        self._changed()

    def estimate(self, batch_requests: float, context_tokens: float) -> float:
        """Predicted seconds (>= 0) between tokens for this batch (counts may be expected
        values, hence floats)."""
        return self._correction.estimate(self._prior_s(batch_requests, context_tokens))

    def has_evidence(self, batch_requests: float, context_tokens: float) -> bool:
        """The estimate rests on a measured prior or on observations of similar size."""
        return self._has_evidence(self._prior_s(batch_requests, context_tokens))


def _floors(terms: FloatArray, first: FloatArray, second: FloatArray) -> FloatArray:
    # The prior in the models' own operations (``fixed + a*f1 + b*f2``), then ``floor``.
    prior_s = terms[:, 0] + terms[:, 1] * first + terms[:, 2] * second
    return np.where(prior_s > 0, np.minimum(prior_s * terms[:, 3], _MAX_ESTIMATE_S), 0.0)


def prefill_floors(terms: FloatArray, total_tokens: int, cached_tokens: IntArray) -> FloatArray:
    """Lower bounds of ``models[i].estimate_floor(total_tokens, cached_tokens[i])``'s
    estimate for ``terms`` (row ``i``: ``models[i].floor_row()``): the features of
    ``prefill_features`` (cached tokens >= 0), then each model's ``floor`` (the estimate
    itself for a model that has observed nothing). For passing over nodes that cannot
    win."""
    cached = np.minimum(cached_tokens, total_tokens)
    uncached = (total_tokens - cached).astype(np.float64)
    return _floors(terms, uncached, uncached * (total_tokens + cached).astype(np.float64))


def decode_floors(
    terms: FloatArray, batch_requests: FloatArray, context_tokens: FloatArray
) -> FloatArray:
    """Lower bounds of ``models[i].estimate(batch_requests[i], context_tokens[i])`` for
    ``terms`` (row ``i``: ``models[i].floor_row()``; amounts finite and >= 0,
    ``decode_features``' domain), as ``prefill_floors``."""
    return _floors(terms, batch_requests, context_tokens)
