"""The field's routers on our simulated fleet: the same engines, the same trace, the same run.

  python -m bench.field_routers [--engines 4] [--limit 100] [--time-scale 0.1]
      [--targets round_robin,vllm-router:cache_aware,vllm-router:kv_aware,smg:cache_aware,
                 conductor:kv_centric,conductor:kv_adaptive]
      [--trace /work/shared/traces/synthetic_trace.jsonl] [--out bench/results/field]
      [--engine-url URL ... [--engine-events URL=EVENTS[,REPLAY] ...]]

For each target, in the order given:

1. a cold fleet: ``--engines N`` simulated vLLM engines (``kvc sim-engine``, aggregated:
   each prefills and decodes; KV events on their own ZMQ ports), started fresh for the
   target; or the ``--engine-url`` engines, whose prefix caches are reset
   (``POST /reset_prefix_cache``, refused = the run stops: a warm cache would flatter the
   next target);
2. the target in front of them: ``round_robin`` (vllm-router's, the floor),
   ``vllm-router:cache_aware`` (its approximate tree over request text),
   ``vllm-router:kv_aware`` (its index fed by every engine's KV events,
   ``--kv-event-source``), ``smg:cache_aware`` (SGLang's gateway), or
   ``conductor:kv_centric`` / ``conductor:kv_adaptive`` (one ``kvc agent --engine vllm`` per
   engine attached to its URL and KV events, and one ``kvc conductor``);
3. the trace replayed through it by ``kvc bench live`` (open loop at the trace's times ×
   ``--time-scale``), its ``summary.json`` kept under ``OUT/<target>/``;
4. CPU seconds of the router's processes over the replay only (``/proc``: the conductor and
   its agents apart; the engines' and the client's too), the engines' own prefix-cache hit
   ratio (``vllm:prefix_cache_hits_total / queries_total`` over the replay), and for the
   peers their Prometheus text.

Then ``OUT/table.md`` (the peer table, the commands, the machine), ``OUT/results.json`` and
``OUT/field_routers.png``. Peers are installed on first use in ``.peers/`` (bench.field_fleet);
a peer that cannot be installed is skipped with its reason in the table. Times in the table
are in trace seconds (wall / time scale), as ``kvc bench live`` reports them.

Knobs: the flags (``--help``). Complexity: targets × (fleet start + replay wall time).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import httpx

from bench.field_fleet import (
    PEERS,
    Processes,
    cpu_seconds,
    ensure_peer,
    free_ports,
    http_ok,
    metric_samples,
)
from bench.report import markdown_table
from kvc_sim.replay import machine

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = Path("/work/shared/traces/synthetic_trace.jsonl")
HOST = "127.0.0.1"
KV_TOPIC = "kv-events"

TargetKind = Literal["vllm-router", "smg", "conductor"]


@dataclass(frozen=True, slots=True)
class Target:
    name: str  # as on the command line and in the table
    kind: TargetKind
    policy: str

    @property
    def slug(self) -> str:
        """The target's folder name under ``--out``."""
        return self.name.replace(":", "-")


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("round_robin", "vllm-router", "round_robin"),
        Target("vllm-router:cache_aware", "vllm-router", "cache_aware"),
        Target("vllm-router:kv_aware", "vllm-router", "kv_aware"),
        Target("smg:cache_aware", "smg", "cache_aware"),
        Target("conductor:kv_centric", "conductor", "kv_centric"),
        Target("conductor:kv_adaptive", "conductor", "kv_adaptive"),
    )
}


