"""Where a request's CPU goes, live: thread time of named stages in the conductor's and
the agents' main threads under ``bench.hot_path``'s load.

  python -m bench.request_profile [--requests 3000] [--concurrency 64]
      [--out bench/results/request_profile]

The fleet is ``bench.hot_path``'s (the conductor, kv_centric, in front of two simulated
vLLM engines through their agents, engine times scaled to nothing). Every service starts
with ``bench/profile_site`` on its ``PYTHONPATH``: the stages of
``bench.profile_stages`` are wrapped and accounted in thread time between two signals
sent around ``--requests`` streamed chat completions at ``--concurrency`` (after
``--warmup`` at concurrency 8). Reported per request served: each stage's microseconds
(inclusive: stages nest), the main threads' total, and the processes' CPU (all threads,
user + system, ``/proc``). Then ``OUT/request_profile.md``, ``.json`` and ``.png``.

What it is for: deciding what to cut. Small NumPy calls, dict-heavy code and syscalls
cost several times more here, between other processes on two cores, than in a warm
loop (the shadow index's apply of one key: ~12 µs in a loop, ~100 µs per event live
before it stopped calling NumPy), so microbenchmarks alone mislead.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.field_fleet import cpu_seconds
from bench.field_routers import serving
from bench.field_targets import REPO, TARGETS
from bench.hot_path import HotPathOptions, _field_options, run_load
from bench.profile_stages import AGENT_STAGES, CONDUCTOR_STAGES
from bench.report import markdown_table, write_results

__all__ = ["ProfileResult", "main", "per_request", "stage_rows"]

PROFILE_SITE = Path(__file__).resolve().parent / "profile_site"
_TARGET = "conductor:kv_centric"


@dataclass(slots=True)
class ProfileResult:
    requests: int
    seconds: float  # wall time of the measured load
    errors: dict[str, int]
    cpu_ms: dict[str, float]  # per request: "conductor", "agents", "engines" (all threads)
    reports: list[dict[str, Any]] = field(default_factory=list)  # one per process


def per_request(reports: Sequence[dict[str, Any]], role: str, requests: int) -> dict[str, float]:
    """Microseconds per request of each stage and of the main threads (``"main thread"``),
    summed over the processes of ``role``."""
    out: dict[str, float] = {"main thread": 0.0}
    for report in reports:
        if report.get("role") != role:
            continue
        out["main thread"] += report["main_thread_s"]
        for label, stage in report["stages"].items():
            out[label] = out.get(label, 0.0) + stage["seconds"]
    return {label: seconds / requests * 1e6 for label, seconds in out.items()}


def stage_rows(
    reports: Sequence[dict[str, Any]], requests: int
) -> list[tuple[str, str, float, float]]:
    """``(process, stage, µs per request, calls per request)`` in the stages' order."""
    rows: list[tuple[str, str, float, float]] = []
    for role, stages in (("conductor", CONDUCTOR_STAGES), ("agent", AGENT_STAGES)):
        micros = per_request(reports, role, requests)
        calls: dict[str, int] = {}
        for report in reports:
            if report.get("role") == role:
                for label, stage in report["stages"].items():
                    calls[label] = calls.get(label, 0) + stage["calls"]
        rows.append((role, "main thread (all of it)", micros["main thread"], 0.0))
        for stage in stages:
            if stage.label in micros:
                rows.append((role, stage.label, micros[stage.label], calls[stage.label] / requests))
    return rows


@contextmanager
def _profiled_env(out: Path) -> Iterator[None]:
    """The services started inside load ``bench/profile_site`` and write into ``out``."""
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "KVC_PROFILE_OUT")}
    paths = [str(PROFILE_SITE), str(REPO)]
    if saved["PYTHONPATH"]:
        paths.append(saved["PYTHONPATH"])
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    os.environ["KVC_PROFILE_OUT"] = str(out)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _signal_all(pids: Sequence[int], signum: int) -> None:
    for pid in pids:
        os.kill(pid, signum)


