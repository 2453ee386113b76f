"""Time to move KV between two nodes (Mooncake Algorithm 1's ``EstimateKVCacheTransferTime``).

Model
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
    (``kvc.priors.nonnegative_quadratic_min``, the solver the prior fits use);
    bandwidth is capped at 100x the default (a fit that blames everything on latency
    would otherwise claim an infinitely fast link).
    Noiseless transfers of >= 2 sizes converge to the true latency and bandwidth.
    Degenerate observations (``nbytes <= 0``, ``duration_s <= 0``, non-finite) are
    ignored. Unknown pairs use the defaults. At most ``max_pairs`` pairs are kept (least
    recently observed dropped first).

Complexity
    ``observe`` O(1) (it refits the pair's 2x2 system), ``estimate`` O(1). Memory
    O(max_pairs).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

from conductor.core.prefix_index import NodeId
from kvc.priors import nonnegative_quadratic_min

__all__ = ["TransferModel"]

_TRANSFER_RIDGE_FLOOR: Final = 1e-6  # relative to the EW sample weight
_MAX_BANDWIDTH_OVER_DEFAULT: Final = 100.0  # a fit never claims a link 100x the default


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

    __slots__ = ("_alpha", "_by_source", "_default_latency_s", "_default_spb", "_links",
                 "_max_pairs")  # fmt: skip

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
        # The same links by source, then destination (``links_from``).
        self._by_source: dict[NodeId, dict[NodeId, _Link]] = {}

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
            self._by_source.setdefault(src, {})[dst] = link
            if len(self._links) > self._max_pairs:
                (old_src, old_dst), _ = self._links.popitem(last=False)
                dsts = self._by_source[old_src]
                del dsts[old_dst]
                if not dsts:
                    del self._by_source[old_src]
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
        latency_s, g = nonnegative_quadratic_min(gram, moment)
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

    @property
    def default_fit(self) -> tuple[float, float]:
        """(latency seconds, seconds per byte) of a pair never observed."""
        return self._default_latency_s, self._default_spb

    def fits_from(self, src: NodeId) -> list[tuple[NodeId, float, float]]:
        """(destination, latency seconds, seconds per byte) of every observed pair from
        ``src``; every other destination has ``default_fit``. O(those pairs). A pair's
        ``estimate`` is ``latency + max(nbytes, 0) * seconds_per_byte``: what the
        policies' pull bounds compute over arrays."""
        dsts = self._by_source.get(src)
        if not dsts:
            return []
        return [(dst, link.latency_s, link.seconds_per_byte) for dst, link in dsts.items()]

    def bandwidth_bytes_per_s(self, src: NodeId, dst: NodeId) -> float:
        link = self._links.get((src, dst))
        return 1.0 / (self._default_spb if link is None else link.seconds_per_byte)

    def latency_s(self, src: NodeId, dst: NodeId) -> float:
        link = self._links.get((src, dst))
        return self._default_latency_s if link is None else link.latency_s