def parse_targets(text: str) -> list[Target]:
    """Comma-separated target names, in the order given; unknown or repeated ones refused."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("no targets given")
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise ValueError(f"unknown target(s) {unknown}; choose from {', '.join(TARGETS)}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"target(s) given twice: {repeated}")
    return [TARGETS[n] for n in names]


@dataclass(frozen=True, slots=True)
class Engine:
    url: str  # http://host:port
    events: str | None = None  # ZMQ PUB endpoint as subscribers connect to it
    replay: str | None = None  # ZMQ ROUTER replay endpoint


def parse_engines(urls: Sequence[str], events: Sequence[str]) -> list[Engine]:
    """``--engine-url`` values with their ``--engine-events URL=EVENTS[,REPLAY]``."""
    by_url: dict[str, tuple[str, str | None]] = {}
    for item in events:
        url, sep, endpoints = item.partition("=")
        parts = [p.strip() for p in endpoints.split(",") if p.strip()]
        if not sep or not 1 <= len(parts) <= 2:
            raise ValueError(f"--engine-events {item!r}: expected URL=EVENTS[,REPLAY]")
        if url not in urls:
            raise ValueError(f"--engine-events names {url!r}, which is no --engine-url")
        if not all(p.startswith("tcp://") for p in parts):
            raise ValueError(f"--engine-events {item!r}: endpoints must be tcp://host:port")
        by_url[url] = (parts[0], parts[1] if len(parts) == 2 else None)
    if len(set(urls)) != len(urls):
        raise ValueError("an --engine-url is given twice")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--engine-url {url!r} is not an http(s) URL")
    out = []
    for url in urls:
        ev, replay = by_url.get(url, (None, None))
        out.append(Engine(url.rstrip("/"), ev, replay))
    return out


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What every engine of the fleet reports alike (checked equal across engines)."""

    model: str
    block_size: int
    num_gpu_blocks: int


@dataclass(frozen=True, slots=True)
class FieldOptions:
    targets: tuple[Target, ...] = tuple(TARGETS.values())
    engines: int = 4
    engine_urls: tuple[Engine, ...] = ()  # external engines instead of starting ``engines``
    trace: Path = DEFAULT_TRACE
    limit: int | None = 100
    time_scale: float = 0.1
    speed: float = 1.0
    ttft_slo_s: float = 30.0  # trace time, as kvc bench live and the conductor take it
    tbt_slo_s: float = 0.1
    prompt_format: str = "text"
    profile: str = "llama3-70b-8xa800"
    block_size: int = 512
    num_gpu_blocks: int = 5860
    max_model_len: int = 262_144
    served_model_name: str = "tiny-llama"
    max_running: int = 256
    engine_args: tuple[str, ...] = ()
    live_args: tuple[str, ...] = ()
    out: Path = REPO / "bench" / "results" / "field"
    peers_dir: Path = REPO / ".peers"
    startup_timeout_s: float = 300.0
    replay_timeout_s: float = 7200.0

    def __post_init__(self) -> None:
        if not self.engine_urls and self.engines < 1:
            raise ValueError("--engines must be >= 1 (or give --engine-url)")
        if self.time_scale <= 0 or self.speed <= 0:
            raise ValueError("--time-scale and --speed must be > 0")
        if self.limit is not None and self.limit < 1:
            raise ValueError("--limit must be >= 1")
        if self.ttft_slo_s <= 0 or self.tbt_slo_s <= 0:
            raise ValueError("SLOs must be > 0")
        needs_events = [
            t.name for t in self.targets if t.policy == "kv_aware" or t.kind == "conductor"
        ]
        missing = [e.url for e in self.engine_urls if e.events is None]
        if needs_events and missing:
            raise ValueError(
                f"{needs_events} need every engine's KV events: give --engine-events for {missing}"
            )


# ---------------------------------------------------------------- commands (pure)


def kvc(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvc_cli", *args]


def sim_engine_argv(
    opts: FieldOptions, index: int, port: int, events_port: int, replay_port: int
) -> list[str]:
    """``kvc sim-engine``: aggregated, its PUB and replay sockets bound on the ports."""
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # vLLM's rule: an endpoint with '*' binds, an explicit host connects. Every
        # subscriber here (vllm-router, our agents) connects, so the engine binds.
        "endpoint": f"tcp://*:{events_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": KV_TOPIC,
    }
    return kvc(
        "sim-engine", "--host", HOST, "--port", str(port),
        "--served-model-name", opts.served_model_name, "--engine-id", f"engine-{index}",
        "--profile", opts.profile, "--time-scale", repr(opts.time_scale),
        "--block-size", str(opts.block_size), "--num-gpu-blocks", str(opts.num_gpu_blocks),
        "--max-model-len", str(opts.max_model_len),
        "--kv-events-config", json.dumps(events), *opts.engine_args,
    )  # fmt: skip


