"""Scenario runner behind ``kvc bench replay``: every run of a scenario on one trace, then
``summary.json``, a CSV of requests per run and the plots.

Flow
    For each selected run (``--policy``: one run by name or policy; default: all) and
    each speed (the scenario's ``speed``, its ``speeds`` sweep, or ``--speed``), build a
    fresh cluster (``simulate``) and summarise it (``metrics.summarize``). Every run
    replays the same requests, so their ratios hold whatever the machine's noise.

``summary.json``::

    {"scenario": NAME, "trace": PATH, "speed": X, "profile": ..., "machine": ...,
     "trace_stats": {...}, "paper": "what the paper reports",
     "policies": {RUN: {hit_ratio, ttft_mean_s, ttft_p50_s, ttft_p90_s, ttft_p99_s,
                        tbt_p90_s, rejected, wasted_prefill_s, prefill_gpu_s,
                        effective_capacity_ratio, ..., "sweep": [...],
                        "retention": {requests, granted, over_budget, node_full,
                                      retained_ratio_mean, retained_ratio_max}}},
     "versus_baseline": {RUN: {hit_ratio_x, prefill_gpu_change, ttft_mean_change, ...}}}

Non-finite numbers (a metric over no requests) are written as ``null``. ``retention``
appears only for runs whose cluster honours prompt-cache breakpoints (``retention``).

Knobs: ``ReplayOptions``. Complexity: runs x speeds simulations.
"""

from __future__ import annotations

import csv
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from kvc.machine import machine
from kvc_sim.cluster import simulate
from kvc_sim.metrics import SimResult, summarize
from kvc_sim.plots import PlotRun, SweepPoint, write_plots
from kvc_sim.scenario import RunSpec, Scenario
from kvc_sim.trace import TraceRequest, trace_stats

__all__ = ["ProgressLine", "ReplayOptions", "finite_or_null", "machine", "run_scenario"]


class ProgressLine:
    """A one-line progress bar on a stream (stderr), redrawn at most every ``every_s``."""

    def __init__(self, stream: TextIO | None = None, every_s: float = 0.2) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._every_s = every_s
        self._last = 0.0

    def callback(self, label: str) -> Callable[[int, int, float], None]:
        def show(done: int, total: int, virtual_s: float) -> None:
            now = time.perf_counter()
            if done < total and now - self._last < self._every_s:
                return
            self._last = now
            width = 30
            filled = width * done // max(1, total)
            bar = "#" * filled + "-" * (width - filled)
            self._stream.write(
                f"\r{label:<32} [{bar}] {done}/{total} requests, t={virtual_s:,.0f} s"
            )
            if done >= total:
                self._stream.write("\n")
            self._stream.flush()

        return show


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    trace_name: str
    policy: str | None = None
    speed: float | None = None
    plots: bool = True
    progress: ProgressLine | None = None


def finite_or_null(value: Any) -> Any:
    """``value`` with every non-finite float (a metric over no requests) made ``None``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_null(v) for v in value]
    return value


def _change(new: Any, old: Any) -> float | None:
    if not isinstance(new, int | float) or not isinstance(old, int | float) or not old:
        return None
    return float(new) / float(old) - 1.0


def _write_requests_csv(path: Path, result: SimResult) -> None:
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        fields = list(result.records[0].__dataclass_fields__) if result.records else []
        writer.writerow(fields)
        for record in result.records:
            writer.writerow([getattr(record, name) for name in fields])


def run_scenario(
    scenario: Scenario, requests: Sequence[TraceRequest], out_dir: Path, options: ReplayOptions
) -> dict[str, Any]:
    """Run the scenario's runs on ``requests``; write and return ``summary.json``."""
    if not requests:
        raise ValueError("no requests to replay")
    out_dir.mkdir(parents=True, exist_ok=True)
    profile = scenario.load_profile()
    slo = scenario.slo
    base_speed = options.speed if options.speed is not None else scenario.speed
    speeds = [base_speed]  # the per-run block is at the base speed; the sweep adds the rest
    if options.speed is None and scenario.speeds:
        speeds += sorted(set(scenario.speeds) - {base_speed})
    stats = trace_stats(requests)
    rate_at_1 = (stats.requests - 1) / stats.duration_s if stats.duration_s > 0 else math.nan
    policies: dict[str, dict[str, Any]] = {}
    plot_runs: list[PlotRun] = []
    started = time.perf_counter()
    for run in scenario.select(options.policy):
        block, plot_run = _run_one(scenario, run, requests, out_dir, options, speeds, rate_at_1)
        policies[run.name] = block
        plot_runs.append(plot_run)
    base = policies.get(scenario.baseline)
    versus: dict[str, dict[str, float | None]] = {}
    if base is not None:
        for name, block in policies.items():
            versus[name] = {
                "hit_ratio_x": (
                    block["hit_ratio"] / base["hit_ratio"]
                    if base["hit_ratio"] and math.isfinite(base["hit_ratio"])
                    else None
                ),
                "prefill_gpu_change": _change(block["prefill_gpu_s"], base["prefill_gpu_s"]),
                "ttft_mean_change": _change(block["ttft_mean_s"], base["ttft_mean_s"]),
                "ttft_p90_change": _change(block["ttft_p90_s"], base["ttft_p90_s"]),
                "rejected_change": _change(block["rejected"], base["rejected"]),
                "effective_capacity_change": _change(
                    block["effective_capacity_ratio"], base["effective_capacity_ratio"]
                ),
            }
    summary: dict[str, Any] = {
        "scenario": scenario.name,
        "trace": options.trace_name,
        "description": scenario.description,
        "paper": scenario.paper,
        "profile": profile.name,
        "speed": base_speed,
        "speeds": sorted(speeds),
        "request_rate_per_s": rate_at_1 * base_speed,
        "baseline": scenario.baseline,
        "cluster": asdict(scenario.cluster),
        "slo": asdict(slo),
        "trace_stats": asdict(stats),
        "machine": machine(),
        "wall_s": time.perf_counter() - started,
        "policies": policies,
        "versus_baseline": versus,
    }
    summary = finite_or_null(summary)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if options.plots:
        write_plots(out_dir, scenario.name, plot_runs)
    return summary


