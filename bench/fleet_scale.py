"""The conductor in front of a large simulated fleet: throughput, CPU per request, KV-event
lag and memory, measured live.

  python -m bench.fleet_scale [--shapes 8+8,32+32] [--limit 1000] [--speed 1]
      [--max-tokens 32] [--time-scale 1] [--policy kv_centric]
      [--trace /work/shared/traces/synthetic_trace.jsonl] [--out bench/results/fleet_scale]

For each fleet shape ``P+D`` in order (``P`` prefill and ``D`` decode engines):

1. the fleet ``kvc fleet up`` would start (kvc_cli.fleet.plan_fleet: simulated vLLM engines,
   one vLLM-adapter agent each with its KV events over ``ipc://``, one conductor), started
   cold and waited for until the conductor sees every agent usable (the start-up time is
   reported);
2. the fleet idle for ``--idle-s``: CPU of the engines, the agents and the conductor with no
   traffic (what a fleet of this size costs the machine before any request);
3. the first ``--limit`` requests of the trace replayed through the conductor by
   ``kvc bench live`` at ``--speed`` (open loop), with the conductor's and the fleet's CPU
   sampled before and after the replay (``/proc``), and the conductor's ``/metrics``
   scraped before and after;
4. from those: requests the conductor answered per second (completed and 429s over the
   replay's wall time), conductor CPU per request (user + system over the replay / requests
   answered), the KV-event lag p50/p99 (``conductor_shadow_event_lag_seconds``: engine event
   → shadow index, over the replay only, interpolated inside its bucket as Prometheus'
   ``histogram_quantile`` does), the scheduling decision p99, and memory: the conductor's
   resident set now and at its peak (``VmRSS``, ``VmHWM``) and the whole fleet's
   proportional set size (``Pss`` summed over every process, so shared pages count once).

Then ``OUT/fleet_scale.md`` (table, command, machine), ``OUT/fleet_scale.json`` and
``OUT/fleet_scale.png``; each shape's folder keeps ``kvc bench live``'s ``summary.json``,
the metric texts and every process's log.

Everything shares the machine's cores: on a small machine the engines' and agents' Python
and the client compete with the conductor, so the requests/s column is what this machine
sustains with the whole fleet on it, and CPU per request is the conductor's own share (what
a conductor on its own cores would need per request).

Linux only (``/proc``). Knobs: the flags (``--help``). Complexity: shapes × (fleet start +
idle + replay).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.field_fleet import cpu_seconds, run_client
from bench.report import bar_panels, markdown_table, run_then_report, write_run_report
from conductor.core.policies import Policy
from kvc.processes import port_free
from kvc_cli.fleet import FleetOptions, FleetPlan, all_agents_usable, plan_fleet
from kvc_cli.supervisor import Supervisor
from node_agent.engines.vllm.http_parsing import metric_values

__all__ = [
    "ShapeResult",
    "histogram_delta",
    "histogram_quantile",
    "main",
    "parse_shapes",
    "proc_memory_kib",
    "requests_answered",
    "started_fleet",
]

_DEFAULT_TRACE = Path(__file__).resolve().parents[1].parent / "shared/traces/synthetic_trace.jsonl"
_LAG = "conductor_shadow_event_lag_seconds"
_DECISION = "conductor_scheduling_decision_seconds"


# ---------------------------------------------------------------- pure helpers


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"8+8,32+32"`` → ``[(8, 8), (32, 32)]`` (prefill + decode engines)."""
    shapes: list[tuple[int, int]] = []
    for part in text.split(","):
        p, sep, d = part.strip().partition("+")
        if not sep or not p.isdigit() or not d.isdigit() or int(p) < 1 or int(d) < 1:
            raise ValueError(f"--shapes: {part.strip()!r} is not PREFILL+DECODE (e.g. 32+32)")
        shapes.append((int(p), int(d)))
    if not shapes:
        raise ValueError("--shapes: give at least one PREFILL+DECODE")
    return shapes


def histogram_delta(before: str, after: str, name: str) -> list[tuple[float, float]]:
    """Cumulative ``(le, count)`` of histogram ``name`` observed between two scrapes of the
    same process (label sets other than ``le`` summed), sorted by ``le``."""

    def buckets(text: str) -> dict[float, float]:
        out: dict[float, float] = {}
        for labels, value in metric_values(text).get(f"{name}_bucket", []):
            le = float(labels["le"])
            out[le] = out.get(le, 0.0) + value
        return out

    b, a = buckets(before), buckets(after)
    return sorted((le, a[le] - b.get(le, 0.0)) for le in a)


