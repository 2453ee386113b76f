"""The compiled loops of ``kvc/_native.c``, or ``None`` where the module was not built.

Loops of the request path that have a C twin: the chained block keys
(``kvc.block_keys``); the shadow prefix index's key lookups and the placing of new keys
(``conductor.core.prefix_index``); the output-length model's rebuild, Kaplan-Meier and
snapshot (``conductor.core.output_length``). Each Python
version stays the specification and the fallback; the C one gives the same results, bit
for bit, and the tests hold them to each other.

The module is an optional extension (``setup.py``): an install where no C compiler is
found succeeds without it, and everything runs in Python. ``AVAILABLE`` says which this
process runs; ``KVC_NATIVE=0`` forces Python (for comparing the two, not for production).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Final, TypeAlias

__all__ = [
    "AVAILABLE",
    "ChainKeys",
    "KaplanMeier",
    "PlaceKeys",
    "ProbeRuns",
    "ProbeSetIds",
    "ProbeSlots",
    "SurvivalAreas",
    "SurvivalPmf",
    "chain_keys",
    "kaplan_meier",
    "log_if_missing",
    "place_keys",
    "probe_runs",
    "probe_set_ids",
    "probe_slots",
    "survival_areas",
    "survival_pmf",
]

ChainKeys: TypeAlias = Callable[[Sequence[int], bytes, bytes, int, int, int], list[int]]
# The buffers (NumPy arrays here) are typed as object: NumPy's stubs do not declare the
# buffer protocol before Python 3.12.
ProbeSetIds: TypeAlias = Callable[
    [Sequence[int], int, int, object, object, object, int, int, int, object], None
]
ProbeRuns: TypeAlias = Callable[
    [Sequence[int], int, int, object, object, object, int, int, int, int], list[int]
]
KaplanMeier: TypeAlias = Callable[[object, object, object, float, object], list[float]]
ProbeSlots: TypeAlias = Callable[[Sequence[int], object, object, object, int, int, int], list[int]]
PlaceKeys: TypeAlias = Callable[[Sequence[int], int, object, object, object, int, int, int], int]
SurvivalAreas: TypeAlias = Callable[[Sequence[float], object, float], tuple[list[float], int]]
SurvivalPmf: TypeAlias = Callable[[Sequence[float], float, object], None]


_OFF: Final = ("0", "false", "no", "off")


def _load() -> (
    tuple[
        ChainKeys,
        ProbeSetIds,
        ProbeRuns,
        KaplanMeier,
        SurvivalAreas,
        SurvivalPmf,
        ProbeSlots,
        PlaceKeys,
    ]
    | None
):
    if os.environ.get("KVC_NATIVE", "").strip().lower() in _OFF:
        return None
    try:
        from kvc import _native
    except ImportError:  # built without a C compiler: the Python twins run
        return None
    return (
        _native.chain_keys,
        _native.probe_set_ids,
        _native.probe_runs,
        _native.kaplan_meier,
        _native.survival_areas,
        _native.survival_pmf,
        _native.probe_slots,
        _native.place_keys,
    )


_loaded: Final = _load()
AVAILABLE: Final = _loaded is not None
chain_keys: Final[ChainKeys | None] = None if _loaded is None else _loaded[0]
probe_set_ids: Final[ProbeSetIds | None] = None if _loaded is None else _loaded[1]
probe_runs: Final[ProbeRuns | None] = None if _loaded is None else _loaded[2]
kaplan_meier: Final[KaplanMeier | None] = None if _loaded is None else _loaded[3]
survival_areas: Final[SurvivalAreas | None] = None if _loaded is None else _loaded[4]
survival_pmf: Final[SurvivalPmf | None] = None if _loaded is None else _loaded[5]
probe_slots: Final[ProbeSlots | None] = None if _loaded is None else _loaded[6]
place_keys: Final[PlaceKeys | None] = None if _loaded is None else _loaded[7]


def log_if_missing(log: logging.Logger) -> None:
    """A warning at start when the Python twins run: correct, but the request path then
    spends more CPU on block keys, prefix lookups and output-length rebuilds
    (docs/benchmarks.md)."""
    if AVAILABLE:
        return
    why = (
        "KVC_NATIVE=0"
        if os.environ.get("KVC_NATIVE", "").strip().lower() in _OFF
        else "kvc._native was not built (no C compiler at install?)"
    )
    log.warning(
        "block keys, prefix lookups and output-length rebuilds run in pure Python: %s; "
        "the results are the same, "
        "the CPU per request is higher. Reinstall with a C compiler to build it.",
        why,
    )
