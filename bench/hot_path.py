"""The request hot path side by side: what each router adds in front of the same fast
engines — latency at concurrency 1, requests/s at concurrency 64, CPU per request of every
process in the path, memory.

  python -m bench.hot_path [--engines 2] [--requests 300] [--throughput-requests 2000]
      [--targets direct,round_robin,vllm-router:cache_aware,smg:cache_aware,conductor:kv_centric]
      [--out bench/results/hot_path]

The engines are simulated vLLM engines (``kvc sim-engine``, aggregated) whose profile times
are scaled by ``--time-scale`` (default 1e-6: no service time to speak of), so what is
measured is each router's own path: its HTTP front, its decision, its hop to the engine
and the stream back. Every target gets a cold set of engines (``bench.field_routers.serving``,
the same start-up as the field benchmark); ``direct`` sends to the first engine itself and
is the baseline that "added latency" is measured from.

Load (one client process, asyncio + httpx, every request a streamed chat completion of
``--max-tokens`` tokens on a ``--prompt-words``-word prompt made unique per request so no
router or engine serves it from cache):

1. ``--warmup`` requests at concurrency 1 (not counted);
2. ``--requests`` at concurrency 1: latency to the last byte, p50 and p99;
3. ``--throughput-requests`` at concurrency ``--concurrency``: requests/s, with CPU
   (user + system, ``/proc``) of the router (or the conductor and its agents apart) and of
   the engines sampled around this phase, divided by the requests served; peak resident
   memory (``VmHWM``) of the router / conductor after it.

Then ``OUT/hot_path.md`` (table with ratios of the conductor to each peer, command, machine),
``OUT/hot_path.json`` and ``OUT/hot_path.png``. Peers are installed on first use in
``.peers/`` as for the field benchmark. Everything shares the machine: the client and the
engines compete with the router under test, the same for every target.

Knobs: the flags (``--help``). Complexity: targets × (start-up + requests / rate).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from bench.field_fleet import PEERS, cpu_seconds, ensure_peer
from bench.field_routers import read_engine_info, serving, start_engines
from bench.field_targets import REPO, TARGETS, FieldOptions, Target, parse_targets
from bench.fleet_scale import proc_memory_kib
from bench.report import (
    bar_panels,
    markdown_table,
    percentile,
    run_then_report,
    write_run_report,
)
from kvc_cli.supervisor import Supervisor

__all__ = [
    "HotPathOptions",
    "HotPathResult",
    "LoadResult",
    "main",
    "parse_target_names",
    "prompt",
    "ratio_lines",
    "run_load",
    "table_rows",
]

DIRECT = "direct"
_DEFAULT_TARGETS = (
    DIRECT, "round_robin", "vllm-router:cache_aware", "smg:cache_aware", "conductor:kv_centric"
)  # fmt: skip


# ---------------------------------------------------------------- load


@dataclass(slots=True)
class LoadResult:
    latencies_s: list[float] = field(default_factory=list)  # served requests, to last byte
    errors: dict[str, int] = field(default_factory=dict)  # status or exception -> count
    first_error: str | None = None  # the first failed answer's body (300 chars) or exception
    wall_s: float = 0.0

    @property
    def served(self) -> int:
        return len(self.latencies_s)


def prompt(index: int, words: int) -> str:
    """``words`` words, the first naming the request, so no two prompts share a block."""
    vocab = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta")
    return f"request {index}: " + " ".join(vocab[(index + i) % len(vocab)] for i in range(words))


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any], out: LoadResult) -> None:
    started = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            done = False
            lines: list[str] = []
            async for line in response.aiter_lines():
                if line.strip() == "data: [DONE]":
                    done = True
                elif response.status_code != 200:
                    lines.append(line)
            if response.status_code != 200 or not done:
                key = str(response.status_code) if response.status_code != 200 else "no [DONE]"
                out.errors[key] = out.errors.get(key, 0) + 1
                if out.first_error is None:
                    out.first_error = f"{key}: {' '.join(lines)[:300]}"
                return
    except httpx.HTTPError as exc:
        key = type(exc).__name__
        out.errors[key] = out.errors.get(key, 0) + 1
        if out.first_error is None:
            out.first_error = f"{key}: {exc}"[:300]
        return
    out.latencies_s.append(time.perf_counter() - started)


async def _load(
    base_url: str, model: str, first: int, count: int, concurrency: int, opts: HotPathOptions
) -> LoadResult:
    out = LoadResult()
    url = f"{base_url}/v1/chat/completions"
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(first, first + count):
        queue.put_nowait(i)

    async def worker(client: httpx.AsyncClient) -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompt(i, opts.prompt_words)}],
                "max_tokens": opts.max_tokens,
                "stream": True,
            }
            await _one(client, url, body, out)

    async with httpx.AsyncClient(timeout=opts.request_timeout_s, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        out.wall_s = time.perf_counter() - started
    return out


def run_load(
    base_url: str, model: str, first: int, count: int, concurrency: int, opts: HotPathOptions
) -> LoadResult:
    """``count`` streamed chat completions (prompts ``first``…) at ``concurrency``."""
    return asyncio.run(_load(base_url, model, first, count, concurrency, opts))


# ---------------------------------------------------------------- running


@dataclass(frozen=True, slots=True)
class HotPathOptions:
    targets: tuple[str, ...] = _DEFAULT_TARGETS
    engines: int = 2
    time_scale: float = 1e-6
    warmup: int = 20
    requests: int = 300
    throughput_requests: int = 2000
    concurrency: int = 64
    max_tokens: int = 8
    prompt_words: int = 200
    request_timeout_s: float = 60.0
    out: Path = REPO / "bench" / "results" / "hot_path"
    peers_dir: Path = REPO / ".peers"
    startup_timeout_s: float = 300.0


@dataclass(slots=True)
class HotPathResult:
    target: str
    status: str = "ok"
    latency_p50_s: float | None = None
    latency_p99_s: float | None = None
    rps: float | None = None
    served: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    first_error: str | None = None
    cpu_s: dict[str, float] = field(default_factory=dict)  # over the throughput phase
    peak_rss_kib: int | None = None  # the router's / conductor's VmHWM
    commands: dict[str, str] = field(default_factory=dict)

    def cpu_ms_per_request(self, group: str) -> float | None:
        if group not in self.cpu_s or not self.served:
            return None
        return 1000.0 * self.cpu_s[group] / self.served

    @property
    def router_cpu_ms_per_request(self) -> float | None:
        """Everything between the client and the engines: router, or conductor + agents."""
        parts = [g for g in ("router", "conductor", "agents") if g in self.cpu_s]
        if not parts or not self.served:
            return None
        return 1000.0 * sum(self.cpu_s[g] for g in parts) / self.served


def _field_options(opts: HotPathOptions, out_dir: Path) -> FieldOptions:
    """The field's options for this run. The field scales SLOs by the time scale (trace
    time → wall); here the conductor gets the default 30 s / 0.1 s in wall time."""
    return FieldOptions(
        targets=(),
        engines=opts.engines,
        time_scale=opts.time_scale,
        ttft_slo_s=30.0 / opts.time_scale,
        tbt_slo_s=0.1 / opts.time_scale,
        out=out_dir,
        peers_dir=opts.peers_dir,
        startup_timeout_s=opts.startup_timeout_s,
    )


def _measure(
    result: HotPathResult,
    base_url: str,
    model: str,
    groups: dict[str, list[int]],
    opts: HotPathOptions,
) -> None:
    run_load(base_url, model, 0, opts.warmup, 1, opts)
    single = run_load(base_url, model, opts.warmup, opts.requests, 1, opts)
    if single.latencies_s:
        result.latency_p50_s = statistics.median(single.latencies_s)
        result.latency_p99_s = percentile(single.latencies_s, 99)
    before = {k: sum(cpu_seconds(p) for p in pids) for k, pids in groups.items() if pids}
    first = opts.warmup + opts.requests
    loaded = run_load(base_url, model, first, opts.throughput_requests, opts.concurrency, opts)
    after = {k: sum(cpu_seconds(p) for p in pids) for k, pids in groups.items() if pids}
    result.cpu_s = {k: after[k] - before[k] for k in before}
    result.served = loaded.served
    result.rps = loaded.served / loaded.wall_s if loaded.wall_s > 0 else None
    for load in (single, loaded):
        for key, n in load.errors.items():
            result.errors[key] = result.errors.get(key, 0) + n
        result.first_error = result.first_error or load.first_error
    router = groups.get("router") or groups.get("conductor") or []
    if router:
        result.peak_rss_kib = proc_memory_kib(router[0]).get("VmHWM")
    if not result.served:
        result.status = f"failed: nothing served ({result.errors}; first: {result.first_error})"


def run_target(name: str, opts: HotPathOptions, exe: Path | None) -> HotPathResult:
    result = HotPathResult(name)
    out_dir = opts.out / name.replace(":", "-")
    out_dir.mkdir(parents=True, exist_ok=True)
    fopts = _field_options(opts, out_dir)
    try:
        if name == DIRECT:
            procs = Supervisor(grace_s=10.0, log_dir=out_dir / "logs")
            try:
                engines, pids = start_engines(fopts, procs, result.commands)
                model = read_engine_info(engines).model
                _measure(result, engines[0].url, model, {"engines": pids}, opts)
            finally:
                procs.stop_all()
        else:
            target: Target = TARGETS[name]
            with serving(target, fopts, exe, out_dir, result.commands) as s:
                _measure(result, s.base_url, s.info.model, s.groups, opts)
    except (RuntimeError, ValueError, OSError, httpx.HTTPError) as exc:
        result.status = f"failed: {exc}"
    return result


def run_all(opts: HotPathOptions, results: list[HotPathResult]) -> None:
    executables: dict[str, Path | str] = {}
    for name in opts.targets:
        exe: Path | None = None
        if name != DIRECT and TARGETS[name].kind != "conductor":
            kind = TARGETS[name].kind
            if kind not in executables:
                print(f"hot_path: making sure {PEERS[kind].requirement} is installed", flush=True)
                executables[kind] = ensure_peer(PEERS[kind], opts.peers_dir)
            found = executables[kind]
            if isinstance(found, str):
                print(f"hot_path: skipping {name}: {found}", flush=True)
                results.append(HotPathResult(name, status=f"skipped: {found}"))
                continue
            exe = found
        print(f"hot_path: {name} ...", flush=True)
        result = run_target(name, opts, exe)
        print(f"hot_path: {name}: {result.status}", flush=True)
        results.append(result)


# ---------------------------------------------------------------- report


def _f(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


HEADERS = [
    "target",
    "status",
    "latency p50 ms (c=1)",
    "added p50 ms",
    "latency p99 ms (c=1)",
    "req/s (c=64)",
    "router CPU ms/request",
    "of which agents",
    "engines CPU ms/request",
    "router peak RSS MiB",
    "errors",
]


def table_rows(results: Sequence[HotPathResult]) -> list[list[str]]:
    direct = next((r for r in results if r.target == DIRECT and r.latency_p50_s), None)
    rows: list[list[str]] = []
    for r in results:
        added = (
            (r.latency_p50_s - direct.latency_p50_s) * 1000
            if direct is not None and direct.latency_p50_s and r.latency_p50_s
            and r is not direct
            else None
        )  # fmt: skip
        rows.append([
            r.target,
            r.status,
            _f(r.latency_p50_s and r.latency_p50_s * 1000, ".2f"),
            _f(added, ".2f"),
            _f(r.latency_p99_s and r.latency_p99_s * 1000, ".2f"),
            _f(r.rps, ".1f"),
            _f(r.router_cpu_ms_per_request, ".2f"),
            _f(r.cpu_ms_per_request("agents"), ".2f"),
            _f(r.cpu_ms_per_request("engines"), ".2f"),
            _f(r.peak_rss_kib / 1024 if r.peak_rss_kib else None, ".0f"),
            ", ".join(f"{k} ×{v}" for k, v in sorted(r.errors.items())) or "none",
        ])  # fmt: skip
    return rows


def ratio_lines(results: Sequence[HotPathResult]) -> list[str]:
    """The conductor against each peer: CPU per request, added latency, req/s."""
    ours = [r for r in results if r.target.startswith("conductor") and r.status == "ok"]
    peers = [
        r for r in results
        if r.status == "ok" and r.target != DIRECT and not r.target.startswith("conductor")
    ]  # fmt: skip
    direct = next((r for r in results if r.target == DIRECT and r.latency_p50_s), None)
    lines: list[str] = []
    for c in ours:
        for p in peers:
            parts: list[str] = []
            c_cpu, p_cpu = c.router_cpu_ms_per_request, p.router_cpu_ms_per_request
            if c_cpu and p_cpu:
                parts.append(f"CPU per request {c_cpu / p_cpu:.1f}×")
            if direct is not None and direct.latency_p50_s and c.latency_p50_s and p.latency_p50_s:
                c_add = c.latency_p50_s - direct.latency_p50_s
                p_add = p.latency_p50_s - direct.latency_p50_s
                if p_add > 0:
                    parts.append(f"added latency p50 {c_add / p_add:.1f}×")
            if c.rps and p.rps:
                parts.append(f"req/s at concurrency {c.rps / p.rps:.2f}×")
            if parts:
                lines.append(f"- {c.target} / {p.target}: " + ", ".join(parts))
    return lines


def _plot(path: Path, results: Sequence[HotPathResult]) -> None:
    done = [r for r in results if r.status == "ok"]
    if not done:
        return
    labels = [r.target.replace(":", "\n") for r in done]
    panels = [
        ("latency p50 at c=1 (ms)", [(r.latency_p50_s or 0) * 1000 for r in done]),
        ("requests/s at c=64", [r.rps or 0 for r in done]),
        ("router CPU per request (ms)", [r.router_cpu_ms_per_request or 0 for r in done]),
    ]
    title = "The request hot path, same engines (bench.hot_path)"
    bar_panels(path, title, labels, panels, panel_width=5.0, label_size=7)


def write_report(opts: HotPathOptions, results: Sequence[HotPathResult], command: str) -> Path:
    headers = [h.replace("c=64", f"c={opts.concurrency}") for h in HEADERS]
    ratios = "\n".join(ratio_lines(results)) or "(no conductor and peer both measured)"
    text = (
        f"{markdown_table(headers, table_rows(results))}\n\n"
        f"Ratios, conductor / peer (same run):\n{ratios}\n\n"
        f"{opts.engines} simulated engines (time scale {opts.time_scale:g}); streamed chat "
        f"completions, {opts.prompt_words}-word prompts unique per request, max_tokens "
        f"{opts.max_tokens}; {opts.requests} requests at concurrency 1 after {opts.warmup} "
        f"warm-up, {opts.throughput_requests} at concurrency {opts.concurrency}. CPU: user + "
        "system over the concurrency phase (/proc), per request served."
    )
    commands = [(f"{r.target}, {name}", cmd) for r in results for name, cmd in r.commands.items()]
    title = "The request hot path, side by side"
    md = write_run_report(opts.out, "hot_path", title, command, text, commands, opts, results)
    _plot(opts.out / "hot_path.png", results)
    return md


# ---------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    d = HotPathOptions()
    p = argparse.ArgumentParser(
        prog="python -m bench.hot_path",
        description="what each router adds in front of the same fast simulated engines",
    )
    choices = [DIRECT, *TARGETS]
    p.add_argument(
        "--targets", default=",".join(d.targets), help=f"comma-separated, from: {choices}"
    )
    p.add_argument("--engines", type=int, default=d.engines)
    p.add_argument("--time-scale", type=float, default=d.time_scale, help="engine step times ×")
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--requests", type=int, default=d.requests, help="at concurrency 1")
    p.add_argument("--throughput-requests", type=int, default=d.throughput_requests)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--prompt-words", type=int, default=d.prompt_words)
    p.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s)
    p.add_argument("--out", type=Path, default=d.out)
    p.add_argument("--peers-dir", type=Path, default=d.peers_dir)
    p.add_argument("--startup-timeout-s", type=float, default=d.startup_timeout_s)
    return p


def parse_target_names(text: str) -> tuple[str, ...]:
    """``direct`` and the field's target names; ValueError naming a bad one."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("--targets: give at least one")
    peers = [n for n in names if n != DIRECT]
    if peers:
        parse_targets(",".join(peers))
    return tuple(names)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    ns = parser.parse_args(args)
    try:
        targets = parse_target_names(ns.targets)
    except ValueError as exc:
        parser.error(str(exc))
    counts = (ns.engines, ns.requests, ns.throughput_requests, ns.concurrency, ns.max_tokens)
    if min(counts) < 1 or ns.warmup < 0 or ns.prompt_words < 1 or ns.time_scale <= 0:
        parser.error(
            "--engines, --requests, --throughput-requests, --concurrency, --max-tokens and "
            "--prompt-words must be >= 1, --warmup >= 0, --time-scale > 0"
        )
    opts = HotPathOptions(
        targets=targets, engines=ns.engines, time_scale=ns.time_scale, warmup=ns.warmup,
        requests=ns.requests, throughput_requests=ns.throughput_requests,
        concurrency=ns.concurrency, max_tokens=ns.max_tokens, prompt_words=ns.prompt_words,
        request_timeout_s=ns.request_timeout_s, out=ns.out, peers_dir=ns.peers_dir,
        startup_timeout_s=ns.startup_timeout_s,
    )  # fmt: skip
    command = shlex.join(["python", "-m", "bench.hot_path", *args])

    def report(results: list[HotPathResult]) -> Path:
        return write_report(opts, results, command)

    return run_then_report(partial(run_all, opts), report)


if __name__ == "__main__":
    sys.exit(main())
