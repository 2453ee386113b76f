"""``kvc bench compare``: the runs of several ``summary.json`` files (simulated or live)
side by side, as one markdown table and one PNG.

Every run of every summary is one row: hit ratio, TTFT p50/p90/p99, TBT (p90 over
requests of the mean of each request's longest 10% of gaps), SLO attainment (the
``effective_capacity_ratio``: share of all requests served within both SLOs), completed
and rejected. A row's label is ``SOURCE:RUN`` (``SOURCE`` the folder or file as given);
missing figures print as ``-``.

Knobs: none. Complexity: O(runs).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CompareError", "CompareRow", "load_rows", "markdown_table", "write_compare_plot"]


class CompareError(ValueError):
    """A path holds no readable ``summary.json``."""


@dataclass(frozen=True, slots=True)
class CompareRow:
    label: str
    mode: str  # "simulated" or "live"
    hit_ratio: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    tbt_p90_s: float | None
    slo_attainment: float | None
    completed: int | None
    rejected: int | None
    requests: int | None


def _number(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def load_rows(paths: Sequence[Path | str]) -> list[CompareRow]:
    """One row per run of each summary (a folder holding ``summary.json``, or the file)."""
    rows: list[CompareRow] = []
    for given in paths:
        path = Path(given)
        file = path / "summary.json" if path.is_dir() else path
        source = str(given).rstrip("/").removesuffix("/summary.json") or str(given)
        try:
            summary = json.loads(file.read_text())
        except OSError as exc:
            raise CompareError(f"{given}: {exc.strerror or exc}") from exc
        except ValueError as exc:
            raise CompareError(f"{file}: not JSON ({exc})") from exc
        runs = summary.get("policies") if isinstance(summary, dict) else None
        if not isinstance(runs, dict) or not runs:
            raise CompareError(f"{file}: no 'policies' block: not a kvc bench summary")
        mode = str(summary.get("mode") or "simulated")
        for name, block in runs.items():
            if not isinstance(block, dict):
                raise CompareError(f"{file}: run {name!r} is not an object")
            rows.append(
                CompareRow(
                    label=f"{source}:{name}",
                    mode=mode,
                    hit_ratio=_number(block.get("hit_ratio")),
                    ttft_p50_s=_number(block.get("ttft_p50_s")),
                    ttft_p90_s=_number(block.get("ttft_p90_s")),
                    ttft_p99_s=_number(block.get("ttft_p99_s")),
                    tbt_p90_s=_number(block.get("tbt_p90_s")),
                    slo_attainment=_number(block.get("effective_capacity_ratio")),
                    completed=_count(block.get("completed")),
                    rejected=_count(block.get("rejected")),
                    requests=_count(block.get("requests")),
                )
            )
    return rows


def _cell(value: float | int | None, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "%":
        return f"{value:.1%}"
    if kind == "s":
        return f"{value:.3f}"
    return str(value)


def markdown_table(rows: Sequence[CompareRow]) -> str:
    """A GitHub-flavoured markdown table of ``rows`` (latencies in trace seconds)."""
    header = (
        "| run | mode | hit ratio | TTFT p50 (s) | TTFT p90 (s) | TTFT p99 (s) | TBT p90 (s) "
        "| SLO attainment | completed | rejected |"
    )
    lines = [header, "|" + "---|" * 10]
    for r in rows:
        cells = [
            r.label,
            r.mode,
            _cell(r.hit_ratio, "%"),
            _cell(r.ttft_p50_s, "s"),
            _cell(r.ttft_p90_s, "s"),
            _cell(r.ttft_p99_s, "s"),
            _cell(r.tbt_p90_s, "s"),
            _cell(r.slo_attainment, "%"),
            _cell(r.completed, ""),
            _cell(r.rejected, ""),
        ]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def write_compare_plot(rows: Sequence[CompareRow], path: Path) -> Path | None:
    """Three panels (hit ratio, TTFT percentiles, SLO attainment) with one bar group per
    row; returns the file, or None when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib ships with the dev extra
        return None
    labels = [r.label for r in rows]
    xs = list(range(len(rows)))
    fig, (hit, ttft, slo) = plt.subplots(1, 3, figsize=(max(10.0, 2.2 * len(rows) + 6), 4.8))
    bars = hit.bar(xs, [(r.hit_ratio or 0.0) * 100 for r in rows], color="tab:blue")
    hit.bar_label(bars, fmt="%.1f%%", fontsize="small")
    hit.set_ylabel("cached prompt tokens (%)")
    hit.set_title("prefix cache hit ratio")
    width = 0.27
    for i, (name, attr) in enumerate(
        (("p50", "ttft_p50_s"), ("p90", "ttft_p90_s"), ("p99", "ttft_p99_s"))
    ):
        values = [getattr(r, attr) or 0.0 for r in rows]
        ttft.bar([x + (i - 1) * width for x in xs], values, width, label=name)
    ttft.set_ylabel("TTFT (trace s)")
    ttft.set_title("TTFT")
    ttft.legend(fontsize="small")
    bars = slo.bar(xs, [(r.slo_attainment or 0.0) * 100 for r in rows], color="tab:green")
    slo.bar_label(bars, fmt="%.1f%%", fontsize="small")
    slo.set_ylabel("served within both SLOs (%)")
    slo.set_title("SLO attainment")
    for ax in (hit, ttft, slo):
        ax.set_xticks(xs, labels, rotation=25, ha="right", fontsize="small")
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
