"""``kvc``: the command line of kv-conductor.

  kvc conductor [flags]   run the OpenAI-compatible conductor (HTTP)
  kvc agent [flags]       run a node agent (gRPC) around an engine
  kvc demo [flags]        conductor on 127.0.0.1:8000 + a prefill and a decode agent
  kvc probe URL           health probe for containers (http://… or grpc://host:port)

Every setting is a flag and an environment variable; ``--help`` lists them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from types import FrameType

from kvc.settings_cli import SettingsError, add_settings_arguments, settings_from_args


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _run_conductor(ns: argparse.Namespace) -> int:
    import uvicorn

    from conductor.app import create_app
    from conductor.settings import ConductorSettings

    class GracefulServer(uvicorn.Server):
        """Drains on SIGTERM/SIGINT and exits 0, like the agents (uvicorn would
        re-raise the signal after its graceful shutdown and exit with -15)."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

    settings = settings_from_args(ConductorSettings, ns)
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=ns.log_level.lower(),
        timeout_graceful_shutdown=30,
    )
    GracefulServer(config).run()
    return 0


def _run_agent(ns: argparse.Namespace) -> int:
    from node_agent.main import serve
    from node_agent.settings import AgentSettings

    settings = settings_from_args(AgentSettings, ns)
    asyncio.run(serve(settings))
    return 0


def _run_demo(ns: argparse.Namespace) -> int:
    from kvc.demo import DemoOptions, run_demo

    return run_demo(
        DemoOptions(
            host=ns.host,
            port=ns.port,
            prefill_port=ns.prefill_port,
            decode_port=ns.decode_port,
            log_level=ns.log_level,
            startup_timeout_s=ns.startup_timeout_s,
        )
    )


def _run_probe(ns: argparse.Namespace) -> int:
    from kvc.probe import main as probe_main

    return probe_main(ns.url, ns.timeout_s)


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
    p_demo.add_argument("--startup-timeout-s", type=float, default=180.0)
    p_demo.set_defaults(func=_run_demo)
    p_probe = sub.add_parser(
        "probe", help="health probe: http://host:port/health or grpc://host:port"
    )
    p_probe.add_argument("url")
    p_probe.add_argument("--timeout-s", type=float, default=3.0)
    p_probe.set_defaults(func=_run_probe)
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


if __name__ == "__main__":
    raise SystemExit(main())