def vllm_router_argv(
    exe: Path,
    policy: str,
    port: int,
    metrics_port: int,
    engines: Sequence[Engine],
    info: EngineInfo,
) -> list[str]:
    argv = [
        str(exe), "--host", HOST, "--port", str(port), "--policy", policy,
        "--worker-urls", *(e.url for e in engines),
        "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
        "--log-level", "warning",
    ]  # fmt: skip
    if policy == "kv_aware":
        for e in engines:
            if e.events is None:
                raise ValueError(f"kv_aware needs the KV events of {e.url}")
            argv += ["--kv-event-source", f"{e.url}={e.events}"]
            if e.replay is not None:
                argv += ["--kv-event-replay-source", f"{e.url}={e.replay}"]
        argv += ["--kv-event-model", info.model, "--kv-event-block-size", str(info.block_size)]
    return argv


def smg_argv(
    exe: Path, policy: str, port: int, metrics_port: int, engines: Sequence[Engine]
) -> list[str]:
    """The flags REFERENCE.md records as working here (explicit host, no tokenizer load)."""
    return [
        str(exe), "launch", "--host", HOST, "--port", str(port), "--policy", policy,
        "--worker-urls", *(e.url for e in engines),
        "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
        "--disable-tokenizer-autoload", "--worker-warmup-secs", "0",
        "--disable-worker-overload-protection", "--shutdown-grace-period-secs", "1",
        "--log-level", "warn",
    ]  # fmt: skip


def agent_argv(opts: FieldOptions, index: int, port: int, engine: Engine) -> list[str]:
    if engine.events is None:
        raise ValueError(f"an agent needs the KV events of {engine.url}")
    return kvc(
        "agent", "--engine", "vllm", "--role", "both", "--host", HOST, "--port", str(port),
        "--node-id", f"engine-{index}", "--served-model-name", opts.served_model_name,
        "--vllm-url", engine.url, "--kv-events-endpoint", engine.events,
        *(("--kv-events-replay-endpoint", engine.replay) if engine.replay else ()),
        "--kv-events-topic", KV_TOPIC, "--max-running", str(opts.max_running),
        "--shutdown-grace-s", "2",
    )  # fmt: skip


def conductor_argv(opts: FieldOptions, policy: str, port: int, agents: Sequence[str]) -> list[str]:
    """SLOs in wall time: the trace's × the time scale (the engines run that much faster)."""
    return kvc(
        "conductor", "--host", HOST, "--port", str(port),
        "--served-model-name", opts.served_model_name, "--agents", ",".join(agents),
        "--policy", policy, "--drain-delay-s", "0",
        "--ttft-slo-s", f"{opts.ttft_slo_s * opts.time_scale:.6g}",
        "--tbt-slo-s", f"{opts.tbt_slo_s * opts.time_scale:.6g}",
    )  # fmt: skip


def live_argv(opts: FieldOptions, url: str, out_dir: Path, run_name: str) -> list[str]:
    return kvc(
        "bench", "live", "--url", url, "--trace", str(opts.trace), "--out", str(out_dir),
        "--name", run_name, "--time-scale", repr(opts.time_scale),
        "--speed", repr(opts.speed), "--prompt-format", opts.prompt_format,
        "--ttft-slo-s", repr(opts.ttft_slo_s), "--tbt-slo-s", repr(opts.tbt_slo_s),
        *(("--limit", str(opts.limit)) if opts.limit is not None else ()),
        "--quiet", *opts.live_args,
    )  # fmt: skip


# ---------------------------------------------------------------- results (pure)


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
    for labels, value in metric_samples(router_metrics, "vllm_router_kv_routing_inputs_total"):
        key = _label(labels, "result") or "?"
        counts[key] = counts.get(key, 0.0) + value
    return counts


