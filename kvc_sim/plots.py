"""PNG plots of a replay: TTFT CDF, hit ratio and load over time per run, capacity curves.

The load plot is drawn only for runs with load samples (a live replay has none).

matplotlib is imported inside ``write_plots`` (Agg backend), so the simulator imports and
runs without it; ``write_plots`` returns the files it wrote ([] when matplotlib is absent).

Inputs are plain numbers (``PlotRun``), not simulator objects. Knobs: none (fixed sizes,
110 dpi; TTFT on a symlog axis). Complexity O(R log R) for the CDFs of R requests per run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PlotRun", "SweepPoint", "write_plots"]


@dataclass(frozen=True, slots=True)
class SweepPoint:
    request_rate_per_s: float
    effective_by_tbt: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class PlotRun:
    name: str
    ttfts_s: Sequence[float]
    hit_ratio: float
    load_t_s: Sequence[float]
    prefill_load: Sequence[float]
    decode_load: Sequence[float]
    sweep: Sequence[SweepPoint] = ()


def write_plots(out_dir: Path, title: str, runs: Sequence[PlotRun]) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib ships with the dev extra
        return []
    written: list[Path] = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        xs = sorted(run.ttfts_s)
        if xs:
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=run.name)
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of served requests")
    ax.set_title(f"{title}: TTFT CDF")
    ax.grid(True, alpha=0.3)
    ax.legend()
    path = out_dir / "ttft_cdf.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [r.name for r in runs]
    ratios = [r.hit_ratio * 100 for r in runs]
    bars = ax.bar(names, ratios, color="tab:blue")
    ax.bar_label(bars, fmt="%.1f%%")
    ax.set_ylabel("cached input tokens (%)")
    ax.set_title(f"{title}: prefix cache hit ratio")
    ax.tick_params(axis="x", rotation=20)
    path = out_dir / "hit_ratio.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    loaded = [r for r in runs if r.load_t_s]  # a live replay has no load samples
    if loaded:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
        for run in loaded:
            top.plot(run.load_t_s, run.prefill_load, label=run.name, linewidth=1)
            bottom.plot(run.load_t_s, run.decode_load, label=run.name, linewidth=1)
        top.set_ylabel("prefill load\n(queue / TTFT SLO)")
        bottom.set_ylabel("decode load\n(TBT / TBT SLO)")
        bottom.set_xlabel("virtual time (s)")
        top.set_title(f"{title}: load over time")
        top.grid(True, alpha=0.3)
        bottom.grid(True, alpha=0.3)
        top.legend(fontsize="small")
        path = out_dir / "load.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    swept = [r for r in runs if r.sweep]
    if swept:
        thresholds = list(swept[0].sweep[0].effective_by_tbt)
        fig, axes = plt.subplots(1, len(thresholds), figsize=(4 * len(thresholds), 4), sharey=True)
        axes_list = list(axes) if len(thresholds) > 1 else [axes]
        for ax, key in zip(axes_list, thresholds, strict=True):
            for run in swept:
                xs = [p.request_rate_per_s for p in run.sweep]
                ys = [p.effective_by_tbt[key] * 100 for p in run.sweep]
                ax.plot(xs, ys, marker="o", label=run.name)
            ax.set_title(f"TBT ≤ {float(key) * 1000:.0f} ms")
            ax.set_xlabel("request rate (req/s)")
            ax.grid(True, alpha=0.3)
        axes_list[0].set_ylabel("effective request capacity (%)")
        axes_list[0].legend(fontsize="small")
        path = out_dir / "capacity.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