def _run_one(
    scenario: Scenario,
    run: RunSpec,
    requests: Sequence[TraceRequest],
    out_dir: Path,
    options: ReplayOptions,
    speeds: Sequence[float],
    rate_at_1: float,
) -> tuple[dict[str, Any], PlotRun]:
    profile = scenario.load_profile()
    slo = scenario.slo
    sched = scenario.scheduler_for(run, profile)
    cluster = scenario.cluster_for(run)
    block: dict[str, Any] = {}
    sweep: list[dict[str, Any]] = []
    points: list[SweepPoint] = []
    first: SimResult | None = None
    for speed in speeds:
        label = f"{run.name} @{speed:g}x"
        progress = options.progress.callback(label) if options.progress else None
        result = simulate(profile, cluster, sched, slo.slo(), requests, speed, progress)
        summary = summarize(result, slo.ttft_s, slo.tbt_s, slo.tbt_thresholds_s)
        if first is None:
            first = result
            block = {
                "policy": run.policy,
                "admission": sched.admission.value,
                "kvcache_balancing_threshold": sched.kvcache_balancing_threshold,
                **asdict(summary),
            }
            if result.retention is not None:
                block["retention"] = asdict(result.retention)
            _write_requests_csv(out_dir / f"requests_{run.name}.csv", result)
        if len(speeds) > 1:
            sweep.append(
                {
                    "speed": speed,
                    "request_rate_per_s": rate_at_1 * speed,
                    "effective_capacity_ratio": summary.effective_capacity_ratio,
                    "effective_capacity_by_tbt": summary.effective_capacity_by_tbt,
                    "ttft_mean_s": summary.ttft_mean_s,
                    "ttft_p90_s": summary.ttft_p90_s,
                    "tbt_p90_s": summary.tbt_p90_s,
                    "hit_ratio": summary.hit_ratio,
                    "prefill_gpu_s": summary.prefill_gpu_s,
                    "prefill_gpu_s_per_request": summary.prefill_gpu_s_per_request,
                    "rejected": summary.rejected,
                    "wasted_prefill_s": summary.wasted_prefill_s,
                }
            )
    if sweep:
        sweep.sort(key=lambda row: float(row["speed"]))
        block["sweep"] = sweep
        points = [
            SweepPoint(float(row["request_rate_per_s"]), dict(row["effective_capacity_by_tbt"]))
            for row in sweep
        ]
    assert first is not None
    plot = PlotRun(
        name=run.name,
        ttfts_s=[r.ttft_s for r in first.records if r.ttft_s is not None],
        hit_ratio=float(block["hit_ratio"]) if math.isfinite(block["hit_ratio"]) else 0.0,
        load_t_s=[s.t_s for s in first.samples],
        prefill_load=[s.prefill_load for s in first.samples],
        decode_load=[s.decode_load for s in first.samples],
        sweep=points,
    )
    return block, plot
