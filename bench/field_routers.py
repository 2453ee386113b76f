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

Targets and commands: ``bench.field_targets``; the table and report: ``bench.field_report``;
processes, peers and CPU: ``bench.field_fleet``.

Knobs: the flags (``--help``). Complexity: targets × (fleet start + replay wall time).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx

from bench.field_fleet import (
    PEERS,
    cpu_seconds,
    ensure_peer,
    http_ok,
    run_client,
)
from bench.field_report import (
    TargetResult,
    hit_ratio_delta,
    kv_input_counts,
    status_note,
    write_report,
)
from bench.field_targets import (
    HOST,
    TARGETS,
    Engine,
    EngineInfo,
    FieldOptions,
    Target,
    agent_argv,
    conductor_argv,
    live_argv,
    parse_engines,
    parse_targets,
    sim_engine_argv,
    smg_argv,
    vllm_router_argv,
)
from bench.report import run_then_report
from kvc.processes import free_ports
from kvc_cli.supervisor import Supervisor
from node_agent.engines.vllm.http_parsing import metric_values

# ---------------------------------------------------------------- running


def _engine_counters(engines: Sequence[Engine]) -> dict[str, float]:
    hits = queries = 0.0
    for e in engines:
        text = httpx.get(f"{e.url}/metrics", timeout=10.0).text
        values = metric_values(text)
        hits += sum(v for _, v in values.get("vllm:prefix_cache_hits_total", []))
        queries += sum(v for _, v in values.get("vllm:prefix_cache_queries_total", []))
    return {"hits": hits, "queries": queries}


def read_engine_info(engines: Sequence[Engine]) -> EngineInfo:
    """Model, block size and KV blocks, the same on every engine (else an error)."""
    seen: set[EngineInfo] = set()
    for e in engines:
        models = httpx.get(f"{e.url}/v1/models", timeout=10.0).json().get("data") or []
        text = httpx.get(f"{e.url}/metrics", timeout=10.0).text
        config = metric_values(text).get("vllm:cache_config_info", [])
        if not models or not config:
            raise RuntimeError(f"{e.url} reports no model or no vllm:cache_config_info")
        labels = config[0][0]
        block_size, blocks = labels.get("block_size"), labels.get("num_gpu_blocks")
        if block_size is None or blocks is None:
            raise RuntimeError(f"{e.url}: vllm:cache_config_info lacks block_size/num_gpu_blocks")
        seen.add(EngineInfo(str(models[0]["id"]), int(block_size), int(blocks)))
    if len(seen) != 1:
        raise RuntimeError(f"the engines differ: {sorted(map(str, seen))}")
    return seen.pop()


def start_engines(
    opts: FieldOptions, procs: Supervisor, commands: dict[str, str]
) -> tuple[list[Engine], list[int]]:
    engines: list[Engine] = []
    pids: list[int] = []
    ports = free_ports(3 * opts.engines)
    for i in range(opts.engines):
        http, ev, replay = ports[3 * i : 3 * i + 3]
        argv = sim_engine_argv(opts, i, http, ev, replay)
        if i == 0:
            commands["engine-0"] = shlex.join(argv)
        child = procs.spawn_argv(f"engine-{i}", argv)
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


def _ready_workers(expected: int) -> Callable[[httpx.Response], bool]:
    def check(response: httpx.Response) -> bool:
        body = response.json()
        return int(body.get("healthy_workers", -1)) == expected

    return check


def _agents_usable(expected: int) -> Callable[[httpx.Response], bool]:
    def check(response: httpx.Response) -> bool:
        agents = response.json().get("agents") or []
        return sum(bool(a.get("usable")) for a in agents) == expected

    return check


@dataclass(slots=True)
class Serving:
    """A target running in front of its engines: where to send requests and what to
    measure (pids by group: ``engines``, and ``router`` or ``conductor`` + ``agents``)."""

    base_url: str
    engines: list[Engine]
    info: EngineInfo
    groups: dict[str, list[int]]
    metrics_url: str | None  # a peer's Prometheus endpoint; None for the conductor
    procs: Supervisor


