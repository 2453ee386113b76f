"""Time estimates for KV-centric scheduling (Mooncake Algorithm 1, §4.1-§4.3).

Algorithm 1 needs three numbers per candidate: how long a prefill of ``n`` tokens with
``p`` of them cached takes (``EstimatePrefillExecutionTime``), how long moving a KV
prefix between two nodes takes (``EstimateKVCacheTransferTime``), and the time between
tokens a decode instance will run at (``SelectDecodingInstance``, early rejection).
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

Fitting (one implementation, ``_ShrunkLeastSquares``, for both models)
    Three non-negative coefficients on features ``x = [1, f1, f2]`` (prefill:
    ``[1, u, u*(n + p)]``; decode: ``[1, batch, ctx]``). Features are first divided by
    their RMS over the samples (``s_j``; 1 when all zero), so the 3x3 normal matrix
    ``G = Z'Z`` of the scaled features ``Z`` has ``n`` (sample count) on its diagonal and
    is well conditioned whatever the units (tokens vs tokens^2 differ by ~1e5). In those
    coordinates ``g`` (``g_j = beta_j * s_j``: seconds at a typical feature size) minimises::

        |y - Z g|^2  +  (w/n) |Z (g - g0)|^2  +  0.01 w |g - g0|^2,   g >= 0

    with ``g0`` the prior and ``w = prior_weight``. The middle term is ``w`` pseudo-
    observations shaped like the data (a Zellner g-prior): in every direction the data
    pins down, the fit is exactly ``(n * least_squares + w * prior) / (n + w)``, so the
    prior fades as ``w / (n + w)`` (3% at 256 samples with w = 8). The small last term
    keeps directions the data cannot see (too few samples, collinear features) on the
    prior and the system positive definite. The 3x3 system is solved by Cholesky, and
    ``g >= 0`` exactly by enumerating the 8 active sets of the 3-variable QP: non-negative
    coefficients make every estimate >= 0 and monotone non-decreasing in uncached tokens
    (``u*(n + p) = n^2 - p^2`` grows as ``p`` shrinks), batch and context. Samples live in a
    ring of ``max_samples`` (older ones fall off, so the fit follows drift); the fit is
    redone lazily on the first ``estimate`` after new samples. With no samples the prior
    is returned exactly; a fit that overflows falls back to the prior.

Transfer (``TransferModel``)
    ``T(src, dst, nbytes) = latency_s + nbytes * seconds_per_byte`` per ordered pair. One
    observation ``(nbytes, duration_s)`` cannot tell latency from bandwidth, and updating
    each from the other's current value oscillates (tiny transfers turn a small latency
    error into a huge bandwidth error). So the EWMA is taken of the *regression sums*
    instead: every observation multiplies the pair's sums ``sum w``, ``sum w*x``,
    ``sum w*x^2``, ``sum w*y``, ``sum w*x*y`` (``x`` bytes, ``y`` seconds) by
    ``1 - alpha`` and adds itself with weight 1 — an exponentially weighted least-squares
    line, memory ~``1/alpha`` transfers. The defaults enter as one pseudo-observation
    that ages like data (so they vanish after a few dozen transfers), with a 1e-6 ridge
    floor keeping the 2x2 system solvable when every transfer had the same size (then
    only ``latency + size*spb`` at that size is pinned down — which is what estimates at
    that size need). Sizes are scaled by their weighted RMS and both terms kept >= 0
    (same non-negative solver as above); bandwidth is capped at 100x the default (a fit
    that blames everything on latency would otherwise claim an infinitely fast link).
    Noiseless transfers of >= 2 sizes converge to the true latency and bandwidth.
    Degenerate observations (``nbytes <= 0``, ``duration_s <= 0``, non-finite) are
    ignored. Unknown pairs use the defaults. At most ``max_pairs`` pairs are kept (least
    recently observed dropped first).

Complexity
    prefill/decode ``estimate`` O(1), plus one O(max_samples) refit on the first call
    after new samples; ``observe`` O(1). Transfer ``observe`` O(1) (it refits the pair's
    2x2 system), ``estimate`` O(1). Memory O(max_samples) per model, O(max_pairs).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import product
from typing import Final

from conductor.core.prefix_index import NodeId

__all__ = [
    "DecodePrior",
    "DecodeTimeModel",
    "PrefillPrior",
    "PrefillTimeModel",
    "TransferModel",
]

_Vec3 = tuple[float, float, float]
_N_COEF: Final = 3
_RIDGE_FRACTION: Final = 0.01  # share of the prior weight spread as a plain ridge
_TRANSFER_RIDGE_FLOOR: Final = 1e-6  # relative to the EW sample weight
_MAX_BANDWIDTH_OVER_DEFAULT: Final = 100.0  # a fit never claims a link 100x the default


def _check_coefficients(name: str, values: _Vec3) -> None:
    for value in values:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} coefficients must be finite and >= 0, got {values!r}")


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


# ------------------------------------------------------------------------ priors


@dataclass(frozen=True, slots=True)
class PrefillPrior:
    """``T = fixed_s + per_token_s*u + per_token_context_s*u*(n_total + n_cached)``."""

    fixed_s: float
    per_token_s: float  # per uncached token: projections + MLP
    per_token_context_s: float  # per (uncached token x context token): attention

    def __post_init__(self) -> None:
        _check_coefficients(
            "PrefillPrior", (self.fixed_s, self.per_token_s, self.per_token_context_s)
        )

    @classmethod
    def from_flops(
        cls,
        *,
        layers: int,
        hidden: int,
        peak_flops: float,
        mfu: float,
        a: float = 4.0,
        b: float = 22.0,
        fixed_s: float = 0.0,
    ) -> PrefillPrior:
        """Coefficients from Eq. (1) ``flops(n) = l*(a*n^2*d + b*n*d^2)`` (module docstring).

        ``peak_flops`` is the instance's total peak (e.g. 8 x 312e12 for 8xA800, BF16
        dense) and ``mfu`` (0, 1] the fraction of it a prefill actually achieves.
        """
        if layers <= 0 or hidden <= 0:
            raise ValueError(f"layers and hidden must be > 0, got {layers}, {hidden}")
        if not (math.isfinite(peak_flops) and peak_flops > 0):
            raise ValueError(f"peak_flops must be finite and > 0, got {peak_flops!r}")
        if not (math.isfinite(mfu) and 0 < mfu <= 1):
            raise ValueError(f"mfu must lie in (0, 1], got {mfu!r}")
        flops_per_s = peak_flops * mfu
        return cls(
            fixed_s=fixed_s,
            per_token_s=layers * b * hidden * hidden / flops_per_s,
            per_token_context_s=layers * a * hidden / flops_per_s,
        )

    @property
    def coefficients(self) -> _Vec3:
        return (self.fixed_s, self.per_token_s, self.per_token_context_s)


@dataclass(frozen=True, slots=True)
class DecodePrior:
    """``TBT = fixed_s + per_request_s*batch_requests + per_context_token_s*context_tokens``."""

    fixed_s: float  # one step with an empty batch: weights read once
    per_request_s: float
    per_context_token_s: float  # per KV token in the batch: attention reads

    def __post_init__(self) -> None:
        _check_coefficients(
            "DecodePrior", (self.fixed_s, self.per_request_s, self.per_context_token_s)
        )

    @property
    def coefficients(self) -> _Vec3:
        return (self.fixed_s, self.per_request_s, self.per_context_token_s)


# ------------------------------------------------------------- shared fitting


def _solve_spd(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Cholesky solve of a small symmetric positive-definite system (None if not PD)."""
    size = len(rhs)
    lower = [[0.0] * size for _ in range(size)]
    for i in range(size):
        for j in range(i + 1):
            acc = matrix[i][j] - sum(lower[i][k] * lower[j][k] for k in range(j))
            if i == j:
                if acc <= 0.0 or not math.isfinite(acc):
                    return None
                lower[i][i] = math.sqrt(acc)
            else:
                lower[i][j] = acc / lower[j][j]
    forward = [0.0] * size
    for i in range(size):
        forward[i] = (rhs[i] - sum(lower[i][k] * forward[k] for k in range(i))) / lower[i][i]
    solution = [0.0] * size
    for i in reversed(range(size)):
        tail = sum(lower[k][i] * solution[k] for k in range(i + 1, size))
        solution[i] = (forward[i] - tail) / lower[i][i]
    return solution