def _wait_for(files: Sequence[Path], timeout_s: float) -> None:
    """Until every one of ``files`` exists (the services write them whole, by rename);
    RuntimeError naming those missing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not all(f.exists() for f in files):
        if time.monotonic() > deadline:
            missing = [f.name for f in files if not f.exists()]
            raise RuntimeError(f"no answer in {missing} (is bench/profile_site loaded?)")
        time.sleep(0.02)  # polls: a file written by another process has no event to await


def _read_reports(folder: Path, pids: Sequence[int], timeout_s: float) -> list[dict[str, Any]]:
    files = [folder / f"{pid}.json" for pid in pids]
    _wait_for(files, timeout_s)
    return [json.loads(f.read_text()) for f in files]


def run(opts: HotPathOptions, requests: int, warmup: int) -> ProfileResult:
    raw = opts.out / "stage_reports"
    raw.mkdir(parents=True, exist_ok=True)
    for old in [*raw.glob("*.json"), *raw.glob("*.started")]:
        old.unlink()
    commands: dict[str, str] = {}
    with (
        _profiled_env(raw),
        serving(TARGETS[_TARGET], _field_options(opts, opts.out), None, opts.out, commands) as s,
    ):
        run_load(s.base_url, s.info.model, 0, warmup, 8, opts)
        pids = [*s.groups["conductor"], *s.groups["agents"]]
        _signal_all(pids, signal.SIGUSR1)
        _wait_for([raw / f"{pid}.started" for pid in pids], timeout_s=10.0)  # accounting on
        before = {g: sum(cpu_seconds(p) for p in ps) for g, ps in s.groups.items()}
        started = time.perf_counter()
        load = run_load(s.base_url, s.info.model, warmup, requests, opts.concurrency, opts)
        seconds = time.perf_counter() - started
        after = {g: sum(cpu_seconds(p) for p in ps) for g, ps in s.groups.items()}
        _signal_all(pids, signal.SIGUSR2)
        reports = _read_reports(raw, pids, timeout_s=10.0)
    served = max(1, load.served)
    cpu = {g: (after[g] - before[g]) / served * 1e3 for g in before}
    return ProfileResult(served, seconds, dict(load.errors), cpu, reports)


def write_report(opts: HotPathOptions, result: ProfileResult, command: str) -> Path:
    rows = stage_rows(result.reports, result.requests)
    table = markdown_table(
        ["process", "stage", "µs per request", "calls per request"],
        [(p, s, f"{us:.0f}", f"{c:.2f}" if c else "–") for p, s, us, c in rows],
    )
    cpu = ", ".join(f"{g} {ms:.3f}" for g, ms in result.cpu_ms.items())
    missing = sorted({m for r in result.reports for m in r.get("missing", [])})
    text = (
        f"Command: `{command}`\n\n{table}\n\n"
        f"CPU per request, all threads (/proc, user + system), ms: {cpu}. "
        f"{result.requests} streamed chat completions at concurrency {opts.concurrency} in "
        f"{result.seconds:.1f} s ({result.requests / result.seconds:.1f} req/s); errors: "
        f"{result.errors or 'none'}. Stages nest: a coroutine's or generator's time is the "
        "sum of its steps (what it awaits included, waits excluded); the agents' rows are "
        "summed over both agents and divided by every request."
        + (f"\n\nStages not found (renamed?): {', '.join(missing)}" if missing else "")
    )
    data = {
        "command": command,
        "requests": result.requests,
        "seconds": result.seconds,
        "errors": result.errors,
        "cpu_ms_per_request": result.cpu_ms,
        "rows": [{"process": p, "stage": s, "us": us, "calls": c} for p, s, us, c in rows],
        "reports": result.reports,
    }
    md = write_results(opts.out, "request_profile", "Where a request's CPU goes", text, data)
    _plot(opts.out / "request_profile.png", rows)
    return md


def _plot(path: Path, rows: Sequence[tuple[str, str, float, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roles = ("conductor", "agent")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, role in zip(axes, roles, strict=True):
        mine = [(s, us) for p, s, us, _ in rows if p == role]
        ax.barh([s for s, _ in mine][::-1], [us for _, us in mine][::-1], color="#4C72B0")
        ax.set_title(f"{role}: µs of main-thread CPU per request", fontsize=10)
        ax.tick_params(axis="y", labelsize=7)
    fig.suptitle("Where a request's CPU goes (bench.request_profile)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    d = HotPathOptions()
    p = argparse.ArgumentParser(
        prog="python -m bench.request_profile",
        description="thread time of the conductor's and agents' stages under load",
    )
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--prompt-words", type=int, default=d.prompt_words)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "request_profile")
    ns = p.parse_args(args)
    if min(ns.requests, ns.concurrency, ns.prompt_words, ns.max_tokens) < 1 or ns.warmup < 0:
        p.error("--requests, --concurrency, --prompt-words and --max-tokens must be >= 1")
    opts = HotPathOptions(
        targets=(_TARGET,), concurrency=ns.concurrency, prompt_words=ns.prompt_words,
        max_tokens=ns.max_tokens, out=ns.out,
    )  # fmt: skip
    command = "python -m bench.request_profile " + shlex.join(args)
    result = run(opts, ns.requests, ns.warmup)
    print(write_report(opts, result, command.strip()).read_text())
    return 0 if not result.errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
