"""``kvc fleet up``: a whole simulated fleet on one machine, for live trace replay.

What it starts (each its own process, as in production, on loopback by default):

* ``P`` prefill + ``D`` decode simulated vLLM engines (``kvc sim-engine``, kvc_sim.vllm_sim)
  disaggregated through vLLM's ``kv_transfer_params``, and/or ``A`` aggregated ones (prefill
  and decode on the same engine), all with the same profile and time scale;
* one node agent per engine (``kvc agent --engine vllm``) attached to it by URL, mirroring its
  KV events (ZMQ, with the replay socket); P/D agents run ``--pd-connector nixl``;
* ``C`` conductors, each knowing every agent (static list), on ``port``, ``port + 1``, …

It waits until every conductor reports every agent usable, prints the endpoints, and on
Ctrl-C / SIGTERM stops everything (kvc_cli.supervisor). Each child's output goes to its own
file under ``--log-dir`` (a fleet of 64 engines writing to one terminal is unreadable).

Ports: engine ``i`` (in start order) takes two consecutive ports from ``--base-port``: its
HTTP port and its agent's gRPC port; all are checked free before anything starts. KV events
and their replay go over ZMQ ``ipc://`` sockets in a private temporary folder: the engine
binds them (as vLLM binds an endpoint with ``*``), nothing listens beyond this machine.

Time: ``--time-scale s`` makes every engine run the profile's durations × s (wall). The
conductors' SLOs are given in trace time (``--ttft-slo-s``, ``--tbt-slo-s``) and scaled by
``s`` too, so admission decisions are the ones the simulator makes in virtual time.

Knobs beyond the flags: ``--engine-arg``, ``--agent-arg``, ``--conductor-arg`` (repeatable)
pass any other flag through to every process of that kind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvc.processes import port_free
from kvc_cli.supervisor import Supervisor, stop_on_signals

__all__ = [
    "FleetOptions",
    "FleetPlan",
    "ProcessSpec",
    "all_agents_usable",
    "plan_fleet",
    "run_fleet",
]

_PORTS_PER_ENGINE = 2


@dataclass(frozen=True, slots=True)
class FleetOptions:
    prefill: int = 2
    decode: int = 2
    aggregated: int = 0
    conductors: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    base_port: int = 31000
    model_dir: str = ""  # empty: the tiny model shipped in the package
    served_model_name: str = "tiny-llama"
    profile: str = "llama3-70b-8xa800"
    time_scale: float = 1.0
    block_size: int = 512
    num_gpu_blocks: int = 5860
    max_model_len: int = 262_144
    policy: str = "kv_adaptive"
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    max_running: int = 256
    # Hot-spot replication between the engines (LendBlocks/PullBlocks through
    # kv_transfer_params). Off: the live-parity scenario's simulator plans no pulls.
    prefix_pulls: bool = False
    # Agents calibrating their engines at once (``--calibration-turns``): the engines
    # share this machine's CPUs, and 16 calibrating together measured each other (fits
    # 2-6x off). None: one per CPU core; 0: all at once.
    calibration_turns: int | None = None
    engine_args: tuple[str, ...] = ()
    agent_args: tuple[str, ...] = ()
    conductor_args: tuple[str, ...] = ()
    log_dir: str = "fleet-logs"
    log_level: str = "INFO"
    startup_timeout_s: float = 300.0
    grace_s: float = 15.0


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    name: str  # also the log file's stem
    args: tuple[str, ...]  # after ``python -m kvc_cli``
    ports: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FleetPlan:
    engines: tuple[ProcessSpec, ...]
    agents: tuple[ProcessSpec, ...]
    conductors: tuple[ProcessSpec, ...]
    conductor_urls: tuple[str, ...]
    agent_addresses: tuple[str, ...] = field(default=())

    @property
    def processes(self) -> tuple[ProcessSpec, ...]:
        return self.engines + self.agents + self.conductors

    @property
    def ports(self) -> list[int]:
        return [p for spec in self.processes for p in spec.ports]


class FleetConfigError(ValueError):
    """Options that cannot make a fleet (reported with exit code 2)."""


def _validate(opts: FleetOptions) -> None:
    if min(opts.prefill, opts.decode, opts.aggregated) < 0:
        raise FleetConfigError("engine counts must be >= 0")
    if (opts.prefill == 0) != (opts.decode == 0):
        raise FleetConfigError(
            "a disaggregated fleet needs both --prefill and --decode engines (or neither)"
        )
    if opts.prefill + opts.aggregated == 0:
        raise FleetConfigError("no engines: give --prefill/--decode and/or --aggregated")
    if opts.conductors < 1:
        raise FleetConfigError("--conductors must be >= 1")
    if opts.time_scale <= 0:
        raise FleetConfigError("--time-scale must be > 0")
    if opts.calibration_turns is not None and opts.calibration_turns < 0:
        raise FleetConfigError("--calibration-turns must be >= 0")
    if opts.ttft_slo_s <= 0 or opts.tbt_slo_s <= 0:
        raise FleetConfigError("SLOs must be > 0")
    last = opts.base_port + _PORTS_PER_ENGINE * (opts.prefill + opts.decode + opts.aggregated)
    if opts.base_port <= 0 or last > 65_535 or opts.port + opts.conductors - 1 > 65_535:
        raise FleetConfigError("ports out of range")


_CALIBRATION_S = 20.0  # one agent's calibration budget at time scale 1


def calibration_turns(opts: FleetOptions) -> int:
    """Agents that calibrate at once: ``opts.calibration_turns``, or one per CPU core."""
    if opts.calibration_turns is not None:
        return opts.calibration_turns
    return max(1, os.cpu_count() or 1)


def plan_fleet(opts: FleetOptions, ipc_dir: str) -> FleetPlan:
    """Every process of the fleet with its arguments and ports (nothing started); the
    engines' KV-event sockets are ``ipc://`` files in ``ipc_dir``."""
    _validate(opts)
    host, level = opts.host, ("--log-level", opts.log_level)
    model = ("--model", opts.model_dir) if opts.model_dir else ()
    roles = (
        [("prefill", i) for i in range(opts.prefill)]
        + [("decode", i) for i in range(opts.decode)]
        + [("both", i) for i in range(opts.aggregated)]
    )
    engines: list[ProcessSpec] = []
    agents: list[ProcessSpec] = []
    turns = calibration_turns(opts)
    # An agent's own calibration takes ~10 s of the profile's time; taking turns, the
    # last one also waits for the others (the wait counts against its budget).
    rounds = -(-len(roles) // turns) if turns else 1
    budget_s = min(600.0, _CALIBRATION_S * max(1.0, opts.time_scale) * rounds)
    for k, (role, i) in enumerate(roles):
        http = opts.base_port + _PORTS_PER_ENGINE * k
        grpc = http + 1
        name = f"{'aggregated' if role == 'both' else role}-{i}"
        events, replay = f"ipc://{ipc_dir}/{name}.events", f"ipc://{ipc_dir}/{name}.replay"
        events_config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": events,
            "replay_endpoint": replay,
            "topic": "kv-events",
        }
        engine_args = (
            *level, "sim-engine", "--host", host, "--port", str(http),
            *(("--model-dir", opts.model_dir) if opts.model_dir else ()),
            "--served-model-name", opts.served_model_name,
            "--engine-id", f"engine-{name}",
            "--profile", opts.profile, "--time-scale", repr(opts.time_scale),
            "--block-size", str(opts.block_size),
            "--num-gpu-blocks", str(opts.num_gpu_blocks),
            "--max-model-len", str(opts.max_model_len),
            "--kv-events-config", json.dumps(events_config),
            *(("--scheduling-policy", "priority") if opts.prefix_pulls else ()),
            *opts.engine_args,
        )  # fmt: skip
        engines.append(ProcessSpec(f"engine-{name}", engine_args, (http,)))
        agent_args = (
            *level, "agent", "--engine", "vllm", "--role", role,
            "--host", host, "--port", str(grpc), "--stream-port", "0", "--node-id", name,
            *model, "--served-model-name", opts.served_model_name,
            "--vllm-url", f"http://{host}:{http}",
            "--kv-events-endpoint", events, "--kv-events-replay-endpoint", replay,
            "--pd-connector", "none" if role == "both" else "nixl",
            "--max-running", str(opts.max_running),
            "--calibration-turns", str(turns), "--calibration-budget-s", repr(budget_s),
            *(
                ("--vllm-prefix-pulls", "--vllm-prefix-pull-priority=-1")
                if opts.prefix_pulls else ("--no-vllm-prefix-pulls",)
            ),
            *opts.agent_args,
        )  # fmt: skip
        agents.append(ProcessSpec(f"agent-{name}", agent_args, (grpc,)))
    addresses = tuple(f"{host}:{spec.ports[0]}" for spec in agents)
    conductors: list[ProcessSpec] = []
    urls: list[str] = []
    for c in range(opts.conductors):
        port = opts.port + c
        urls.append(f"http://{host}:{port}")
        conductor_args = (
            *level, "conductor", "--host", host, "--port", str(port),
            *model, "--served-model-name", opts.served_model_name,
            "--agents", ",".join(addresses), "--drain-delay-s", "0",
            "--policy", opts.policy,
            "--ttft-slo-s", repr(opts.ttft_slo_s * opts.time_scale),
            "--tbt-slo-s", repr(opts.tbt_slo_s * opts.time_scale),
            *opts.conductor_args,
        )  # fmt: skip
        conductors.append(ProcessSpec(f"conductor-{c}", conductor_args, (port,)))
    return FleetPlan(tuple(engines), tuple(agents), tuple(conductors), tuple(urls), addresses)