def hit_ratio_delta(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Engines' prefix-cache hit ratio over an interval from their summed counters."""
    queries = after["queries"] - before["queries"]
    if queries <= 0:
        return None
    return (after["hits"] - before["hits"]) / queries


# ---------------------------------------------------------------- running


def _engine_counters(engines: Sequence[Engine]) -> dict[str, float]:
    hits = queries = 0.0
    for e in engines:
        text = httpx.get(f"{e.url}/metrics", timeout=10.0).text
        hits += sum(v for _, v in metric_samples(text, "vllm:prefix_cache_hits_total"))
        queries += sum(v for _, v in metric_samples(text, "vllm:prefix_cache_queries_total"))
    return {"hits": hits, "queries": queries}


def _label(labels: str, key: str) -> str | None:
    for part in labels.strip("{}").split(","):
        name, _, value = part.partition("=")
        if name.strip() == key:
            return value.strip().strip('"')
    return None


def read_engine_info(engines: Sequence[Engine]) -> EngineInfo:
    """Model, block size and KV blocks, the same on every engine (else an error)."""
    seen: set[EngineInfo] = set()
    for e in engines:
        models = httpx.get(f"{e.url}/v1/models", timeout=10.0).json().get("data") or []
        text = httpx.get(f"{e.url}/metrics", timeout=10.0).text
        config = metric_samples(text, "vllm:cache_config_info")
        if not models or not config:
            raise RuntimeError(f"{e.url} reports no model or no vllm:cache_config_info")
        labels = config[0][0]
        block_size, blocks = _label(labels, "block_size"), _label(labels, "num_gpu_blocks")
        if block_size is None or blocks is None:
            raise RuntimeError(f"{e.url}: vllm:cache_config_info lacks block_size/num_gpu_blocks")
        seen.add(EngineInfo(str(models[0]["id"]), int(block_size), int(blocks)))
    if len(seen) != 1:
        raise RuntimeError(f"the engines differ: {sorted(map(str, seen))}")
    return seen.pop()


def _start_engines(
    opts: FieldOptions, procs: Processes, commands: dict[str, str]
) -> tuple[list[Engine], list[int]]:
    engines: list[Engine] = []
    pids: list[int] = []
    ports = free_ports(3 * opts.engines)
    for i in range(opts.engines):
        http, ev, replay = ports[3 * i : 3 * i + 3]
        argv = sim_engine_argv(opts, i, http, ev, replay)
        if i == 0:
            commands["engine-0"] = shlex.join(argv)
        child = procs.spawn(f"engine-{i}", argv)
        pids.append(child.proc.pid)
        engines.append(
            Engine(f"http://{HOST}:{http}", f"tcp://{HOST}:{ev}", f"tcp://{HOST}:{replay}")
        )
    for e in engines:
        health = f"{e.url}/health"
        procs.wait_until(partial(http_ok, health), f"engine {e.url}", opts.startup_timeout_s)
    return engines, pids


def _reset_engines(engines: Sequence[Engine]) -> None:
    for e in engines:
        response = httpx.post(f"{e.url}/reset_prefix_cache", timeout=30.0)
        if response.status_code != 200:
            raise RuntimeError(
                f"{e.url} refused POST /reset_prefix_cache ({response.status_code}): restart the "
                "engines before each target, or let the script start them (--engines N)"
            )


def _ready_workers(expected: int) -> Any:
    def check(response: httpx.Response) -> bool:
        body = response.json()
        return int(body.get("healthy_workers", -1)) == expected

    return check


def _agents_usable(expected: int) -> Any:
    def check(response: httpx.Response) -> bool:
        agents = response.json().get("agents") or []
        return sum(bool(a.get("usable")) for a in agents) == expected

    return check


def _run_replay(argv: Sequence[str], log: Path, timeout_s: float) -> tuple[int, float, float]:
    """Run the client; its exit code, wall seconds and CPU seconds (from wait4)."""
    started = time.perf_counter()
    with log.open("ab") as out:
        out.write(f"$ {shlex.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            list(argv), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )

    def kill() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout_s, kill)
    timer.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, time.perf_counter() - started, usage.ru_utime + usage.ru_stime


def run_target(target: Target, opts: FieldOptions, exe: Path | None) -> TargetResult:
    """One target on a cold fleet: start, replay, measure, stop."""
    result = TargetResult(target.name)
    out_dir = opts.out / target.slug
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = Processes(out_dir / "logs")
    try:
        engines: list[Engine]
        engine_pids: list[int]
        if opts.engine_urls:
            engines, engine_pids = list(opts.engine_urls), []
            _reset_engines(engines)
        else:
            engines, engine_pids = _start_engines(opts, procs, result.commands)
        info = read_engine_info(engines)
        groups: dict[str, list[int]] = {"engines": engine_pids}
        port, metrics_port = free_ports(2)
        base = f"http://{HOST}:{port}"
        metrics_url: str | None = f"http://{HOST}:{metrics_port}/metrics"
        if target.kind == "conductor":
            grpc_ports = free_ports(len(engines))
            agent_cmds = [
                agent_argv(opts, i, p, e)
                for i, (e, p) in enumerate(zip(engines, grpc_ports, strict=True))
            ]
            agents = [procs.spawn(f"agent-{i}", cmd) for i, cmd in enumerate(agent_cmds)]
            argv = conductor_argv(opts, target.policy, port, [f"{HOST}:{p}" for p in grpc_ports])
            conductor = procs.spawn("conductor", argv)
            result.commands["agent-0"] = shlex.join(agent_cmds[0])
            result.commands["conductor"] = shlex.join(argv)
            groups["conductor"] = [conductor.proc.pid]
            groups["agents"] = [a.proc.pid for a in agents]
            ready = _agents_usable(len(engines))
            procs.wait_until(
                lambda: http_ok(f"{base}/ready", ready), "conductor", opts.startup_timeout_s
            )
            metrics_url = None
        else:
            assert exe is not None
            if target.kind == "vllm-router":
                argv = vllm_router_argv(exe, target.policy, port, metrics_port, engines, info)
            else:
                argv = smg_argv(exe, target.policy, port, metrics_port, engines)
            router = procs.spawn("router", argv)
            result.commands["router"] = shlex.join(argv)
            groups["router"] = [router.proc.pid]
            ready = _ready_workers(len(engines))
            procs.wait_until(
                lambda: http_ok(f"{base}/readiness", ready), target.name, opts.startup_timeout_s
            )
        live = live_argv(opts, base, out_dir, target.slug)
        result.commands["replay"] = shlex.join(live)
        counters_before = _engine_counters(engines)
        cpu_before = {k: sum(cpu_seconds(p) for p in pids) for k, pids in groups.items()}
        code, wall_s, client_cpu = _run_replay(live, out_dir / "replay.log", opts.replay_timeout_s)
        cpu_after = {k: sum(cpu_seconds(p) for p in pids) for k, pids in groups.items()}
        result.cpu_s = {k: cpu_after[k] - cpu_before[k] for k in groups if groups[k]}
        result.cpu_s["client"] = client_cpu
        result.replay_wall_s = wall_s
        result.engine_hit_ratio = hit_ratio_delta(counters_before, _engine_counters(engines))
        if metrics_url is not None:
            with contextlib.suppress(httpx.HTTPError):
                text = httpx.get(metrics_url, timeout=10).text
                (out_dir / "router_metrics.txt").write_text(text)
                if target.policy == "kv_aware":
                    inputs = kv_input_counts(text)
                    result.notes.append(
                        "token inputs of its KV scoring (vllm_router_kv_routing_inputs_total): "
                        + (", ".join(f"{k} {v:g}" for k, v in inputs.items()) or "none")
                    )
        if (dead := procs.exited()) is not None:
            result.notes.append(
                f"{dead.name} exited (code {dead.proc.returncode}) during the replay"
            )
        if code != 0:
            result.status = f"failed: kvc bench live exited {code} (see {out_dir / 'replay.log'})"
            return result
        summary = json.loads((out_dir / "summary.json").read_text())
        result.summary = summary["policies"][target.slug]
    except (RuntimeError, ValueError, OSError, httpx.HTTPError) as exc:
        result.status = f"failed: {exc}"
    finally:
        procs.stop_all()
    return result


def run_all(opts: FieldOptions) -> list[TargetResult]:
    results = []
    executables: dict[str, Path | str] = {}
    for target in opts.targets:
        exe: Path | None = None
        if target.kind != "conductor":
            if target.kind not in executables:
                print(
                    f"field: making sure {PEERS[target.kind].requirement} is installed", flush=True
                )
                executables[target.kind] = ensure_peer(PEERS[target.kind], opts.peers_dir)
            found = executables[target.kind]
            if isinstance(found, str):
                print(f"field: skipping {target.name}: {found}", flush=True)
                results.append(TargetResult(target.name, status=f"skipped: {found}"))
                continue
            exe = found
        print(f"field: {target.name} ...", flush=True)
        result = run_target(target, opts, exe)
        print(f"field: {target.name}: {result.status}", flush=True)
        results.append(result)
    return results


# ---------------------------------------------------------------- report


def write_report(opts: FieldOptions, results: Sequence[TargetResult], command: str) -> Path:
    opts.out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(TABLE_HEADERS, table_rows(results))
    fleet = (
        f"{len(opts.engine_urls)} external engines"
        if opts.engine_urls
        else f"{opts.engines} simulated vLLM engines (aggregated, profile {opts.profile}, "
        f"{opts.block_size}-token blocks, {opts.num_gpu_blocks} blocks each)"
    )
    lines = [
        "# The field on the same fleet",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {machine()}",
        "",
        f"Fleet: {fleet}; trace {opts.trace} (first {opts.limit} requests), time scale "
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


# ---------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    d = FieldOptions()
    p = argparse.ArgumentParser(
        prog="python -m bench.field_routers",
        description="vllm-router, smg and the conductor on the same simulated fleet and trace",
    )
    p.add_argument(
        "--targets", default=",".join(TARGETS), help=f"comma-separated, from: {', '.join(TARGETS)}"
    )
    p.add_argument("--engines", type=int, default=d.engines, help="simulated engines to start")
    p.add_argument(
        "--engine-url", action="append", default=[], metavar="URL",
        help="use this running engine instead (repeatable); its prefix cache is reset per target",
    )  # fmt: skip
    p.add_argument(
        "--engine-events", action="append", default=[], metavar="URL=EVENTS[,REPLAY]",
        help="the KV-event endpoints (tcp://) of an --engine-url engine (repeatable)",
    )  # fmt: skip
    p.add_argument("--trace", type=Path, default=d.trace)
    p.add_argument("--limit", type=int, default=d.limit, help="first N requests (0: all)")
    p.add_argument(
        "--time-scale", type=float, default=d.time_scale, help="wall seconds per trace second"
    )
    p.add_argument("--speed", type=float, default=d.speed, help="trace replay speed")
    p.add_argument("--ttft-slo-s", type=float, default=d.ttft_slo_s, help="trace time")
    p.add_argument("--tbt-slo-s", type=float, default=d.tbt_slo_s, help="trace time")
    p.add_argument("--prompt-format", choices=["text", "token-ids"], default=d.prompt_format)
    p.add_argument("--profile", default=d.profile, help="sim engine timing profile")
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--num-gpu-blocks", type=int, default=d.num_gpu_blocks, help="per engine")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--served-model-name", default=d.served_model_name)
    p.add_argument("--max-running", type=int, default=d.max_running, help="per agent")
    p.add_argument(
        "--engine-arg", action="append", default=[], metavar="ARG",
        help="pass ARG to every sim engine (repeatable; --engine-arg=--flag=value)",
    )  # fmt: skip
    p.add_argument(
        "--live-arg", action="append", default=[], metavar="ARG",
        help="pass ARG to kvc bench live (repeatable)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=d.out)
    p.add_argument("--peers-dir", type=Path, default=d.peers_dir)
    p.add_argument("--startup-timeout-s", type=float, default=d.startup_timeout_s)
    p.add_argument("--replay-timeout-s", type=float, default=d.replay_timeout_s)
    return p


def options_from_args(ns: argparse.Namespace) -> FieldOptions:
    """Validated options; ``ValueError`` with the flag's name when one is wrong."""
    return FieldOptions(
        targets=tuple(parse_targets(ns.targets)),
        engines=ns.engines,
        engine_urls=tuple(parse_engines(ns.engine_url, ns.engine_events)),
        trace=ns.trace,
        limit=ns.limit or None,
        time_scale=ns.time_scale,
        speed=ns.speed,
        ttft_slo_s=ns.ttft_slo_s,
        tbt_slo_s=ns.tbt_slo_s,
        prompt_format=ns.prompt_format,
        profile=ns.profile,
        block_size=ns.block_size,
        num_gpu_blocks=ns.num_gpu_blocks,
        max_model_len=ns.max_model_len,
        served_model_name=ns.served_model_name,
        max_running=ns.max_running,
        engine_args=tuple(ns.engine_arg),
        live_args=tuple(ns.live_arg),
        out=ns.out,
        peers_dir=ns.peers_dir,
        startup_timeout_s=ns.startup_timeout_s,
        replay_timeout_s=ns.replay_timeout_s,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    ns = parser.parse_args(args)
    try:
        opts = options_from_args(ns)
    except ValueError as exc:
        parser.error(str(exc))
    if not opts.trace.is_file():
        parser.error(f"--trace {opts.trace}: no such file")
    results = run_all(opts)
    md = write_report(opts, results, shlex.join(["python", "-m", "bench.field_routers", *args]))
    print(md.read_text())
    return 0 if all(r.status == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