class _ShrunkLeastSquares:
    """Non-negative ridge regression of y on 3 features, shrunk toward a prior.

    See "Fitting" in the module docstring. Keeps a bounded ring of samples and refits
    lazily; ``coefficients`` are in the features' original units.
    """

    __slots__ = ("_coefficients", "_dirty", "_prior", "_prior_weight", "_samples")

    def __init__(self, prior: _Vec3, prior_weight: float, max_samples: int) -> None:
        if not (math.isfinite(prior_weight) and prior_weight > 0):
            raise ValueError(f"prior_weight must be finite and > 0, got {prior_weight!r}")
        if isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples <= 0:
            raise ValueError(f"max_samples must be a positive int, got {max_samples!r}")
        self._prior = prior
        self._prior_weight = float(prior_weight)
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=max_samples)
        self._coefficients = prior
        self._dirty = False

    @property
    def sample_count(self) -> int:
        return len(self._samples)

    def add(self, f1: float, f2: float, y: float) -> None:
        self._samples.append((f1, f2, y))
        self._dirty = True

    @property
    def coefficients(self) -> _Vec3:
        if self._dirty:
            self._coefficients = self._fit()
            self._dirty = False
        return self._coefficients

    def _fit(self) -> _Vec3:
        samples = self._samples
        count = len(samples)
        if count == 0:
            return self._prior
        # Per-feature RMS scales: the scaled normal matrix has ``count`` on its diagonal.
        scales = [1.0, 1.0, 1.0]
        for j in (1, 2):
            mean_sq = math.fsum(s[j - 1] * s[j - 1] for s in samples) / count
            if mean_sq > 0 and math.isfinite(mean_sq):
                scales[j] = math.sqrt(mean_sq)
        gram = [[0.0] * _N_COEF for _ in range(_N_COEF)]
        moment = [0.0] * _N_COEF
        for f1, f2, y in samples:
            z = (1.0, f1 / scales[1], f2 / scales[2])
            for i in range(_N_COEF):
                moment[i] += z[i] * y
                row = gram[i]
                for j in range(i + 1):
                    row[j] += z[i] * z[j]
        for i in range(_N_COEF):
            for j in range(i):
                gram[j][i] = gram[i][j]
        # Prior = ``w`` pseudo-observations shaped like the data (g-prior: in every
        # direction the data pins down, fit = (n*data + w*prior)/(n + w)), plus a small
        # ridge so directions the data cannot see (collinear or too few samples) stay on
        # the prior and the system stays positive definite.
        prior_scaled = [self._prior[j] * scales[j] for j in range(_N_COEF)]
        shaped = self._prior_weight / count
        ridge = _RIDGE_FRACTION * self._prior_weight
        prior_pull = [
            sum(gram[i][j] * prior_scaled[j] for j in range(_N_COEF)) for i in range(_N_COEF)
        ]
        for i in range(_N_COEF):
            moment[i] += shaped * prior_pull[i] + ridge * prior_scaled[i]
            for j in range(_N_COEF):
                gram[i][j] *= 1.0 + shaped
            gram[i][i] += ridge
        gamma = _nonnegative_quadratic_min(gram, moment)
        fitted = (gamma[0] / scales[0], gamma[1] / scales[1], gamma[2] / scales[2])
        if not all(math.isfinite(c) and c >= 0 for c in fitted):  # overflowed: keep the prior
            return self._prior
        return fitted