def all_agents_usable(base: str, expected: int) -> bool:
    """Whether the conductor at ``base`` answers /ready with ``expected`` usable agents."""
    with contextlib.suppress(httpx.HTTPError, ValueError):
        response = httpx.get(f"{base}/ready", timeout=2.0)
        agents = response.json().get("agents") or []
        return response.status_code == 200 and sum(bool(a.get("usable")) for a in agents) == (
            expected
        )
    return False


def run_fleet(opts: FleetOptions) -> int:
    ipc_dir = tempfile.mkdtemp(prefix="kvc-fleet-")
    try:
        return _plan_and_run(opts, ipc_dir)
    finally:
        shutil.rmtree(ipc_dir, ignore_errors=True)


def _plan_and_run(opts: FleetOptions, ipc_dir: str) -> int:
    try:
        plan = plan_fleet(opts, ipc_dir)
    except FleetConfigError as exc:
        print(f"kvc fleet up: {exc}", file=sys.stderr)
        return 2
    ports = plan.ports
    if len(set(ports)) != len(ports):
        print("kvc fleet up: the conductor ports overlap the engines' ports", file=sys.stderr)
        return 2
    busy = [p for p in ports if not port_free(opts.host, p)]
    if busy:
        print(f"kvc fleet up: ports already in use on {opts.host}: {busy[:8]}", file=sys.stderr)
        return 2
    log_dir = Path(opts.log_dir)
    with stop_on_signals() as stop:
        sup = Supervisor(opts.grace_s, log_dir)
        try:
            return _run(opts, plan, sup, stop, log_dir)
        finally:
            sup.stop_all()
            print("kvc fleet: stopped", file=sys.stderr, flush=True)


