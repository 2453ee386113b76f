"""The field benchmark's results (``bench.field_routers``): one ``TargetResult`` per target,
the peer table, ``table.md`` with the commands and the machine, ``results.json`` and the PNG.

Knobs: none. Complexity: O(targets).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.field_targets import FieldOptions
from bench.report import markdown_table
from kvc.machine import machine
from node_agent.engines.vllm.http_parsing import metric_values


@dataclass(slots=True)
class TargetResult:
    target: str
    status: str = "ok"  # ok | skipped: WHY | failed: WHY
    summary: dict[str, Any] = field(default_factory=dict)  # the run's block of summary.json
    engine_hit_ratio: float | None = None
    cpu_s: dict[str, float] = field(default_factory=dict)  # router|conductor|agents|engines|client
    replay_wall_s: float | None = None
    commands: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


TABLE_HEADERS = (
    "target", "hit ratio", "engine hit ratio", "TTFT p50 (s)", "TTFT p90 (s)",
    "TBT p90 (s)", "SLO attainment", "completed", "rejected", "router CPU (s)", "agents CPU (s)",
    "engines CPU (s)", "client CPU (s)", "replay wall (s)",
)  # fmt: skip


def _pct(value: Any) -> str:
    return f"{value:.1%}" if isinstance(value, int | float) else "-"


def _num(value: Any, digits: int = 2) -> str:
    return f"{value:,.{digits}f}" if isinstance(value, int | float) else "-"


def table_rows(results: Sequence[TargetResult]) -> list[list[str]]:
    """One row per target; a skipped or failed target shows its reason and dashes."""
    rows: list[list[str]] = []
    for r in results:
        if r.status != "ok":
            rows.append([f"{r.target} ({r.status})", *["-"] * (len(TABLE_HEADERS) - 1)])
            continue
        s, cpu = r.summary, r.cpu_s
        router = cpu.get("conductor", cpu.get("router"))
        rows.append(
            [
                r.target,
                _pct(s.get("hit_ratio")),
                _pct(r.engine_hit_ratio),
                _num(s.get("ttft_p50_s"), 3),
                _num(s.get("ttft_p90_s"), 3),
                _num(s.get("tbt_p90_s"), 3),
                _pct(s.get("effective_capacity_ratio")),
                str(s.get("completed", "-")),
                str(s.get("rejected", "-")),
                _num(router),
                _num(cpu.get("agents")) if "agents" in cpu else "-",
                _num(cpu.get("engines")),
                _num(cpu.get("client")),
                _num(r.replay_wall_s, 1),
            ]
        )
    return rows


def kv_input_counts(router_metrics: str) -> dict[str, float]:
    """vllm-router's ``kv_routing_inputs_total`` by ``result``: how kv_aware got token ids
    (``tokenize``/``token_ids``) or why it could not (``render_unavailable``, ...)."""
    counts: dict[str, float] = {}
    samples = metric_values(router_metrics).get("vllm_router_kv_routing_inputs_total", [])
    for labels, value in samples:
        key = labels.get("result") or "?"
        counts[key] = counts.get(key, 0.0) + value
    return counts


def status_note(live: dict[str, Any]) -> str | None:
    """What the client got besides 200, from ``kvc bench live``'s ``live`` block: a target
    whose requests all failed upstream must not read as merely "rejected"."""
    counts = {k: v for k, v in (live.get("status_counts") or {}).items() if k != "200"}
    if not counts:
        return None
    answers = ", ".join(f"{k} ×{v}" for k, v in sorted(counts.items()))
    return f"responses other than 200: {answers} (per-request CSV: error_code, client_error)"


def hit_ratio_delta(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Engines' prefix-cache hit ratio over an interval from their summed counters."""
    queries = after["queries"] - before["queries"]
    if queries <= 0:
        return None
    return (after["hits"] - before["hits"]) / queries


def write_report(opts: FieldOptions, results: Sequence[TargetResult], command: str) -> Path:
    opts.out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(TABLE_HEADERS, table_rows(results))
    fleet = (
        f"{len(opts.engine_urls)} external engines"
        if opts.engine_urls
        else f"{opts.engines} simulated vLLM engines (aggregated, profile {opts.profile}, "
        f"{opts.block_size}-token blocks, {opts.num_gpu_blocks} blocks each)"
    )
    requests = "every request" if opts.limit is None else f"first {opts.limit} requests"
    lines = [
        "# The field on the same fleet",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {machine()}",
        "",
        f"Fleet: {fleet}; trace {opts.trace} ({requests}), time scale "
        f"{opts.time_scale:g}, speed {opts.speed:g}; SLOs TTFT {opts.ttft_slo_s:g} s, "
        f"TBT {opts.tbt_slo_s:g} s (trace time). Each target on a cold fleet; times in trace "
        "seconds; CPU seconds over the replay only.",
        "",
        table,
        "",
    ]
    notes = [(r.target, n) for r in results for n in r.notes]
    if notes:
        lines += ["Notes:", "", *(f"- {t}: {n}" for t, n in notes), ""]
    lines += ["Commands (engine 0 / agent 0 stand for all of them):", ""]
    for r in results:
        for what, cmd in r.commands.items():
            lines.append(f"- {r.target}, {what}: `{cmd}`")
    md = opts.out / "table.md"
    md.write_text("\n".join(lines) + "\n")
    (opts.out / "results.json").write_text(
        json.dumps(
            {"command": command, "machine": machine(), "results": [asdict(r) for r in results]},
            indent=2,
        )
        + "\n"
    )
    _plot(opts.out / "field_routers.png", results)
    return md


def _plot(path: Path, results: Sequence[TargetResult]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.status == "ok"]
    if not ok:
        return
    names = [r.target.replace(":", "\n") for r in ok]
    xs = range(len(ok))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    hit = [r.summary.get("hit_ratio") or 0.0 for r in ok]
    axes[0].bar(xs, hit)
    axes[0].set_title("prefix cache hit ratio")
    p50 = [r.summary.get("ttft_p50_s") or 0.0 for r in ok]
    p90 = [r.summary.get("ttft_p90_s") or 0.0 for r in ok]
    axes[1].bar([x - 0.2 for x in xs], p50, width=0.4, label="p50")
    axes[1].bar([x + 0.2 for x in xs], p90, width=0.4, label="p90")
    axes[1].set_title("TTFT (trace s)")
    axes[1].legend()
    router = [r.cpu_s.get("conductor", r.cpu_s.get("router", 0.0)) for r in ok]
    agents = [r.cpu_s.get("agents", 0.0) for r in ok]
    axes[2].bar(xs, router, label="router / conductor")
    axes[2].bar(xs, agents, bottom=router, label="agents")
    axes[2].set_title("router CPU seconds over the replay")
    axes[2].legend()
    for ax in axes:
        ax.set_xticks(list(xs), names, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