def _nonnegative_quadratic_min(gram: list[list[float]], moment: list[float]) -> list[float]:
    """argmin over g >= 0 of g'Ag - 2b'g for SPD ``A`` (3x3), by active-set enumeration.

    The constrained optimum is the unconstrained optimum on its own support, so trying
    every support (8 for 3 variables) and keeping the best feasible one is exact.
    """
    size = len(moment)
    best: list[float] = [0.0] * size
    best_value = 0.0  # objective at g = 0
    for support in product((False, True), repeat=size):
        free = [i for i in range(size) if support[i]]
        if not free:
            continue
        sub = [[gram[i][j] for j in free] for i in free]
        solved = _solve_spd(sub, [moment[i] for i in free])
        if solved is None or min(solved) < 0:
            continue
        candidate = [0.0] * size
        for i, value in zip(free, solved, strict=True):
            candidate[i] = value
        value = sum(
            candidate[i] * gram[i][j] * candidate[j] for i in range(size) for j in range(size)
        ) - 2 * sum(moment[i] * candidate[i] for i in range(size))
        if value < best_value:
            best, best_value = candidate, value
    return best


# ---------------------------------------------------------------------- prefill


class PrefillTimeModel:
    """Predicted prefill seconds from total and cached tokens; learns from observations."""

    __slots__ = ("_fit", "_prior")

    def __init__(
        self, prior: PrefillPrior, prior_weight: float = 8.0, max_samples: int = 256
    ) -> None:
        self._prior = prior
        self._fit = _ShrunkLeastSquares(prior.coefficients, prior_weight, max_samples)

    @property
    def prior(self) -> PrefillPrior:
        return self._prior

    @property
    def sample_count(self) -> int:
        return self._fit.sample_count

    @property
    def coefficients(self) -> PrefillPrior:
        """The current fit (the prior itself until the first observation)."""
        if self._fit.sample_count == 0:
            return self._prior
        fixed_s, per_token_s, per_token_context_s = self._fit.coefficients
        return PrefillPrior(fixed_s, per_token_s, per_token_context_s)

    @staticmethod
    def _features(total_tokens: int, cached_tokens: int) -> tuple[float, float]:
        _check_count("total_tokens", total_tokens)
        _check_count("cached_tokens", cached_tokens)
        cached = min(cached_tokens, total_tokens)  # more cached than asked: all cached
        uncached = total_tokens - cached
        return float(uncached), float(uncached) * float(total_tokens + cached)

    def observe(self, total_tokens: int, cached_tokens: int, duration_s: float) -> None:
        """Record one measured prefill; non-finite or negative durations are ignored."""
        f1, f2 = self._features(total_tokens, cached_tokens)
        if not math.isfinite(duration_s) or duration_s < 0:
            return
        self._fit.add(f1, f2, duration_s)

    def estimate(self, total_tokens: int, cached_tokens: int) -> float:
        """Predicted seconds (>= 0) to prefill ``total_tokens`` with ``cached_tokens`` reused."""
        f1, f2 = self._features(total_tokens, cached_tokens)
        c0, c1, c2 = self._fit.coefficients
        return c0 + c1 * f1 + c2 * f2


