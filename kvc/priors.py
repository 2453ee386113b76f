"""Cost-model priors and their fitting: what a node measures at start-up and reports.

``PrefillPrior`` and ``DecodePrior`` are the physics-shaped time models described in
``conductor.core.cost_model`` (which learns a correction on top of them); a node agent
fits them from its own start-up measurements (``fit_prefill_prior``, ``fit_decode_prior``,
non-negative least squares in relative error) and sends the coefficients to conductors.
Both sides import them from here, the layer below both services. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product
from typing import Final

__all__ = [
    "DecodePrior",
    "PrefillPrior",
    "decode_features",
    "fit_decode_prior",
    "fit_prefill_prior",
    "nonnegative_quadratic_min",
    "prefill_features",
]

_Vec3 = tuple[float, float, float]
_N_COEF: Final = 3


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


def nonnegative_quadratic_min(gram: list[list[float]], moment: list[float]) -> list[float]:
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


# ------------------------------------------------------------------ calibration

_CALIBRATION_RIDGE: Final = 1e-9  # relative to the sample count, keeps G positive definite
_CALIBRATION_WEIGHT_FLOOR: Final = 1e-3  # of the largest duration (relative weights)


def _fit_nonnegative(rows: Sequence[tuple[float, float, float]]) -> _Vec3:
    """Non-negative least squares of ``y`` on ``[1, f1, f2]`` in *relative* error.

    ``rows`` are ``(f1, f2, y)``. Each row is weighted by ``1 / max(y, 1e-3 * max y)``
    so a 2 ms prompt counts as much as a 2 s one (timings are noisy in proportion to
    their size); features are divided by their weighted RMS so the 3x3 normal matrix is
    well conditioned (tokens vs tokens^2); a 1e-9 ridge keeps it positive definite when
    a feature never varies (its coefficient then goes to 0). Exact on noiseless data.
    """
    y_max = max(y for _, _, y in rows)
    floor = max(y_max * _CALIBRATION_WEIGHT_FLOOR, 1e-300)
    weighted = [(1.0 / max(y, floor), f1, f2, y) for f1, f2, y in rows]
    count = len(weighted)
    scales = [1.0, 1.0, 1.0]
    for j in (1, 2):
        mean_sq = math.fsum((row[0] * row[j]) ** 2 for row in weighted) / count
        if mean_sq > 0 and math.isfinite(mean_sq):
            scales[j] = math.sqrt(mean_sq)
    mean_sq = math.fsum(row[0] ** 2 for row in weighted) / count
    scales[0] = math.sqrt(mean_sq)
    gram = [[0.0] * _N_COEF for _ in range(_N_COEF)]
    moment = [0.0] * _N_COEF
    for w, f1, f2, y in weighted:
        z = (w / scales[0], w * f1 / scales[1], w * f2 / scales[2])
        for i in range(_N_COEF):
            moment[i] += z[i] * w * y
            for j in range(_N_COEF):
                gram[i][j] += z[i] * z[j]
    scale_diag = max(gram[i][i] for i in range(_N_COEF))
    for i in range(_N_COEF):
        gram[i][i] += _CALIBRATION_RIDGE * scale_diag
    gamma = nonnegative_quadratic_min(gram, moment)
    fitted = (gamma[0] / scales[0], gamma[1] / scales[1], gamma[2] / scales[2])
    if not all(math.isfinite(c) and c >= 0 for c in fitted):
        raise ValueError("calibration fit overflowed; samples are out of range")
    return fitted


def _valid_duration(value: float) -> bool:
    return math.isfinite(value) and value > 0


def fit_prefill_prior(samples: Sequence[tuple[int, int, float]]) -> PrefillPrior:
    """A ``PrefillPrior`` fitted to measured ``(total_tokens, cached_tokens, duration_s)``.

    Start-up calibration: non-negative least squares (relative error) of the duration
    on the prior's physical features ``[1, u, u*(n + p)]`` (module docstring). Samples
    with a non-finite or non-positive duration are skipped; raises ``ValueError`` when
    none is left or a token count is invalid. Recovers the coefficients exactly from
    noiseless samples of at least three distinct shapes.
    """
    rows: list[tuple[float, float, float]] = []
    for total_tokens, cached_tokens, duration_s in samples:
        f1, f2 = prefill_features(total_tokens, cached_tokens)
        if _valid_duration(duration_s):
            rows.append((f1, f2, float(duration_s)))
    if not rows:
        raise ValueError("fit_prefill_prior needs at least one sample with a duration > 0")
    return PrefillPrior(*_fit_nonnegative(rows))


def fit_decode_prior(samples: Sequence[tuple[float, float, float]]) -> DecodePrior:
    """A ``DecodePrior`` fitted to measured ``(batch_requests, context_tokens, tbt_s)``.

    Non-negative least squares (relative error) of the step time on ``[1, batch, ctx]``.
    Samples with a non-finite or non-positive time are skipped; raises ``ValueError``
    when none is left or a count is negative or non-finite.
    """
    rows: list[tuple[float, float, float]] = []
    for batch_requests, context_tokens, tbt_s in samples:
        batch, context = decode_features(batch_requests, context_tokens)
        if _valid_duration(tbt_s):
            rows.append((batch, context, float(tbt_s)))
    if not rows:
        raise ValueError("fit_decode_prior needs at least one sample with a tbt_s > 0")
    return DecodePrior(*_fit_nonnegative(rows))


def prefill_features(total_tokens: int, cached_tokens: int) -> tuple[float, float]:
    """``(u, u*(n + p))`` with ``u`` uncached tokens; more cached than total: all cached."""
    # Plain non-negative ints (every call of the scheduler's) skip the checks' calls.
    if not (
        total_tokens.__class__ is int
        and cached_tokens.__class__ is int
        and total_tokens >= 0
        and cached_tokens >= 0
    ):
        _check_count("total_tokens", total_tokens)
        _check_count("cached_tokens", cached_tokens)
    cached = min(cached_tokens, total_tokens)
    uncached = total_tokens - cached
    return float(uncached), float(uncached) * float(total_tokens + cached)


def decode_features(batch_requests: float, context_tokens: float) -> tuple[float, float]:
    # Finite non-negative floats and ints (every call of the scheduler's) skip the checks'
    # calls; NaN fails the comparisons and takes the checks.
    if not (
        (batch_requests.__class__ is float or batch_requests.__class__ is int)
        and (context_tokens.__class__ is float or context_tokens.__class__ is int)
        and 0 <= batch_requests < math.inf
        and 0 <= context_tokens < math.inf
    ):
        _check_amount("batch_requests", batch_requests)
        _check_amount("context_tokens", context_tokens)
    return float(batch_requests), float(context_tokens)


def _check_amount(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