def _run(
    opts: FleetOptions,
    plan: FleetPlan,
    sup: Supervisor,
    stop: threading.Event,
    log_dir: Path,
) -> int:
    for spec in plan.processes:  # engines, then agents, then conductors
        sup.spawn(spec.name, spec.args)
    n = len(plan.agents)
    probes = [lambda url=url: all_agents_usable(url, n) for url in plan.conductor_urls]
    failure = sup.wait_ready(probes, stop, opts.startup_timeout_s)
    if failure == "stopped":
        return 0
    if failure is not None:
        print(f"kvc fleet up: {failure} (logs in {log_dir}/)", file=sys.stderr)
        return 1
    shape = (
        f"{opts.prefill} prefill + {opts.decode} decode"
        + (f" + {opts.aggregated} aggregated" if opts.aggregated else "")
        if opts.prefill
        else f"{opts.aggregated} aggregated"
    )
    lines = "".join(f"  OpenAI base URL: {url}/v1\n" for url in plan.conductor_urls)
    print(
        f"\nkv-conductor fleet is ready: {shape} simulated engines "
        f"(profile {opts.profile}, time scale {opts.time_scale:g}), {n} agents, "
        f"{len(plan.conductor_urls)} conductor(s), policy {opts.policy}.\n"
        f"{lines}"
        f"  model {opts.served_model_name!r}; logs in {log_dir}/\n"
        f"  Replay a trace: kvc bench live --url {plan.conductor_urls[0]} "
        f"--trace TRACE --time-scale {opts.time_scale:g} --out OUT\n"
        f"  Press Ctrl-C to stop.\n",
        flush=True,
    )
    while not stop.is_set():
        if (dead := sup.exited()) is not None:
            print(
                f"kvc fleet: the {dead.name} exited with code {dead.proc.returncode} "
                f"(logs in {log_dir}/)",
                file=sys.stderr,
            )
            return 1
        stop.wait(0.5)
    return 0