# ----------------------------------------------------------------------- decode


class DecodeTimeModel:
    """Predicted time between tokens from batch size and batch KV tokens."""

    __slots__ = ("_fit", "_prior")

    def __init__(
        self, prior: DecodePrior, prior_weight: float = 8.0, max_samples: int = 256
    ) -> None:
        self._prior = prior
        self._fit = _ShrunkLeastSquares(prior.coefficients, prior_weight, max_samples)

    @property
    def prior(self) -> DecodePrior:
        return self._prior

    @property
    def sample_count(self) -> int:
        return self._fit.sample_count

    @property
    def coefficients(self) -> DecodePrior:
        """The current fit (the prior itself until the first observation)."""
        if self._fit.sample_count == 0:
            return self._prior
        fixed_s, per_request_s, per_context_token_s = self._fit.coefficients
        return DecodePrior(fixed_s, per_request_s, per_context_token_s)

    def observe(self, batch_requests: int, context_tokens: int, tbt_s: float) -> None:
        """Record one measured step; non-finite or negative times are ignored."""
        _check_count("batch_requests", batch_requests)
        _check_count("context_tokens", context_tokens)
        if not math.isfinite(tbt_s) or tbt_s < 0:
            return
        self._fit.add(float(batch_requests), float(context_tokens), tbt_s)

    def estimate(self, batch_requests: int, context_tokens: int) -> float:
        """Predicted seconds (>= 0) between tokens for this batch."""
        _check_count("batch_requests", batch_requests)
        _check_count("context_tokens", context_tokens)
        c0, c1, c2 = self._fit.coefficients
        return c0 + c1 * batch_requests + c2 * context_tokens


# --------------------------------------------------------------------- transfer


@dataclass(slots=True)
class _Link:
    """Exponentially weighted sums of one pair's transfers, and the fit they give."""

    latency_s: float
    seconds_per_byte: float
    prior_weight: float = 1.0  # the defaults as one pseudo-observation, aging like data
    w: float = 0.0  # sum of weights
    x: float = 0.0  # sum of w * nbytes
    xx: float = 0.0  # sum of w * nbytes^2
    y: float = 0.0  # sum of w * duration_s
    xy: float = 0.0  # sum of w * nbytes * duration_s


