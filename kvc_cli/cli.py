"""``kvc``: the command line of kv-conductor.

  kvc conductor [flags]   run the OpenAI-compatible conductor (HTTP)
  kvc agent [flags]       run a node agent (gRPC) around an engine
  kvc demo [flags]        conductor on 127.0.0.1:8000 + a prefill and a decode agent
  kvc probe URL           health probe for containers (http://… or grpc://host:port)
  kvc bench replay ...    replay a Mooncake trace on the simulated fleet (docs/simulator.md)

Every setting is a flag and an environment variable; ``--help`` lists them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from kvc_cli.settings_cli import SettingsError, add_settings_arguments, settings_from_args


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _run_conductor(ns: argparse.Namespace) -> int:
    from conductor.main import serve
    from conductor.settings import ConductorSettings

    serve(settings_from_args(ConductorSettings, ns), ns.log_level)
    return 0


def _run_agent(ns: argparse.Namespace) -> int:
    from node_agent.main import serve
    from node_agent.settings import AgentSettings

    settings = settings_from_args(AgentSettings, ns)
    asyncio.run(serve(settings))
    return 0


def _run_demo(ns: argparse.Namespace) -> int:
    from kvc_cli.demo import DemoOptions, run_demo

    return run_demo(
        DemoOptions(
            host=ns.host,
            port=ns.port,
            prefill_port=ns.prefill_port,
            decode_port=ns.decode_port,
            prefill_metrics_port=ns.prefill_metrics_port,
            decode_metrics_port=ns.decode_metrics_port,
            log_level=ns.log_level,
            startup_timeout_s=ns.startup_timeout_s,
        )
    )


def _run_probe(ns: argparse.Namespace) -> int:
    from kvc_cli.probe import main as probe_main

    return probe_main(ns.url, ns.timeout_s)


def _run_bench_replay(ns: argparse.Namespace) -> int:
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


def build_parser() -> argparse.ArgumentParser:
    from conductor.settings import ConductorSettings
    from node_agent.settings import AgentSettings

    parser = argparse.ArgumentParser(prog="kvc", description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True)
    p_conductor = sub.add_parser("conductor", help="run the conductor (OpenAI API over HTTP)")
    add_settings_arguments(p_conductor, ConductorSettings)
    p_conductor.set_defaults(func=_run_conductor)
    p_agent = sub.add_parser("agent", help="run a node agent (gRPC) around an engine")
    add_settings_arguments(p_agent, AgentSettings)
    p_agent.set_defaults(func=_run_agent)
    p_demo = sub.add_parser(
        "demo", help="conductor on 127.0.0.1:8000 with a prefill and a decode agent"
    )
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
    p_probe = sub.add_parser(
        "probe", help="health probe: http://host:port/health or grpc://host:port"
    )
    p_probe.add_argument("url")
    p_probe.add_argument("--timeout-s", type=float, default=3.0)
    p_probe.set_defaults(func=_run_probe)
    p_bench = sub.add_parser("bench", help="benchmarks: trace replay on the simulator")
    bench_sub = p_bench.add_subparsers(dest="bench_command", required=True)
    p_replay = bench_sub.add_parser(
        "replay",
        help="replay a Mooncake trace through the simulated fleet (same scheduler code)",
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
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    _setup_logging(ns.log_level)
    try:
        code: int = ns.func(ns)
    except SettingsError as exc:
        print(f"kvc {ns.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code