@contextlib.contextmanager
def serving(
    target: Target,
    opts: FieldOptions,
    exe: Path | None,
    out_dir: Path,
    commands: dict[str, str],
) -> Iterator[Serving]:
    """Start a cold fleet (or reset the given engines) and ``target`` in front of it, wait
    until it routes to every engine; stop every process on exit. The commands started are
    recorded in ``commands``. Startup failures raise RuntimeError (with a dead child's log)."""
    procs = Supervisor(grace_s=10.0, log_dir=out_dir / "logs")
    try:
        engines: list[Engine]
        engine_pids: list[int]
        if opts.engine_urls:
            engines, engine_pids = list(opts.engine_urls), []
            _reset_engines(engines)
        else:
            engines, engine_pids = start_engines(opts, procs, commands)
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
            agents = [procs.spawn_argv(f"agent-{i}", cmd) for i, cmd in enumerate(agent_cmds)]
            argv = conductor_argv(opts, target.policy, port, [f"{HOST}:{p}" for p in grpc_ports])
            conductor = procs.spawn_argv("conductor", argv)
            commands["agent-0"] = shlex.join(agent_cmds[0])
            commands["conductor"] = shlex.join(argv)
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
            router = procs.spawn_argv("router", argv)
            commands["router"] = shlex.join(argv)
            groups["router"] = [router.proc.pid]
            ready = _ready_workers(len(engines))
            procs.wait_until(
                lambda: http_ok(f"{base}/readiness", ready), target.name, opts.startup_timeout_s
            )
        yield Serving(base, engines, info, groups, metrics_url, procs)
    finally:
        procs.stop_all()


def run_target(target: Target, opts: FieldOptions, exe: Path | None) -> TargetResult:
    """One target on a cold fleet: start, replay, measure, stop."""
    result = TargetResult(target.name)
    out_dir = opts.out / target.slug
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        with serving(target, opts, exe, out_dir, result.commands) as s:
            _replay_and_measure(target, opts, s, out_dir, result)
    except (RuntimeError, ValueError, OSError, httpx.HTTPError) as exc:
        result.status = f"failed: {exc}"
    return result


def _replay_and_measure(
    target: Target, opts: FieldOptions, s: Serving, out_dir: Path, result: TargetResult
) -> None:
    live = live_argv(opts, s.base_url, out_dir, target.slug)
    result.commands["replay"] = shlex.join(live)
    groups = s.groups
    counters_before = _engine_counters(s.engines)
    cpu_before = {k: sum(cpu_seconds(p) for p in pids) for k, pids in groups.items()}
    code, wall_s, client_cpu = run_client(live, out_dir / "replay.log", opts.replay_timeout_s)
    cpu_after = {k: sum(cpu_seconds(p) for p in pids) for k, pids in groups.items()}
    result.cpu_s = {k: cpu_after[k] - cpu_before[k] for k in groups if groups[k]}
    result.cpu_s["client"] = client_cpu
    result.replay_wall_s = wall_s
    result.engine_hit_ratio = hit_ratio_delta(counters_before, _engine_counters(s.engines))
    if s.metrics_url is not None:
        with contextlib.suppress(httpx.HTTPError):
            text = httpx.get(s.metrics_url, timeout=10).text
            (out_dir / "router_metrics.txt").write_text(text)
            if target.policy == "kv_aware":
                inputs = kv_input_counts(text)
                result.notes.append(
                    "token inputs of its KV scoring (vllm_router_kv_routing_inputs_total): "
                    + (", ".join(f"{k} {v:g}" for k, v in inputs.items()) or "none")
                )
    if (dead := s.procs.exited()) is not None:
        result.notes.append(f"{dead.name} exited (code {dead.proc.returncode}) during the replay")
    if code != 0:
        why = " (killed at --replay-timeout-s)" if wall_s >= opts.replay_timeout_s else ""
        result.status = f"failed: kvc bench live exited {code}{why} (see {out_dir / 'replay.log'})"
        return
    summary = json.loads((out_dir / "summary.json").read_text())
    result.summary = summary["policies"][target.slug]
    note = status_note(result.summary.get("live") or {})
    if note:
        result.notes.append(note)
    if not result.summary.get("completed"):
        result.status = f"failed: no request served; {note or 'see replay.log'}"


def run_all(opts: FieldOptions, results: list[TargetResult]) -> None:
    """Every target in order, each result appended as it is known (kept on Ctrl-C)."""
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
    p.add_argument(
        "--conductor-arg", action="append", default=[], metavar="ARG",
        help="pass ARG to the conductor targets' kvc conductor (repeatable; "
        "--conductor-arg=--admission=none)",
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
        conductor_args=tuple(ns.conductor_arg),
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
    command = shlex.join(["python", "-m", "bench.field_routers", *args])

    def report(results: list[TargetResult]) -> Path:
        return write_report(opts, results, command)

    return run_then_report(partial(run_all, opts), report)


if __name__ == "__main__":
    sys.exit(main())