def histogram_quantile(q: float, cumulative: Sequence[tuple[float, float]]) -> float | None:
    """Quantile ``q`` (0..1) of a cumulative histogram, interpolated linearly inside the
    bucket that holds it (Prometheus' ``histogram_quantile``); the highest finite bound when
    it falls in the ``+Inf`` bucket; None without observations."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    total = cumulative[-1][1]
    rank = q * total
    lower_le, lower_count = 0.0, 0.0
    for le, count in cumulative:
        if count >= rank:
            if math.isinf(le):
                return lower_le
            if count == lower_count:
                return le
            return lower_le + (le - lower_le) * (rank - lower_count) / (count - lower_count)
        lower_le, lower_count = le, count
    return lower_le


def proc_memory_kib(pid: int) -> dict[str, int]:
    """``VmRSS``/``VmHWM`` (``/proc/PID/status``) and ``Pss`` (``smaps_rollup``), in KiB;
    the keys a process no longer has are missing."""
    out: dict[str, int] = {}
    for path, keys in (
        (f"/proc/{pid}/status", ("VmRSS", "VmHWM")),
        (f"/proc/{pid}/smaps_rollup", ("Pss",)),
    ):
        with contextlib.suppress(OSError):
            for line in Path(path).read_text().splitlines():
                key, _, rest = line.partition(":")
                if key in keys:
                    out[key] = int(rest.split()[0])
    return out


def requests_answered(before: str, after: str) -> float:
    def total(text: str) -> float:
        return sum(v for _, v in metric_values(text).get("conductor_requests_total", []))

    return total(after) - total(before)


# ---------------------------------------------------------------- running


@dataclass(slots=True)
class ShapeResult:
    prefill: int
    decode: int
    status: str = "ok"
    startup_s: float | None = None
    idle_cpu_cores: dict[str, float] = field(default_factory=dict)
    replay_wall_s: float | None = None
    requests_answered: float | None = None
    completed: int | None = None
    rejected: int | None = None
    answered_per_s: float | None = None
    offered_per_s: float | None = None
    cpu_s: dict[str, float] = field(default_factory=dict)
    conductor_cpu_ms_per_request: float | None = None
    event_lag_s: dict[str, float | None] = field(default_factory=dict)
    events_applied: float | None = None
    decision_p99_s: float | None = None
    conductor_memory_kib: dict[str, int] = field(default_factory=dict)
    fleet_pss_kib: int | None = None
    hit_ratio: float | None = None
    ttft_s: dict[str, float | None] = field(default_factory=dict)
    commands: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.prefill}+{self.decode}"


@dataclass(frozen=True, slots=True)
class ScaleOptions:
    shapes: tuple[tuple[int, int], ...]
    trace: Path
    limit: int
    speed: float
    max_tokens: int
    time_scale: float
    policy: str
    profile: str
    num_gpu_blocks: int
    max_running: int
    idle_s: float
    port: int
    base_port: int
    conductor_args: tuple[str, ...]
    out: Path
    startup_timeout_s: float
    replay_timeout_s: float


def _groups(sup: Supervisor) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {"engines": [], "agents": [], "conductor": []}
    for child in sup.children:
        kind = child.name.split("-", 1)[0]
        groups["engines" if kind == "engine" else "agents" if kind == "agent" else kind].append(
            child.proc.pid
        )
    return groups


def _cpu(groups: dict[str, list[int]]) -> dict[str, float]:
    return {k: sum(cpu_seconds(p) for p in pids) for k, pids in groups.items()}


def _live_argv(opts: ScaleOptions, url: str, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "kvc_cli", "bench", "live", "--url", url,
        "--trace", str(opts.trace), "--out", str(out), "--name", opts.policy,
        "--limit", str(opts.limit), "--speed", repr(opts.speed),
        "--max-tokens", str(opts.max_tokens), "--time-scale", repr(opts.time_scale),
        "--no-plots", "--quiet",
    ]  # fmt: skip


def _offered_rate(trace: Path, limit: int, speed: float) -> float | None:
    stamps: list[float] = []
    with trace.open() as f:
        for line in f:
            if line.strip():
                stamps.append(float(json.loads(line)["timestamp"]) / 1000.0)
            if len(stamps) >= limit:
                break
    span = (max(stamps) - min(stamps)) / speed if len(stamps) > 1 else 0.0
    return (len(stamps) - 1) / span if span > 0 else None


class FleetStartError(RuntimeError):
    """A planned fleet could not start (ports in use, a process exited, not ready)."""


@contextlib.contextmanager
def started_fleet(
    fleet: FleetOptions, log_dir: Path, startup_timeout_s: float, ipc_prefix: str
) -> Iterator[tuple[FleetPlan, Supervisor]]:
    """The processes ``plan_fleet`` gives for ``fleet``, started and waited for until the
    conductor sees every agent usable; all stopped (and the ``ipc://`` folder removed)
    on exit. Raises ``FleetStartError``."""
    ipc_dir = tempfile.mkdtemp(prefix=ipc_prefix)
    sup = Supervisor(15.0, log_dir)
    try:
        plan = plan_fleet(fleet, ipc_dir)
        busy = [p for p in plan.ports if not port_free(fleet.host, p)]
        if busy:
            raise FleetStartError(f"ports in use: {busy[:8]}")
        for spec in plan.processes:
            sup.spawn(spec.name, spec.args)
        url = plan.conductor_urls[0]
        failure = sup.wait_ready(
            [lambda: all_agents_usable(url, len(plan.agents))],
            threading.Event(),
            startup_timeout_s,
        )
        if failure is not None:
            raise FleetStartError(f"{failure} (logs in {log_dir})")
        yield plan, sup
    finally:
        sup.stop_all()
        shutil.rmtree(ipc_dir, ignore_errors=True)


def run_shape(opts: ScaleOptions, prefill: int, decode: int) -> ShapeResult:
    result = ShapeResult(prefill, decode)
    out = opts.out / f"{prefill}p{decode}d"
    out.mkdir(parents=True, exist_ok=True)
    fleet = FleetOptions(
        prefill=prefill, decode=decode, port=opts.port, base_port=opts.base_port,
        profile=opts.profile, time_scale=opts.time_scale, num_gpu_blocks=opts.num_gpu_blocks,
        policy=opts.policy, max_running=opts.max_running,
        conductor_args=opts.conductor_args, log_dir=str(out / "logs"),
    )  # fmt: skip
    started = time.perf_counter()
    try:
        with started_fleet(fleet, out / "logs", opts.startup_timeout_s, "kvc-scale-") as (
            plan,
            sup,
        ):
            _measure_shape(opts, result, out, plan, sup, time.perf_counter() - started)
    except FleetStartError as exc:
        result.status = f"failed: {exc}"
    return result


def _measure_shape(
    opts: ScaleOptions,
    result: ShapeResult,
    out: Path,
    plan: FleetPlan,
    sup: Supervisor,
    startup_s: float,
) -> None:
    result.commands["engine-0"] = shlex.join(["kvc", *plan.engines[0].args])
    result.commands["agent-0"] = shlex.join(["kvc", *plan.agents[0].args])
    result.commands["conductor"] = shlex.join(["kvc", *plan.conductors[0].args])
    url = plan.conductor_urls[0]
    try:
        result.startup_s = startup_s
        groups = _groups(sup)
        idle_before = _cpu(groups)
        time.sleep(opts.idle_s)  # the measurement window itself, not a wait for a state
        idle_after = _cpu(groups)
        result.idle_cpu_cores = {k: (idle_after[k] - idle_before[k]) / opts.idle_s for k in groups}
        live = _live_argv(opts, url, out)
        result.commands["replay"] = shlex.join(live)
        metrics_before = httpx.get(f"{url}/metrics", timeout=30.0).text
        cpu_before = _cpu(groups)
        code, wall_s, client_cpu = run_client(live, out / "replay.log", opts.replay_timeout_s)
        cpu_after = _cpu(groups)
        metrics_after = httpx.get(f"{url}/metrics", timeout=30.0).text
        (out / "conductor_metrics_before.txt").write_text(metrics_before)
        (out / "conductor_metrics_after.txt").write_text(metrics_after)
        result.replay_wall_s = wall_s
        result.cpu_s = {k: cpu_after[k] - cpu_before[k] for k in groups}
        result.cpu_s["client"] = client_cpu
        conductor_pid = groups["conductor"][0]
        result.conductor_memory_kib = proc_memory_kib(conductor_pid)
        result.fleet_pss_kib = sum(proc_memory_kib(c.proc.pid).get("Pss", 0) for c in sup.children)
        answered = requests_answered(metrics_before, metrics_after)
        result.requests_answered = answered
        if answered > 0:
            result.conductor_cpu_ms_per_request = 1000.0 * result.cpu_s["conductor"] / answered
            result.answered_per_s = answered / wall_s
        lag = histogram_delta(metrics_before, metrics_after, _LAG)
        result.events_applied = lag[-1][1] if lag else 0.0
        result.event_lag_s = {
            "p50": histogram_quantile(0.5, lag),
            "p99": histogram_quantile(0.99, lag),
        }
        decision = histogram_delta(metrics_before, metrics_after, _DECISION)
        result.decision_p99_s = histogram_quantile(0.99, decision)
        result.offered_per_s = _offered_rate(opts.trace, opts.limit, opts.speed)
        if (dead := sup.exited()) is not None:
            result.status = f"failed: {dead.name} exited (code {dead.proc.returncode})"
        elif code != 0:
            result.status = f"failed: kvc bench live exited {code} (see {out / 'replay.log'})"
        else:
            summary = json.loads((out / "summary.json").read_text())["policies"][opts.policy]
            live_figs = summary.get("live") or {}
            result.completed = summary.get("completed")
            result.rejected = live_figs.get("rejected_429")
            result.hit_ratio = summary.get("hit_ratio")
            result.ttft_s = {"p50": summary.get("ttft_p50_s"), "p90": summary.get("ttft_p90_s")}
    except (RuntimeError, ValueError, OSError, KeyError, httpx.HTTPError) as exc:
        result.status = f"failed: {exc}"


# ---------------------------------------------------------------- report


def _f(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def table_rows(results: Sequence[ShapeResult]) -> list[list[str]]:
    rows: list[list[str]] = []
    for r in results:
        idle = sum(r.idle_cpu_cores.values()) if r.idle_cpu_cores else None
        mem = r.conductor_memory_kib
        rows.append([
            f"{r.label} ({r.prefill + r.decode})",
            r.status,
            _f(r.startup_s, ".0f"),
            _f(idle, ".2f"),
            _f(r.offered_per_s, ".2f"),
            _f(r.answered_per_s, ".2f"),
            f"{r.completed if r.completed is not None else '–'} / "
            f"{r.rejected if r.rejected is not None else '–'}",
            _f(r.conductor_cpu_ms_per_request, ".1f"),
            _f(r.cpu_s.get("conductor"), ".1f"),
            _f(r.cpu_s.get("agents"), ".1f"),
            _f(r.cpu_s.get("engines"), ".1f"),
            _f(r.event_lag_s.get("p50"), ".3f"),
            _f(r.event_lag_s.get("p99"), ".3f"),
            _f(r.decision_p99_s and r.decision_p99_s * 1000, ".2f"),
            _f(mem.get("VmRSS", 0) / 1024 if mem else None, ".0f"),
            _f(mem.get("VmHWM", 0) / 1024 if mem else None, ".0f"),
            _f(r.fleet_pss_kib / 1024 / 1024 if r.fleet_pss_kib else None, ".2f"),
            _f(r.hit_ratio and 100 * r.hit_ratio, ".1f"),
            _f(r.ttft_s.get("p50"), ".2f"),
            _f(r.ttft_s.get("p90"), ".2f"),
        ])  # fmt: skip
    return rows


HEADERS = [
    "engines P+D",
    "status",
    "start-up s",
    "idle fleet CPU (cores)",
    "offered req/s",
    "answered req/s",
    "completed / 429",
    "conductor CPU ms/request",
    "conductor CPU s",
    "agents CPU s",
    "engines CPU s",
    "event lag p50 s",
    "event lag p99 s",
    "decision p99 ms",
    "conductor RSS MiB",
    "conductor peak RSS MiB",
    "fleet PSS GiB",
    "hit ratio %",
    "TTFT p50 s",
    "TTFT p90 s",
]


def _plot(path: Path, results: Sequence[ShapeResult]) -> None:
    done = [r for r in results if r.status == "ok"]
    if not done:
        return
    labels = [f"{r.prefill + r.decode} engines" for r in done]
    panels: list[tuple[str, list[float]]] = [
        ("conductor CPU per request (ms)", [r.conductor_cpu_ms_per_request or 0 for r in done]),
        ("requests answered per second", [r.answered_per_s or 0 for r in done]),
        ("KV-event lag p99 (s)", [r.event_lag_s.get("p99") or 0 for r in done]),
        ("conductor RSS (MiB)", [r.conductor_memory_kib.get("VmRSS", 0) / 1024 for r in done]),
    ]
    title = "kvc conductor in front of simulated vLLM fleets (bench.fleet_scale)"
    bar_panels(path, title, labels, panels)


def write_report(opts: ScaleOptions, results: Sequence[ShapeResult], command: str) -> Path:
    text = (
        f"{markdown_table(HEADERS, table_rows(results))}\n\n"
        f"Trace {opts.trace.name}, first {opts.limit} requests at speed {opts.speed:g}, "
        f"max_tokens {opts.max_tokens}, time scale {opts.time_scale:g}, policy {opts.policy}, "
        f"profile {opts.profile}. Requests answered = completed + refused (429), from "
        "conductor_requests_total over the replay; CPU is user + system over the replay "
        "(/proc); event lag is engine KV event → shadow index over the replay."
    )
    commands = [(f"{r.label} {name}", cmd) for r in results for name, cmd in r.commands.items()]
    title = "The conductor in front of a large fleet"
    md = write_run_report(opts.out, "fleet_scale", title, command, text, commands, opts, results)
    _plot(opts.out / "fleet_scale.png", results)
    return md


# ---------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.fleet_scale",
        description="the conductor in front of large simulated vLLM fleets, measured live",
    )
    p.add_argument("--shapes", default="8+8,32+32", help="fleets to run, PREFILL+DECODE,...")
    p.add_argument("--trace", type=Path, default=_DEFAULT_TRACE)
    p.add_argument("--limit", type=int, default=1000, help="first N requests of the trace")
    p.add_argument("--speed", type=float, default=1.0, help="arrival speed-up")
    p.add_argument("--max-tokens", type=int, default=32, help="cap on each output")
    p.add_argument("--time-scale", type=float, default=1.0, help="wall s per profile s")
    p.add_argument("--policy", default="kv_centric", choices=[p.value for p in Policy])
    p.add_argument("--profile", default="llama3-70b-8xa800")
    p.add_argument("--num-gpu-blocks", type=int, default=5860, help="per engine")
    p.add_argument("--max-running", type=int, default=256, help="per agent")
    p.add_argument("--idle-s", type=float, default=10.0, help="idle CPU sample")
    p.add_argument("--port", type=int, default=8300, help="the conductor's HTTP port")
    # Below Linux's ephemeral range (32768-60999 by default): 33000 up collided with the
    # fleet's own outgoing connections, and an agent then failed to bind (2026-11-28).
    p.add_argument("--base-port", type=int, default=21000, help="engines and agents from here")
    p.add_argument(
        "--conductor-arg", action="append", default=[], metavar="ARG",
        help="pass ARG to the conductor (repeatable; --conductor-arg=--flag=value)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("bench/results/fleet_scale"))
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--replay-timeout-s", type=float, default=3600.0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    ns = parser.parse_args(args)
    try:
        shapes = tuple(parse_shapes(ns.shapes))
    except ValueError as exc:
        parser.error(str(exc))
    if not ns.trace.is_file():
        parser.error(f"--trace {ns.trace}: no such file")
    if ns.limit < 1 or ns.speed <= 0 or ns.max_tokens < 1 or ns.time_scale <= 0 or ns.idle_s <= 0:
        parser.error("--limit, --max-tokens must be >= 1; --speed, --time-scale, --idle-s > 0")
    opts = ScaleOptions(
        shapes=shapes, trace=ns.trace, limit=ns.limit, speed=ns.speed,
        max_tokens=ns.max_tokens, time_scale=ns.time_scale, policy=ns.policy,
        profile=ns.profile, num_gpu_blocks=ns.num_gpu_blocks, max_running=ns.max_running,
        idle_s=ns.idle_s, port=ns.port, base_port=ns.base_port,
        conductor_args=tuple(ns.conductor_arg), out=ns.out,
        startup_timeout_s=ns.startup_timeout_s, replay_timeout_s=ns.replay_timeout_s,
    )  # fmt: skip
    command = shlex.join(["python", "-m", "bench.fleet_scale", *args])

    def run(results: list[ShapeResult]) -> None:
        for prefill, decode in opts.shapes:
            print(f"fleet_scale: {prefill}+{decode} ...", flush=True)
            result = run_shape(opts, prefill, decode)
            print(f"fleet_scale: {prefill}+{decode}: {result.status}", flush=True)
            results.append(result)

    def report(results: list[ShapeResult]) -> Path:
        return write_report(opts, results, command)

    return run_then_report(run, report)


if __name__ == "__main__":
    sys.exit(main())
