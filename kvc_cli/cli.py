"""``kvc``: the command line of kv-conductor.

  kvc conductor [flags]   run the OpenAI-compatible conductor (HTTP)
  kvc agent [flags]       run a node agent (gRPC) around an engine
  kvc demo [flags]        conductor on 127.0.0.1:8000 + a prefill and a decode agent
  kvc probe URL           health probe for containers (http://… or grpc[s]://host:port)
  kvc certs --out DIR     a private CA and conductor/agent certificates for mTLS
  kvc bench replay ...    replay a Mooncake trace on the simulated fleet (docs/simulator.md)
  kvc sim-engine [flags]  a simulated vLLM engine, timing from a profile (docs/fleet.md)
  kvc bench live ...      replay it against a live OpenAI-compatible URL; bench compare
  kvc fleet up [flags]    simulated vLLM engines + agents + conductors on loopback (docs/fleet.md)

Every setting of the conductor and the agent is a flag and an environment variable
(pydantic-settings' CLI source adds them, kvc_cli.settings_cli); ``--help`` lists them,
grouped, with their choices and defaults. ``--log-level`` (or ``KVC_LOG_LEVEL``) goes
before or after the subcommand.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvc.logs import setup_logging
from kvc.version import package_version
from kvc_cli.event_loop import run_event_loop
from kvc_cli.settings_cli import InvalidSettings, SettingsCommand, settings_from_args
from kvc_cli.sim_engine import register_sim_engine

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


class LoggingSettings(BaseSettings):
    """Log verbosity of every ``kvc`` command: ``--log-level`` or ``KVC_LOG_LEVEL``."""

    model_config = SettingsConfigDict(env_prefix="KVC_", extra="forbid")

    log_level: LogLevel = Field("INFO", description="Log level, any case")

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value


def _run_conductor(ns: argparse.Namespace, log_level: LogLevel) -> int:
    from conductor.main import serve
    from conductor.settings import ConductorSettings

    return serve(settings_from_args(ConductorSettings, ns), log_level)


def _run_agent(ns: argparse.Namespace, log_level: LogLevel) -> int:
    from node_agent.errors import EngineError
    from node_agent.main import serve
    from node_agent.settings import AgentSettings

    settings = settings_from_args(AgentSettings, ns)
    try:
        run_event_loop(serve(settings))
    except EngineError as exc:  # no engine to serve: a missing extra, vLLM that died
        print(f"kvc agent: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _run_demo(ns: argparse.Namespace, log_level: LogLevel) -> int:
    from kvc_cli.demo import DemoOptions, run_demo

    return run_demo(
        DemoOptions(
            host=ns.host,
            port=ns.port,
            prefill_port=ns.prefill_port,
            decode_port=ns.decode_port,
            prefill_metrics_port=ns.prefill_metrics_port,
            decode_metrics_port=ns.decode_metrics_port,
            log_level=log_level,
            startup_timeout_s=ns.startup_timeout_s,
        )
    )


def _run_probe(ns: argparse.Namespace, log_level: LogLevel) -> int:
    from kvc_cli.probe import main as probe_main

    return probe_main(ns.url, ns.timeout_s)


def _run_certs(ns: argparse.Namespace, log_level: LogLevel) -> int:
    from kvc.tls import write_bundle

    try:
        written = write_bundle(Path(ns.out), days=ns.days, extra_dns=ns.dns, nodes=ns.node)
    except (OSError, ValueError) as exc:
        print(f"kvc certs: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    print(
        "conductors: --tls-cert-file conductor.pem --tls-key-file conductor-key.pem "
        "--tls-ca-file ca.pem; agents: the same with agent.pem and agent-key.pem, or "
        "agent-NODE.pem and agent-NODE-key.pem with --node-id NODE. "
        "Keep ca-key.pem offline (docs/security.md).",
        file=sys.stderr,
    )
    return 0


def _run_bench_replay(ns: argparse.Namespace, log_level: LogLevel) -> int:
    from pathlib import Path

    from kvc_sim.profile import SimConfigError
    from kvc_sim.replay import ProgressLine, ReplayOptions, run_scenario
    from kvc_sim.scenario import load_scenario
    from kvc_sim.trace import TraceError, read_trace

    try:
        scenario = load_scenario(ns.scenario)
        scenario.select(ns.policy)
        if ns.speed is not None and ns.speed <= 0:
            raise SimConfigError("--speed must be > 0")
        requests = read_trace(ns.trace, limit=ns.limit)
    except (SimConfigError, TraceError, OSError) as exc:
        print(f"kvc bench replay: {exc}", file=sys.stderr)
        return 2
    options = ReplayOptions(
        trace_name=str(ns.trace),
        policy=ns.policy,
        speed=ns.speed,
        plots=not ns.no_plots,
        progress=None if ns.quiet else ProgressLine(),
    )
    summary = run_scenario(scenario, requests, Path(ns.out), options)
    for name, block in summary["policies"].items():
        cells = [f"{name:<28}"]
        for label, key, unit in (
            ("hit", "hit_ratio", "%"),
            ("TTFT mean", "ttft_mean_s", "s"),
            ("p90", "ttft_p90_s", "s"),
            ("rejected", "rejected", ""),
            ("prefill GPU", "prefill_gpu_s", "s"),
        ):
            value = block[key]
            if value is None:
                cells.append(f"{label} -")
            elif unit == "%":
                cells.append(f"{label} {value:.1%}")
            else:
                cells.append(f"{label} {value:,.2f}{unit}" if unit else f"{label} {value}")
        print("  ".join(cells))
    print(f"wrote {Path(ns.out) / 'summary.json'}")
    return 0


def _run_fleet_up(ns: argparse.Namespace, log_level: LogLevel) -> int:
    from kvc_cli.fleet import FleetOptions, run_fleet

    return run_fleet(
        FleetOptions(
            prefill=ns.prefill,
            decode=ns.decode,
            aggregated=ns.aggregated,
            conductors=ns.conductors,
            host=ns.host,
            port=ns.port,
            base_port=ns.base_port,
            model_dir=ns.model_dir,
            served_model_name=ns.served_model_name,
            profile=ns.profile,
            time_scale=ns.time_scale,
            block_size=ns.block_size,
            num_gpu_blocks=ns.num_gpu_blocks,
            max_model_len=ns.max_model_len,
            policy=ns.policy,
            ttft_slo_s=ns.ttft_slo_s,
            tbt_slo_s=ns.tbt_slo_s,
            max_running=ns.max_running,
            prefix_pulls=ns.prefix_pulls,
            calibration_turns=ns.calibration_turns,
            engine_args=tuple(ns.engine_arg),
            agent_args=tuple(ns.agent_arg),
            conductor_args=tuple(ns.conductor_arg),
            log_dir=ns.log_dir,
            log_level=log_level,
            startup_timeout_s=ns.startup_timeout_s,
        )
    )


def _add_fleet(
    command: Callable[..., argparse.ArgumentParser],
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    from kvc_cli.fleet import FleetOptions

    d = FleetOptions()
    p_fleet = command("fleet", "a simulated fleet on this machine (docs/fleet.md)", sub)
    fleet_sub = p_fleet.add_subparsers(dest="fleet_command", required=True)
    p_up = command(
        "up", "start simulated vLLM engines, an agent per engine and conductors", fleet_sub
    )
    p_up.add_argument("--prefill", type=int, default=d.prefill, help="prefill engines (P/D)")
    p_up.add_argument("--decode", type=int, default=d.decode, help="decode engines (P/D)")
    p_up.add_argument(
        "--aggregated", type=int, default=d.aggregated, help="engines that prefill and decode"
    )
    p_up.add_argument("--conductors", type=int, default=d.conductors)
    p_up.add_argument("--host", default=d.host, help="address every process binds")
    p_up.add_argument("--port", type=int, default=d.port, help="first conductor's HTTP port")
    p_up.add_argument(
        "--base-port", type=int, default=d.base_port,
        help="engines and agents take 4 ports each from here",
    )  # fmt: skip
    p_up.add_argument("--model-dir", default=d.model_dir, help="default: the shipped tiny model")
    p_up.add_argument("--served-model-name", default=d.served_model_name)
    p_up.add_argument("--profile", default=d.profile, help="timing profile (kvc_sim/profiles)")
    p_up.add_argument(
        "--time-scale", type=float, default=d.time_scale,
        help="wall seconds per profile second (0.5: twice as fast)",
    )  # fmt: skip
    p_up.add_argument("--block-size", type=int, default=d.block_size, help="KV block tokens")
    p_up.add_argument(
        "--num-gpu-blocks", type=int, default=d.num_gpu_blocks, help="KV blocks per engine"
    )
    p_up.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p_up.add_argument(
        "--policy", default=d.policy,
        choices=["round_robin", "least_loaded", "local_prefix", "kv_centric", "kv_adaptive"],
    )  # fmt: skip
    p_up.add_argument(
        "--ttft-slo-s", type=float, default=d.ttft_slo_s, help="TTFT SLO in trace time"
    )
    p_up.add_argument("--tbt-slo-s", type=float, default=d.tbt_slo_s, help="TBT SLO, trace time")
    p_up.add_argument(
        "--max-running", type=int, default=d.max_running, help="generations per agent"
    )
    p_up.add_argument(
        "--prefix-pulls", action=argparse.BooleanOptionalAction, default=d.prefix_pulls,
        help="prefill engines pull hot prefixes from each other through kv_transfer_params "
        "(off by default: the live-parity scenario's simulator plans no pulls)",
    )  # fmt: skip
    p_up.add_argument(
        "--calibration-turns", type=int, default=d.calibration_turns, metavar="N",
        help="agents that calibrate their engines at once, the others waiting their turn "
        "(default: one per CPU core; 0: all at once; the engines share this machine's CPUs "
        "and would measure each other)",
    )  # fmt: skip
    for kind in ("engine", "agent", "conductor"):
        p_up.add_argument(
            f"--{kind}-arg", action="append", default=[], metavar="ARG",
            help=f"pass ARG to every {kind} (repeatable; --{kind}-arg=--flag=value)",
        )  # fmt: skip
    p_up.add_argument("--log-dir", default=d.log_dir, help="one log file per process")
    p_up.add_argument("--startup-timeout-s", type=float, default=d.startup_timeout_s)
    p_up.set_defaults(func=_run_fleet_up)


def build_parser() -> argparse.ArgumentParser:
    from conductor.settings import ConductorSettings
    from kvc_cli.bench_live import add_bench_commands
    from node_agent.settings import AgentSettings

    parser = argparse.ArgumentParser(prog="kvc", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    parser.set_defaults(logging_command=SettingsCommand(parser, LoggingSettings))
    sub = parser.add_subparsers(dest="command", required=True)

    def command(
        name: str, help_text: str, parent: argparse._SubParsersAction[argparse.ArgumentParser] = sub
    ) -> argparse.ArgumentParser:
        """A subcommand that also takes ``--log-level`` after its name."""
        p = parent.add_parser(name, help=help_text, description=help_text)
        SettingsCommand(p, LoggingSettings)
        return p

    p_conductor = command("conductor", "run the conductor (OpenAI API over HTTP)")
    p_conductor.set_defaults(
        func=_run_conductor, settings_command=SettingsCommand(p_conductor, ConductorSettings)
    )
    p_agent = command("agent", "run a node agent (gRPC) around an engine")
    p_agent.set_defaults(func=_run_agent, settings_command=SettingsCommand(p_agent, AgentSettings))
    p_demo = command("demo", "conductor on 127.0.0.1:8000 with a prefill and a decode agent")
    p_demo.add_argument("--host", default="127.0.0.1")
    p_demo.add_argument("--port", type=int, default=8000)
    p_demo.add_argument("--prefill-port", type=int, default=50061)
    p_demo.add_argument("--decode-port", type=int, default=50062)
    p_demo.add_argument(
        "--prefill-metrics-port", type=int, default=0,
        help="serve the prefill agent's Prometheus /metrics here (0: off)",
    )  # fmt: skip
    p_demo.add_argument(
        "--decode-metrics-port", type=int, default=0,
        help="serve the decode agent's Prometheus /metrics here (0: off)",
    )  # fmt: skip
    p_demo.add_argument("--startup-timeout-s", type=float, default=180.0)
    p_demo.set_defaults(func=_run_demo)
    p_probe = command(
        "probe",
        "health probe: http://host:port/health, grpc://host:port, or grpcs://host:port "
        "(mTLS with the files in KVC_AGENT_TLS_CERT_FILE, _KEY_FILE, _CA_FILE)",
    )
    p_probe.add_argument("url")
    p_probe.add_argument("--timeout-s", type=float, default=3.0)
    p_probe.set_defaults(func=_run_probe)
    p_certs = command(
        "certs", "write a private CA and a conductor and an agent certificate for mTLS"
    )
    p_certs.add_argument("--out", required=True, help="folder for the PEM files")
    p_certs.add_argument("--days", type=int, default=365, help="validity of every certificate")
    p_certs.add_argument(
        "--dns", action="append", default=[], help="an extra DNS name in every certificate"
    )
    p_certs.add_argument(
        "--node",
        action="append",
        default=[],
        help="also an agent certificate naming this node id (agent-NODE.pem; repeatable): "
        "KV pull grants bound to a node serve only its certificate",
    )
    p_certs.set_defaults(func=_run_certs)
    register_sim_engine(command)
    p_bench = command("bench", "benchmarks: trace replay on the simulator")
    bench_sub = p_bench.add_subparsers(dest="bench_command", required=True)
    p_replay = command(
        "replay",
        "replay a Mooncake trace through the simulated fleet (same scheduler code)",
        bench_sub,
    )
    p_replay.add_argument("--trace", required=True, help="Mooncake JSONL trace file")
    p_replay.add_argument(
        "--scenario", required=True, help="bundled scenario name or a scenario JSON file"
    )
    p_replay.add_argument(
        "--policy", default=None, help="run only this run/policy (default: every one compared)"
    )
    p_replay.add_argument(
        "--speed", type=float, default=None, help="replay speed (replaces the scenario's)"
    )
    p_replay.add_argument("--out", required=True, help="output folder (summary.json, plots)")
    p_replay.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    p_replay.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p_replay.add_argument("--quiet", action="store_true", help="no progress bar")
    p_replay.set_defaults(func=_run_bench_replay)
    add_bench_commands(command, bench_sub)  # bench live, bench compare
    _add_fleet(command, sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        log_level = ns.logging_command.load(ns).log_level
        setup_logging(log_level)
        code: int = ns.func(ns, log_level)
    except InvalidSettings as exc:
        print(f"kvc {ns.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code
