"""Writing benchmark results: a Markdown table, a JSON file and the machine it ran on."""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from kvc.machine import machine


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sample."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def summarize_ms(samples_s: Sequence[float]) -> dict[str, float]:
    ms = [s * 1000 for s in samples_s]
    return {
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "mean_ms": statistics.fmean(ms),
    }


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:,.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_run_report(
    out: Path,
    name: str,
    title: str,
    command: str,
    text: str,
    commands: Sequence[tuple[str, str]],
    options: Any,
    results: Sequence[Any],
) -> Path:
    """A benchmark run's ``name``.md (the command, ``text``, every process started) and
    ``name``.json (command, options, results; both dataclasses)."""
    listed = "\n".join(f"- {what}: `{cmd}`" for what, cmd in commands)
    body = f"Command: `{command}`\n\n{text}\n\nProcesses:\n{listed}\n"
    data = {
        "command": command,
        "options": {k: str(v) for k, v in dataclasses.asdict(options).items()},
        "results": [dataclasses.asdict(r) for r in results],
    }
    return write_results(out, name, title, body, data)


def write_results(out: Path, name: str, title: str, table: str, data: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    md = out / f"{name}.md"
    md.write_text(f"# {title}\n\nMachine: {machine()}\n\n{table}\n")
    (out / f"{name}.json").write_text(json.dumps({"machine": machine(), **data}, indent=2))
    return md


class _HasStatus(Protocol):
    @property
    def status(self) -> str: ...


R = TypeVar("R", bound=_HasStatus)


def run_then_report(run: Callable[[list[R]], None], report: Callable[[list[R]], Path]) -> int:
    """``run`` appends a result per part as each finishes; on Ctrl-C what finished is still
    reported. Prints the report; exit code 130 when interrupted, 0 when every result's
    status is ``"ok"``, else 1."""
    results: list[R] = []
    interrupted = False
    try:
        run(results)
    except KeyboardInterrupt:  # each part stops its own processes
        interrupted = True
    print(report(results).read_text())
    if interrupted:
        return 130
    return 0 if all(r.status == "ok" for r in results) else 1


def bar_panels(
    path: Path,
    title: str,
    labels: Sequence[str],
    panels: Sequence[tuple[str, Sequence[float]]],
    *,
    panel_width: float = 4.0,
    label_size: int = 8,
) -> None:
    """One PNG: a bar chart per ``(panel title, value per label)``, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(panel_width * len(panels), 3.6))
    for ax, (panel, values) in zip(axes, panels, strict=True):
        ax.bar(list(labels), list(values), color="#4C72B0")
        ax.set_title(panel, fontsize=10)
        ax.tick_params(axis="x", labelsize=label_size)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