class TransferModel:
    """Per (src, dst) EWMA of latency and bandwidth; ``estimate = latency + bytes/bw``."""

    __slots__ = ("_alpha", "_default_latency_s", "_default_spb", "_links", "_max_pairs")

    def __init__(
        self,
        default_bandwidth_bytes_per_s: float,
        default_latency_s: float,
        alpha: float = 0.2,
        max_pairs: int = 65_536,
    ) -> None:
        if not (math.isfinite(default_bandwidth_bytes_per_s) and default_bandwidth_bytes_per_s > 0):
            raise ValueError(
                f"default_bandwidth_bytes_per_s must be finite and > 0, "
                f"got {default_bandwidth_bytes_per_s!r}"
            )
        if not (math.isfinite(default_latency_s) and default_latency_s >= 0):
            raise ValueError(
                f"default_latency_s must be finite and >= 0, got {default_latency_s!r}"
            )
        if not (math.isfinite(alpha) and 0 < alpha <= 1):
            raise ValueError(f"alpha must lie in (0, 1], got {alpha!r}")
        if isinstance(max_pairs, bool) or not isinstance(max_pairs, int) or max_pairs <= 0:
            raise ValueError(f"max_pairs must be a positive int, got {max_pairs!r}")
        self._default_spb = 1.0 / default_bandwidth_bytes_per_s
        self._default_latency_s = float(default_latency_s)
        self._alpha = float(alpha)
        self._max_pairs = max_pairs
        self._links: OrderedDict[tuple[NodeId, NodeId], _Link] = OrderedDict()

    def observe(self, src: NodeId, dst: NodeId, nbytes: int, duration_s: float) -> None:
        """Fold one finished transfer into the pair's estimate (degenerate ones ignored)."""
        if not (nbytes > 0 and math.isfinite(nbytes) and math.isfinite(duration_s)):
            return
        if duration_s <= 0:
            return
        pair = (src, dst)
        link = self._links.get(pair)
        if link is None:
            link = _Link(self._default_latency_s, self._default_spb)
            self._links[pair] = link
            if len(self._links) > self._max_pairs:
                self._links.popitem(last=False)
        else:
            self._links.move_to_end(pair)
        keep = 1.0 - self._alpha
        size = float(nbytes)
        link.prior_weight *= keep
        link.w = link.w * keep + 1.0
        link.x = link.x * keep + size
        link.xx = link.xx * keep + size * size
        link.y = link.y * keep + duration_s
        link.xy = link.xy * keep + size * duration_s
        self._refit(link)

    def _refit(self, link: _Link) -> None:
        # Ridge toward the defaults in scaled coordinates (bytes / RMS bytes), so the
        # 2x2 system is well conditioned; the floor keeps it solvable when every
        # transfer had the same size (then only latency + size*spb is pinned down).
        scale = math.sqrt(link.xx / link.w)
        ridge = max(link.prior_weight, _TRANSFER_RIDGE_FLOOR * link.w)
        prior_g = self._default_spb * scale
        gram = [
            [link.w + ridge, link.x / scale],
            [link.x / scale, link.xx / (scale * scale) + ridge],
        ]
        moment = [
            link.y + ridge * self._default_latency_s,
            link.xy / scale + ridge * prior_g,
        ]
        latency_s, g = _nonnegative_quadratic_min(gram, moment)
        link.latency_s = latency_s
        # A fit that explains everything by latency would claim infinite bandwidth.
        link.seconds_per_byte = max(g / scale, self._default_spb / _MAX_BANDWIDTH_OVER_DEFAULT)

    def estimate(self, src: NodeId, dst: NodeId, nbytes: int) -> float:
        """Predicted seconds to move ``nbytes`` (``<= 0`` bytes: latency only)."""
        link = self._links.get((src, dst))
        if link is None:
            latency_s, spb = self._default_latency_s, self._default_spb
        else:
            latency_s, spb = link.latency_s, link.seconds_per_byte
        return latency_s + max(nbytes, 0) * spb

    def bandwidth_bytes_per_s(self, src: NodeId, dst: NodeId) -> float:
        link = self._links.get((src, dst))
        return 1.0 / (self._default_spb if link is None else link.seconds_per_byte)

    def latency_s(self, src: NodeId, dst: NodeId) -> float:
        link = self._links.get((src, dst))
        return self._default_latency_s if link is None else link.latency_s

    def forget_node(self, node: NodeId) -> None:
        """Drop every pair touching ``node`` (it left the fleet). O(pairs)."""
        for pair in [p for p in self._links if node in p]:
            del self._links[pair]
